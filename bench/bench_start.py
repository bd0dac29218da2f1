"""Bench: how long the agent takes from ``systemctl start`` to its first answer, no sandboxes.

    tests/guest/run python3 -m bench.bench_start [--starts 5]

The agent is the real service (the checkout's units under systemd). Each start: the service is
stopped (its socket stays), then ``systemctl start slicebox.service`` (which returns once the
agent said READY=1) and one ``curl --unix-socket`` of ``GET /v1/health``; the time is until
that answer. The unit of emulated start-up is ``python3 -c 'import json'``, measured the same
number of times in the same run, taking turns with the agent's starts: the RATIO (agent over
that) is the result; absolute times under emulation say little.

Printed: the median of each, the RATIO, and the median time ``systemctl start`` took (until
READY=1) apart from the first answer.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from tests.host.agentunits import SOCKET, installed_agent

HEALTH = ["curl", "-sf", "-m", "180", "--unix-socket", str(SOCKET), "http://localhost/v1/health"]
SERVICE = "slicebox.service"


def seconds(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - started


def one_start() -> tuple[float, float]:
    """(until READY=1, until the first answer) of one start of the stopped service."""
    started = time.perf_counter()
    subprocess.run(["systemctl", "start", SERVICE], check=True)
    ready = time.perf_counter() - started
    subprocess.run(HEALTH, check=True, capture_output=True)
    return ready, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    python = [sys.executable, "-c", "import json"]
    ready: list[float] = []
    answered: list[float] = []
    unit: list[float] = []
    with installed_agent():
        one_start()  # warm-up: the page cache, compiled modules; not counted
        seconds(python)
        for _ in range(args.starts):
            # Its socket stays (systemctl warns so on stderr): clients keep their address.
            subprocess.run(["systemctl", "stop", SERVICE], check=True, capture_output=True)
            up, first = one_start()
            ready.append(up)
            answered.append(first)
            unit.append(seconds(python))
    agent, bare = statistics.median(answered), statistics.median(unit)
    print(
        f"start     slicebox {agent * 1000:6.0f} ms  python3 -c 'import json' {bare * 1000:6.0f} ms"
        f"  RATIO {agent / bare:.2f}  ({args.starts} starts; READY=1 after "
        f"{statistics.median(ready) * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
