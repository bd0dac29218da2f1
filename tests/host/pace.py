"""How fast this host runs, measured once per test session: the factor a waiting limit scales by.

A limit in a guest test is one of two kinds. Some are the property under test: a list answers
within 3x its idle latency, an exec is killed at its timeout, a deadline fires. Those are never
scaled. The others only bound how long a test waits for something to happen (a unit to go, a
container to start, a user's load to end); on a slow machine they fail a correct product. A
CI lane's guest of one emulated vCPU ran the same tests 15-25% slower on one day than another,
and the five users' load took 583, 1089 and 1381 s on three machines of one kind (issue 58).
Those limits are multiplied by the host's pace: how much longer a fixed pure-Python workload
takes here than it did where the limits were set, never less than 1.

``SLICEBOX_TEST_PACE`` (a number) overrides the measurement: a run that knows its host is slow
can say so, and a test of the scaling can fix it.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

# The workload's seconds (a median of three) in CI's lane guests (one vCPU each, TCG, side by
# side) through main's whole run on the slow machine of 2026-12-07, sampled each minute: median
# 0.25, three in four at most 0.43, the slowest 0.94 (88 samples). Every waiting limit held
# there; a host slower than its usual lane is given proportionally more time.
REFERENCE_SECONDS = 0.45
ROUNDS = 5


def workload() -> None:
    """A fixed amount of interpreted work: what the agent and the tests mostly do here."""
    total = 0
    for n in range(120_000):
        total += n * n % 7
    if total < 0:  # never: keeps the loop from being anything but work
        raise AssertionError(total)


def measure() -> float:
    """The workload's median seconds over ``ROUNDS`` runs."""
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        workload()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@functools.cache
def pace() -> float:
    """This host's pace against the reference, at least 1.0; measured once per process."""
    given = os.environ.get("SLICEBOX_TEST_PACE")
    if given:
        try:
            return max(1.0, float(given))
        except ValueError:
            raise ValueError(f"SLICEBOX_TEST_PACE must be a number, not {given!r}") from None
    return max(1.0, measure() / REFERENCE_SECONDS)


def patient(seconds: float) -> float:
    """A waiting limit of ``seconds`` where the limits were set, as long as this host needs."""
    return seconds * pace()
