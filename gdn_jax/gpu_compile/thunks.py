"""What a compiled GPU program launches, read from XLA's dump of it.

XLA:GPU runs a program as a sequence of thunks (``*.thunk_sequence.txt`` in a dump): kernels,
library calls, copies and memsets, each a launch on the GPU, and containers (loops,
conditionals, async starts) around them. A ``while`` thunk whose trip count XLA knows runs
its body that many times and never its condition; one whose count it does not know runs
the condition before every trip and after the last, each time copying the predicate to the
host and waiting for it (XLA's ``WhileThunk``). The trip counts are in the optimised HLO
(``known_trip_count``), joined to the thunks by the names in ``*.thunk_metadata.txt``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

# Thunks that launch nothing themselves: waits between streams, and containers whose
# contents are counted instead (an async start holds the work it starts).
_NOT_LAUNCHES = {
    "kAsyncDone",
    "kAsyncStart",
    "kCommandBuffer",
    "kConditional",
    "kSequential",
    "kWaitForStreams",
    "kWhile",
}
# A thunk that launches one operation at a computed address, with that operation nested.
_ONE_LAUNCH_WITH_NESTED = {"kDynamicSliceFusion"}
_LINE = re.compile(r"^(?P<indent>\s*)(?P<id>\d+): (?P<kind>k\w+)\s*(?P<rest>.*)$")
_MARKER = re.compile(r"^(?P<indent>\s*)(?P<name>[a-z_ ]+\w*):\s*$")
_SHARED = re.compile(r"shared_memory: (\d+) bytes")
_GRID = re.compile(r"grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]")


@dataclasses.dataclass(frozen=True)
class Thunk:
    """One line of the thunk sequence and what is nested under it."""

    id: int
    kind: str
    name: str
    shared_memory: int | None
    grid: tuple[int, ...] | None
    threads: tuple[int, ...] | None
    groups: tuple[tuple[str, tuple[Thunk, ...]], ...]  # (marker or "", thunks) in order

    def children(self, marker: str | None = None) -> tuple[Thunk, ...]:
        return tuple(t for m, ts in self.groups if marker in (None, m) for t in ts)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop of the program: its HLO name, trips (None: not known to XLA) and the launches
    of one trip (the body's, and the condition's when the trips are not known)."""

    name: str
    trips: int | None
    launches_per_trip: int


@dataclasses.dataclass(frozen=True)
class Launches:
    """The launches of one call of a program: in all, at the top level, and by loop."""

    total: int
    top_level: int
    loops: tuple[Loop, ...]
    kernels: tuple[Thunk, ...]  # every launching thunk, loop bodies included, once each


def parse_sequence(text: str) -> tuple[Thunk, ...]:
    """The thunks of a ``*.thunk_sequence.txt``, nested as printed."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    thunks, _ = _parse_block(lines, 0, -1)
    return thunks


def _parse_block(lines, start, parent_indent):
    """The thunks from ``lines[start]`` on that sit deeper than ``parent_indent``, and the
    index after them. Marker lines (``condition:``, ``body:``) start a new group."""
    groups, marker, index = [], "", start
    current: list[Thunk] = []
    while index < len(lines):
        line = lines[index]
        match = _LINE.match(line)
        indent = len(match["indent"]) if match else _indent(line)
        if indent <= parent_indent and not (match is None and indent == parent_indent):
            break
        if match is None:
            found = _MARKER.match(line)
            if found is not None:
                if current:
                    groups.append((marker, tuple(current)))
                marker, current = found["name"].strip(), []
            index += 1
            continue
        nested, index = _parse_block(lines, index + 1, indent)
        current.append(_thunk(match, nested))
    if current:
        groups.append((marker, tuple(current)))
    if parent_indent < 0:
        return tuple(t for _, ts in groups for t in ts), index
    return tuple(groups), index


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _thunk(match, groups) -> Thunk:
    rest = match["rest"]
    after_links = rest.split("]", 1)[1] if rest.startswith("[") else rest
    words = after_links.split()
    shared = _SHARED.search(rest)
    grid = _GRID.search(rest)
    return Thunk(
        id=int(match["id"]),
        kind=match["kind"],
        name=words[0] if words else "",
        shared_memory=int(shared[1]) if shared else None,
        grid=tuple(int(n) for n in grid[1].split(",")) if grid else None,
        threads=tuple(int(n) for n in grid[2].split(",")) if grid else None,
        groups=groups if isinstance(groups, tuple) else (),
    )


def thunk_names(metadata: str) -> dict[int, str]:
    """Thunk id to the HLO instruction it runs, from a ``*.thunk_metadata.txt``."""
    names = {}
    for block in metadata.split("thunk_metadata {")[1:]:
        annotation = re.search(r'profile_annotation: "([^"]*)"', block)
        thunk_id = re.search(r"thunk_id: (\d+)", block)
        if annotation and thunk_id:
            names[int(thunk_id[1])] = annotation[1]
    return names


def trip_counts(hlo: str) -> dict[str, int]:
    """Each ``while`` of an optimised HLO module whose trip count XLA knows, by name."""
    counts = {}
    for match in re.finditer(r"%(\S+) = [^\n]*? while\([^\n]*", hlo):
        config = re.search(r"backend_config=(\{.*\})", match[0])
        if config is None:
            continue
        try:
            known = json.loads(config[1]).get("known_trip_count")
        except json.JSONDecodeError:
            continue
        if known is not None:
            counts[match[1]] = int(known["n"])
    return counts


def count_launches(thunks, names: dict[int, str], trips: dict[str, int]) -> Launches:
    """The launches of one call of the program ``thunks`` (module docstring)."""
    loops: list[Loop] = []
    kernels: list[Thunk] = []

    def count(sequence, *, in_loop: bool) -> tuple[int, int]:
        """(all launches of ``sequence``, those outside any loop)."""
        total = outside = 0
        for thunk in sequence:
            if thunk.kind == "kWhile":
                total += count_loop(thunk)
                continue
            if thunk.kind == "kConditional":
                branches = [count(ts, in_loop=in_loop) for _, ts in thunk.groups] or [(0, 0)]
                most = max(branches)
            elif thunk.kind in _NOT_LAUNCHES:
                most = count(thunk.children(), in_loop=in_loop)
            else:
                kernels.append(thunk)
                nested = (0, 0)
                if thunk.kind not in _ONE_LAUNCH_WITH_NESTED:
                    nested = count(thunk.children(), in_loop=in_loop)
                most = (1 + nested[0], 0 if in_loop else 1 + nested[1])
            total, outside = total + most[0], outside + most[1]
        return total, outside

    def count_loop(thunk) -> int:
        name = names.get(thunk.id, f"while thunk {thunk.id}")
        body = count(thunk.children("body"), in_loop=True)[0]
        condition = count(thunk.children("condition"), in_loop=True)[0]
        known = trips.get(name)
        if known is None:  # the condition before every trip, and once more after the last
            loops.append(Loop(name, None, body + condition))
            return body + 2 * condition
        loops.append(Loop(name, known, body))
        return known * body

    total, top_level = count(thunks, in_loop=False)
    return Launches(total, top_level, tuple(loops), tuple(kernels))


def read_dump(folder: Path) -> Launches:
    """``count_launches`` of the one program dumped in ``folder`` (``xla_dump_to``)."""
    folder = Path(folder)
    sequence = _one(folder, "*.thunk_sequence.txt")
    metadata = _one(folder, "*.thunk_metadata.txt")
    hlo = _one(folder, "*gpu_after_optimizations.txt")
    return count_launches(
        parse_sequence(sequence.read_text()),
        thunk_names(metadata.read_text()),
        trip_counts(hlo.read_text()),
    )


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise RuntimeError(f"expected one {pattern} in {folder}, found {len(found)}")
    return found[0]
