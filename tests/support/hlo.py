"""Reading optimised HLO text (``compiled.as_text()``, XLA:CPU's or the TPU compiler's): its
computations, the bodies of its while loops, and the matrix products in them."""

import re

COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.-]+) .*\{$")
CALLED = re.compile(r"(?:calls|body|condition|to_apply)=%?([\w.-]+)")


def computations(hlo: str) -> dict[str, list[str]]:
    """The instruction lines of each computation in an HLO module's text."""
    blocks, name = {}, None
    for line in hlo.splitlines():
        match = COMPUTATION.match(line)
        if match:
            name = match.group(1)
            blocks[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None:
            blocks[name].append(line)
    return blocks


def reachable(blocks, name):
    """Every instruction in ``name`` and the computations it calls, transitively."""
    lines, todo, seen = [], [name], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for line in blocks[current]:
            lines.append(line)
            todo.extend(CALLED.findall(line))
    return lines


def loop_bodies(hlo: str) -> list[list[str]]:
    """The instructions of each while loop's body, with what the body calls."""
    blocks = computations(hlo)
    bodies = [
        m
        for lines in blocks.values()
        for line in lines
        for m in re.findall(r"body=%?([\w.-]+)", line)
    ]
    return [reachable(blocks, body) for body in bodies]


def dots(lines):
    """The matrix products among ``lines`` (XLA:TPU writes many as convolutions)."""
    return [line for line in lines if re.search(r"= \S+ (dot|convolution)\(", line)]


def has_square(lines, size):
    """Whether an array with trailing dims ``[size, size]`` appears among ``lines``."""
    return any(re.search(rf"\[(?:\d+,)*{size},{size}\]", line) for line in lines)


def count(hlo: str, op: str) -> int:
    """Instructions of opcode ``op`` (an async collective counts once, by its start)."""
    return len(re.findall(rf" {op}(?:-start)?\(", hlo))
