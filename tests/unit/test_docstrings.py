"""The package's docstrings and comments say what the code does and why, not what it measured.

A figure in a docstring (``3.4 ms``, ``15x``, "a guest profile of …") is true of one machine,
one version and one day, and goes stale where nobody reruns it. The figures behind the code's
choices are in ``docs/benchmarks.md`` ("Why the code is as it is"), each with what was measured,
where and how to rerun it; the code keeps the reason in words and points there.

Read from each module's docstrings (``ast``: every string standing alone as a statement) and
comments (``tokenize``: a run of comment lines read as one text), whitespace folded so that a
phrase broken across lines is still found. Limits, defaults, protocol constants and units are
not measurements and are not matched: only the wording of a reported measurement is.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "agent" / "slicebox"


MEASUREMENT = [
    # the history itself: "measured in the guest", "a guest profile of parallel execs"
    re.compile(r"\bmeasured\b", re.IGNORECASE),
    re.compile(r"\b(a|the) guest profile\b|\bprofiled\b|\bpy-spy\b|\bcProfile\b", re.IGNORECASE),
    # a timing: "3.4 ms", "90ms", "12 µs"
    re.compile(r"\b\d+(\.\d+)?(-\d+(\.\d+)?)? ?(ms|µs|us)\b"),
    # a speed-up or slow-down: "15x that under load"
    re.compile(r"\b\d+(\.\d+)?x\b"),
    # a share of a cost: "a quarter of its start-up", "about a twentieth of the agent's imports"
    re.compile(
        r"\b(a|one) (half|third|quarter|fifth|tenth|twentieth) of (the agent's|its|each|every)"
        r"\b[^.;]{0,40}\b(start|start-up|imports|CPU|memory|RSS)\b",
        re.IGNORECASE,
    ),
    # a resident size: "8 MiB of the agent's idle memory", "(4 MiB of the agent's RSS"
    re.compile(r"\b\d+ MiB of (the agent's|its)\b[^.;]{0,20}\b(memory|RSS)\b", re.IGNORECASE),
    # a cost given in seconds: "2.5-3.5 s of the agent's 8-10 s start", "about a tenth of a
    # second of the agent's start", "took over a second under emulation"
    re.compile(r"\b\d+(\.\d+)?(-\d+(\.\d+)?)? s of (the agent's|its|each|a|every)\b"),
    re.compile(r"\b(half|third|quarter|tenth|twentieth) of a second\b", re.IGNORECASE),
    re.compile(r"\b(took|takes|cost|costs) (over|about|some|nearly|almost) (a|one) second\b"),
]


def docstrings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node.lineno, node.value.value


def comments(source: str) -> Iterator[tuple[int, str]]:
    """Each run of comments on consecutive lines, as one text."""
    start, last = 0, -1
    run: list[str] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if line != last + 1 and run:
            yield start, " ".join(run)
            run = []
        if not run:
            start = line
        run.append(token.string.lstrip("#").strip())
        last = line
    if run:
        yield start, " ".join(run)


def texts(path: Path) -> Iterator[tuple[int, str]]:
    source = path.read_text()
    yield from docstrings(ast.parse(source))
    yield from comments(source)


def reported(text: str) -> str | None:
    """The first words of ``text`` that report a measurement, if any."""
    folded = " ".join(text.split())
    for pattern in MEASUREMENT:
        hit = pattern.search(folded)
        if hit:
            return hit.group(0)
    return None


def measurements(path: Path) -> list[str]:
    relative = path.relative_to(PACKAGE).as_posix()
    found = []
    for line, text in texts(path):
        hit = reported(text)
        if hit:
            found.append(f"{relative}:{line}: {hit!r}")
    return found


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_docstring_or_comment_reports_a_measurement() -> None:
    """Each figure goes to ``docs/benchmarks.md``; the code keeps the reason in words."""
    found = [hit for path in modules() for hit in measurements(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        '"""Measured in the guest: 3.4 ms to decode."""',
        '"""A quarter of its CPU (a guest profile of parallel execs)."""',
        "# the engine's takes about 90 ms\n",
        "# 15x that under load\n",
        "# some\n# 8 MiB of the agent's idle\n# memory\n",
        '"""about a twentieth of the agent\'s start under emulation"""',
        '"""2.5-3.5 s of the agent\'s 8-10 s start"""',
        '"""about a tenth of a second of the agent\'s start under emulation"""',
        "# an unmount took over a\n# second under emulation\n",
    ],
)
def test_a_reported_measurement_is_found(text: str) -> None:
    assert any(reported(found) for _, found in [*docstrings(ast.parse(text)), *comments(text)])


@pytest.mark.parametrize(
    "text",
    [
        '"""``512 B``, ``256 MiB``, ``3.0 GiB``: whole units exactly."""',
        '"""systemd\'s CPUQuotaPerSecUSec for ``cpus`` CPUs (1.0 -> 1 s of CPU per second)."""',
        "# How long a graceful stop waits: well within the unit's TimeoutStopSec (30 s).\n",
        "# at most 86400 seconds\n",
        '"""Caps are chosen per call (up to 16 MiB a stream)."""',
    ],
)
def test_a_limit_or_a_unit_is_not_a_measurement(text: str) -> None:
    assert not any(reported(found) for _, found in [*docstrings(ast.parse(text)), *comments(text)])
