"""A model of a Mosaic GPU kernel's time from its machine code (SASS with control codes,
``MOSAIC_GPU_DUMP_SASS_CTRL``), on a host without the GPU.

Each instruction's control code says how many cycles its warp waits before it may issue the
next one (the stall count). Along one program's path through the code, with every loop's body
counted once a trip, the sum of the stall counts is a floor on one warp's issue cycles before
variable waits (memory, barriers, the tensor cores' results): the *stall path*. A streaming
multiprocessor's four schedulers each issue one instruction a cycle, and a warpgroup puts one
warp on each, so the warps of all the programs an SM holds share a scheduler: the
instructions of every warpgroup's path, summed, are a second floor (the *issue count*). A
program's floor is the larger of the two; a kernel's, that of a wave of co-resident programs
times the waves.

Paths: the code's basic blocks and natural loops (a branch back to an earlier address). A
warp-specialised kernel branches on its warpgroup: its stall path is the longest path
(one warpgroup's), its issue count the blocks' sum over all branches. The out-of-line retries
of an mbarrier wait (``SYNCS.PHASECHK``) are the variable waits the floor leaves out.

A loop's trips: where its exit compares a counter stepped by a constant with a constant
(``ISETP``/``UISETP`` on an immediate), they are read from the code; otherwise (a bound read
at run time) the caller gives them, in the order of the loops' headers (``open_trips``).
"""

from __future__ import annotations

import dataclasses
import math
import re

_LINE = re.compile(
    r"^\s*[0-9a-fx&-]+:[0-9-]+:[0-9-]+:[Y-]:(?P<stall>\d+)\s+/\*(?P<address>[0-9a-f]+)\*/\s+"
    r"(?P<text>\S.*?)\s*;?\s*$"
)
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_PREDICATE = re.compile(r"^@(!?)(U?P\w+)\s+")


class OpenLoops(ValueError):
    """A kernel's loops whose trips the code does not say and the caller did not give."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    stall: int
    opcode: str
    text: str
    predicate: str | None  # "P0", "!P0", "UP1", ...; None: always
    target: str | None  # a branch's label


@dataclasses.dataclass
class Block:
    first: int  # index of its first instruction
    last: int  # index of its last
    successors: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Loop:
    header: int  # the block the back edge returns to
    latch: int  # the block that branches back
    blocks: frozenset[int]
    trips: int | None  # read from the code; None: a bound read at run time


@dataclasses.dataclass(frozen=True)
class Floor:
    """One program's floors in cycles: ``stall_path`` (one warp's longest path) and
    ``issue_count`` (the instructions of all its paths, one scheduler's share)."""

    stall_path: int
    issue_count: int

    @property
    def cycles(self) -> int:
        return max(self.stall_path, self.issue_count)

    def of_wave(self, programs: int) -> int:
        """A wave of ``programs`` co-resident on an SM: they share its schedulers."""
        return max(self.stall_path, programs * self.issue_count)


def parse(sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """The instructions of a SASS dump in order, and each label's instruction index."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        if found := _LABEL.match(line):
            labels[found[1]] = len(instructions)
            continue
        if not (found := _LINE.match(line)):
            continue
        text = found["text"]
        predicate = None
        if guard := _PREDICATE.match(text):
            predicate = guard[1] + guard[2]
            text = text[guard.end() :]
        target = _TARGET.search(text)
        label = target[1] if target else None
        instructions.append(
            Instruction(int(found["stall"]), text.split()[0], text, predicate, label)
        )
    return instructions, labels


def blocks_of(instructions, labels) -> list[Block]:
    """The basic blocks, each with its successors' indices."""
    leaders = {0, *labels.values()}
    for i, ins in enumerate(instructions):
        if ins.opcode.startswith(("BRA", "EXIT")) and i + 1 < len(instructions):
            leaders.add(i + 1)
    starts = sorted(s for s in leaders if s < len(instructions))
    blocks = [Block(s, (starts[n + 1] if n + 1 < len(starts) else len(instructions)) - 1)
              for n, s in enumerate(starts)]  # fmt: skip
    index = {b.first: n for n, b in enumerate(blocks)}
    for n, block in enumerate(blocks):
        last = instructions[block.last]
        falls = n + 1 < len(blocks)
        if last.opcode.startswith("BRA") and last.target is not None:
            block.successors.append(index[labels[last.target]])
            falls = falls and last.predicate is not None
        elif last.opcode.startswith("EXIT"):
            falls = falls and last.predicate is not None
        if falls:
            block.successors.append(n + 1)
    return blocks


def in_line(instructions, blocks) -> list[bool]:
    """Which blocks are in the program's line: ptxas puts the retries of an mbarrier wait (a
    ``SYNCS.PHASECHK`` probe, a sleep, a branch back) and the trap after the last ``EXIT``,
    out of line; they are the variable waits the floor leaves out."""
    exits = [i for i, ins in enumerate(instructions) if ins.opcode.startswith("EXIT")]
    end = exits[-1] if exits else len(instructions)
    return [block.first <= end for block in blocks]


def loops_of(instructions, blocks) -> list[Loop]:
    """The natural loops of the in-line blocks, by header."""
    kept = in_line(instructions, blocks)
    predecessors = {n: [] for n in range(len(blocks))}
    for n, block in enumerate(blocks):
        for s in block.successors:
            if kept[n] and kept[s]:
                predecessors[s].append(n)
    found = {}
    for latch, block in enumerate(blocks):
        for header in block.successors:
            if header > latch or not (kept[latch] and kept[header]):
                continue
            body, stack = {header, latch}, [latch]
            while stack:
                for p in predecessors[stack.pop()]:
                    if p not in body and p >= header:
                        body.add(p)
                        stack.append(p)
            trips = _static_trips(instructions, blocks, header, latch, body)
            if _is_wait(instructions, blocks, body):
                trips = 1  # a wait's retries: variable, not in the floor
            previous = found.get(header)
            if previous is None or len(body) > len(previous.blocks):
                found[header] = Loop(header, latch, frozenset(body), trips)
    return [found[h] for h in sorted(found)]


_WAITS = ("SYNCS.PHASECHK", "USETMAXREG.TRY_ALLOC")


def _is_wait(instructions, blocks, body) -> bool:
    """A few instructions around a wait's probe (an mbarrier's phase, a register grant)."""
    code = [instructions[i] for b in body for i in range(blocks[b].first, blocks[b].last + 1)]
    return len(code) <= 8 and any(i.opcode.startswith(_WAITS) for i in code)


def _immediate(text: str) -> int:
    """A SASS immediate as a 32-bit signed integer."""
    value = int(text, 0)
    return value - 2**32 if value >= 2**31 else value


_COMPARE = re.compile(
    r"^U?ISETP\.(?P<cond>NE|EQ|GE|GT|LT|LE)(?:\.U32)?\.AND\s+(?P<pred>U?P\d+),\s*U?PT,\s*"
    r"(?P<a>-?0x[0-9a-f]+|-?\d+|U?R\w+),\s*(?P<b>-?0x[0-9a-f]+|-?\d+|U?R\w+),"
)
# A compare read from its other side: ``bound < counter`` is ``counter > bound``.
_FLIPPED = {"NE": "NE", "EQ": "EQ", "GE": "LE", "LE": "GE", "GT": "LT", "LT": "GT"}
_P2R = re.compile(r"^P2R\s+(?P<d>R\d+),\s*PR,\s*RZ,\s*(?P<mask>0x[0-9a-f]+)\s*$")
_STEP = re.compile(
    r"^(?:U?IADD3|VIADD)\s+(?P<d>U?R\d+),\s*(?:U?P\d+,\s*)?(?P<s>U?R\d+),\s*"
    r"(?P<k>-?0x[0-9a-f]+|-?\d+)(?:,|\s*$)"
)
_SET = re.compile(
    r"^(?:UMOV|MOV|IMAD\.MOV\.U32)\s+(?P<d>U?R\d+),\s*(?:RZ,\s*RZ,\s*)?(?P<k>0x[0-9a-f]+|\d+)\b"
)
# (U)PLOP3.LUT with the table 0x80 (a and b and c) of one predicate and two PT: a copy of it.
# Of three PT: its table's bit 7 (the entry of three trues), true or false.
_PLOP = re.compile(
    r"^U?PLOP3\.LUT\s+(?P<d>U?P\d+),\s*U?PT,\s*(?P<a>U?P\w+),\s*(?P<b>U?P\w+),\s*(?P<c>U?P\w+),"
    r"\s*(?P<table>0x[0-9a-f]+),\s*0x0"
)
_MOVE = re.compile(
    r"^(?:UMOV|MOV|IMAD\.MOV\.U32|IMAD\.U32)\s+(?P<d>U?R\d+),\s*(?:RZ,\s*RZ,\s*)?(?P<s>U?R\d+)\s*$"
)
_ZERO = re.compile(
    r"^(?:CS2R|UMOV|MOV|IMAD\.MOV\.U32)\s+(?P<d>U?R\d+),\s*(?:RZ,\s*RZ,\s*)?(?:SRZ|U?RZ)\s*$"
)

# CS2R of SRZ zeroes a pair of registers: Rn and Rn+1.
_PAIR_ZERO = re.compile(r"^CS2R(?:\.32)?\s+(?P<d>R\d+),\s*SRZ\s*$")


def _pair(register: str) -> tuple[str, str]:
    return register, f"R{int(register[1:]) + 1}"


def _defines(text: str, register: str) -> bool:
    """Whether an instruction's first operand (its destination) is ``register``."""
    found = re.match(r"^\S+\s+(U?[PR]\w+)\b", text)
    return bool(found) and found[1] == register


def _plop(text: str):
    """``("copy", source)``, ``("true", None)``, ``("false", None)`` for a PLOP3.LUT that is
    one of those, else None."""
    found = _PLOP.match(text)
    if found is None:
        return None
    sources = [found[x] for x in "abc" if found[x] not in ("PT", "UPT")]
    if not sources:
        return ("true", None) if int(found["table"], 16) & 0x80 else ("false", None)
    if found["table"] == "0x80" and len(sources) == 1 and not sources[0].startswith("!"):
        return "copy", sources[0]
    return None


def _static_trips(instructions, blocks, header, latch, body) -> int | None:
    """Trips of a loop whose latch branches back on a counter, stepped by a constant in the
    body, compared with a constant; its start the last constant set before the loop. Or on
    a flag set before the loop and cleared in it (two trips)."""
    branch = instructions[blocks[latch].last]
    if branch.predicate is None:
        return None
    continues = not branch.predicate.startswith("!")
    name = branch.predicate.lstrip("!")
    lo, hi = blocks[header].first, blocks[latch].last
    compare = None
    i = hi
    while (i := i - 1) >= lo:
        text = instructions[i].text
        if not _defines(text, name):
            continue
        kind = _plop(text)
        if kind is not None and kind[0] == "copy":
            name = kind[1]  # a predicate copied: follow it
            continue
        if (kept := _kept_bit(instructions, lo, i)) is not None:
            i, name = kept  # a predicate kept in a register's bit: follow the one set there
            continue
        compare = _COMPARE.match(text)
        break
    if compare is None:
        return _flag_trips(instructions, lo, hi, name) if continues else None
    counter, bound, cond = compare["a"], compare["b"], compare["cond"]
    if counter in ("RZ", "URZ") or not counter.startswith(("R", "UR")):
        counter, bound, cond = bound, counter, _FLIPPED[cond]
    if cond == "NE" and bound in ("RZ", "URZ") and continues:
        for i in range(lo, hi + 1):  # a flag kept in a register: P2R R, PR, RZ, mask
            found = _P2R.match(instructions[i].text)
            if found and found["d"] == counter and (mask := int(found["mask"], 0)):
                if mask & (mask - 1) == 0:
                    return _flag_trips(instructions, lo, hi, f"P{mask.bit_length() - 1}")
    if bound in ("RZ", "URZ"):
        bound = 0
    elif bound.startswith(("R", "UR")):
        return None  # a bound in a register
    else:
        bound = _immediate(bound)
    steps = [m for i in range(lo, hi + 1)
             if (m := _STEP.match(instructions[i].text)) and m["d"] == counter]  # fmt: skip
    if len(steps) != 1:
        return None
    step, source = _immediate(steps[0]["k"]), steps[0]["s"]
    if step == 0:
        return None
    if source != counter and not any(
        (m := _MOVE.match(instructions[i].text)) and m["d"] == source and m["s"] == counter
        for i in range(lo, hi + 1)
    ):
        return None  # stepped from something that is not the counter's last value
    start = _constant_before(instructions, lo, source)
    if start is None:
        return None
    # The compare reads the counter after its step: a trip ends at start + trips * step.
    span = bound - start
    if cond in ("NE", "EQ"):
        if (cond == "NE") != continues:
            return None
        return span // step if span % step == 0 and span // step > 0 else None
    trips = math.ceil(span / step)
    return trips if trips > 0 else None


# A predicate kept in one bit of a register: ``LOP3.LUT P, RZ, R, bit, RZ, 0xc0`` tests it,
# ``@Q LOP3.LUT R, R, bit, RZ, 0xfc`` sets it where ``Q``.
_BIT_TEST = re.compile(
    r"^LOP3\.LUT\s+U?P\d+,\s*U?RZ,\s*(?P<r>U?R\d+),\s*(?P<bit>0x[0-9a-f]+),\s*U?RZ,\s*0xc0,"
)
_BIT_SET = re.compile(
    r"^LOP3\.LUT\s+(?P<d>U?R\d+),\s*(?P<r>U?R\d+),\s*(?P<bit>0x[0-9a-f]+),\s*U?RZ,\s*0xfc,"
)


def _kept_bit(instructions, lo, at) -> tuple[int, str] | None:
    """For a predicate set at ``at`` by testing one bit of a register: the index of the
    instruction of the loop (from ``lo``) that last set that bit and the predicate it was
    set under; None otherwise."""
    test = _BIT_TEST.match(instructions[at].text)
    if test is None or int(test["bit"], 16).bit_count() != 1:
        return None
    for i in range(at - 1, lo - 1, -1):
        found = _BIT_SET.match(instructions[i].text)
        if found and found["d"] == test["r"] == found["r"] and found["bit"] == test["bit"]:
            guard = instructions[i].predicate
            return (i, guard) if guard and not guard.startswith("!") else None
    return None


def _flag_trips(instructions, lo, hi, flag) -> int | None:
    """Two trips for a loop that branches back on ``flag``, set true before it and false in
    it, after the branch's copy of it (a loop of two trips, as LLVM writes some)."""
    cleared = any(_defines(instructions[i].text, flag) and _plop(instructions[i].text) ==
                  ("false", None) for i in range(lo, hi + 1))  # fmt: skip
    if not cleared:
        return None
    for i in range(lo - 1, -1, -1):
        if _defines(instructions[i].text, flag):
            return 2 if _plop(instructions[i].text) == ("true", None) else None
    return None


def _constant_before(instructions, at: int, register: str, depth: int = 2) -> int | None:
    """The constant ``register`` holds on reaching instruction ``at`` in straight-line
    order (following copies ``depth`` deep); None if it is not one."""
    for i in range(at - 1, -1, -1):
        text = instructions[i].text
        if (pair := _PAIR_ZERO.match(text)) and register in _pair(pair["d"]):
            return 0 if instructions[i].predicate is None else None
        if not _defines(text, register):
            continue
        if found := _SET.match(text):
            return _immediate(found["k"])
        if _ZERO.match(text):
            return 0
        if depth and (found := _MOVE.match(text)):
            return _constant_before(instructions, i, found["s"], depth - 1)
        if depth and (found := _STEP.match(text)):  # a constant plus a constant
            base = _constant_before(instructions, i, found["s"], depth - 1)
            return None if base is None else base + _immediate(found["k"])
        return None
    return None


def floor(sass: str, open_trips: tuple[int, ...] = ()) -> Floor:
    """One program's floors (module docstring). ``open_trips``: the trips of the loops the
    code leaves open, in their headers' order; ``OpenLoops`` if their number differs."""
    instructions, labels = parse(sass)
    blocks = blocks_of(instructions, labels)
    loops = loops_of(instructions, blocks)
    opened = [lp for lp in loops if lp.trips is None]
    if len(opened) != len(open_trips):
        raise OpenLoops(
            f"{len(opened)} loops read their bounds at run time (headers at blocks "
            f"{[lp.header for lp in opened]}); trips given for {len(open_trips)}"
        )
    given = iter(open_trips)
    trips = {lp.header: (lp.trips if lp.trips is not None else next(given)) for lp in loops}
    times = [1] * len(blocks)
    for lp in loops:
        for b in lp.blocks:
            times[b] *= trips[lp.header]
    kept = in_line(instructions, blocks)

    def weight(n, field):
        if not kept[n]:
            return 0
        body = instructions[blocks[n].first : blocks[n].last + 1]
        return times[n] * (sum(i.stall for i in body) if field == "stall" else len(body))

    issue = sum(weight(n, "count") for n in range(len(blocks)))
    # Longest path over the blocks with each loop's back edge removed (its trips are in the
    # blocks' weights): edges only go forward once back edges are gone.
    back = {(lp.latch, lp.header) for lp in loops}
    longest = [0] * len(blocks)
    reached = [n == 0 for n in range(len(blocks))]
    for n, block in enumerate(blocks):
        if not reached[n]:
            continue
        here = longest[n] + weight(n, "stall")
        for s in block.successors:
            if s <= n or (n, s) in back or not kept[s]:
                continue
            reached[s] = True
            longest[s] = max(longest[s], here)
    stall_path = max(longest[n] + weight(n, "stall") for n in range(len(blocks)) if reached[n])
    return Floor(stall_path, issue)


def open_loops(sass: str) -> int:
    """How many loops of a kernel read their bounds at run time."""
    instructions, labels = parse(sass)
    blocks = blocks_of(instructions, labels)
    return sum(lp.trips is None for lp in loops_of(instructions, blocks))
