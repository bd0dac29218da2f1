"""Bench: a snapshot, a fork and a pause through the installed agent, against the engine's own.

    tests/guest/run python3 -m bench.bench_snapshot [--rounds 3] [--mib 100]

One sandbox holds MIB MiB of random bytes in its tmpfs /workspace. Each round takes turns:

- ``snapshot``: ``POST /v1/sandboxes/{id}/snapshots`` (the sandbox paused, its root filesystem
  exported and its workspace read into one import, resumed), against ``docker commit`` of the
  same container plus a ``tar`` of the same workspace (``docker exec ... tar -c``) to a file:
  what a snapshot of both would cost with the engine's tools;
- ``fork``: a create ``from_snapshot`` (the snapshot's image, its workspace copied into the
  fork's own), against a cold create of the base image, the same limits; and a fork of a
  snapshot with an empty workspace, for what the image alone costs;
- ``pause`` and ``resume``: each call's time.

Printed: the median of each over the rounds and the RATIOs (ours over the engine's, a fork over
a cold create); absolute times under emulation say little.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.host.agentunits import admin, installed_agent, remove_sandboxes
from tests.host.helpers import TEST_IMAGE, sh

from slicebox.client import Client
from slicebox.model.api import CreateSandbox
from slicebox.model.errors import SliceboxError

RAW_TAR = Path("/var/tmp/bench-snapshot-workspace.tar")
RAW_IMAGE = "bench-snapshot-raw:latest"
LIMITS = {"project": "bench", "memory": "1GB"}  # tmpfs /workspace: half of it


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def raw_snapshot(container: str) -> None:
    """``docker commit`` (paused by the engine, as it does by default), then the workspace."""
    sh("docker", "commit", container, RAW_IMAGE)
    with RAW_TAR.open("wb") as out:
        tar = ["docker", "exec", container, "tar", "-c", "-f", "-", "-C", "/workspace", "."]
        subprocess.run(tar, stdout=out, check=True)


def raw_cleanup() -> None:
    sh("docker", "rmi", "-f", RAW_IMAGE, check=False)
    RAW_TAR.unlink(missing_ok=True)


def fork_and_destroy(client: Client, request: CreateSandbox) -> float:
    started = time.perf_counter()
    made = client.create(request)
    took = time.perf_counter() - started
    client.destroy(made.id)
    return took


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=100)
    args = parser.parse_args()
    times: dict[str, list[float]] = {}
    with installed_agent():
        sh("systemctl", "start", "slicebox.socket")
        client = admin()
        try:
            run_rounds(client, args.rounds, args.mib, times)
        finally:
            remove_sandboxes()
            for name in ("bench", "empty", *(f"b{n}" for n in range(args.rounds))):
                with contextlib.suppress(SliceboxError):  # gone, or never made
                    client.delete_snapshot(name)
            raw_cleanup()
    report(times, args.rounds, args.mib)


def run_rounds(client: Client, rounds: int, mib: int, times: dict[str, list[float]]) -> None:
    box = client.create(CreateSandbox.model_validate(LIMITS))
    script = f"dd if=/dev/urandom of=/workspace/data bs=1M count={mib} 2>/dev/null"
    sh("docker", "exec", box.container_id, "sh", "-c", script)
    empty = client.create(CreateSandbox.model_validate(LIMITS))
    client.snapshot(empty.id, "empty")
    client.destroy(empty.id)
    client.snapshot(box.id, "bench")
    cold = CreateSandbox.model_validate({**LIMITS, "image": TEST_IMAGE})
    fork = CreateSandbox.model_validate({**LIMITS, "from_snapshot": "bench"})
    fork_empty = CreateSandbox.model_validate({**LIMITS, "from_snapshot": "empty"})
    for n in range(rounds):
        add = times.setdefault
        name = f"b{n}"
        add("snapshot", []).append(timed(functools.partial(client.snapshot, box.id, name)))
        client.delete_snapshot(name)
        add("commit+tar", []).append(timed(lambda: raw_snapshot(box.container_id)))
        raw_cleanup()
        add("fork", []).append(fork_and_destroy(client, fork))
        add("fork (empty workspace)", []).append(fork_and_destroy(client, fork_empty))
        add("cold create", []).append(fork_and_destroy(client, cold))
        add("pause", []).append(timed(lambda: client.pause(box.id)))
        add("resume", []).append(timed(lambda: client.resume(box.id)))


def report(times: dict[str, list[float]], rounds: int, mib: int) -> None:
    for name, values in times.items():
        print(f"{name:24s} {median_ms(values):8.0f} ms  (median of {rounds})")
    snap, raw = median_ms(times["snapshot"]), median_ms(times["commit+tar"])
    cold = median_ms(times["cold create"])
    print(f"snapshot of {mib} MiB / (docker commit + tar)  RATIO {snap / raw:.2f}")
    print(
        f"fork ({mib} MiB workspace) / cold create     RATIO {median_ms(times['fork']) / cold:.2f}"
    )
    empty = median_ms(times["fork (empty workspace)"])
    print(f"fork (empty workspace) / cold create        RATIO {empty / cold:.2f}")


if __name__ == "__main__":
    main()
