"""Bench: slicebox exec and one-shot runs against bare Docker, as ratios measured in one run.

    tests/guest/run python3 bench/bench_exec.py [--execs N] [--oneshots N]

1. Exec round trip of ``echo hi`` in one hardened sandbox: ``ExecEngine.run`` (create, raw
   attach, inspect, cgroup reads) vs docker-py's ``Container.exec_run``, interleaved so both
   see the same load. Also counts outputs that were not exactly ``hi\\n``.
2. One-shot run: ``oneshot.execute`` with ``MinimalDockerProvider`` vs ``docker run --rm`` with
   the same flags (``hardened_cli_flags``), interleaved.

Absolute times under emulation say little about real hosts; the ratios are the result.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable

import docker

from slicebox.backends.dockerstream import DockerExecApi
from slicebox.core.execution import ExecEngine
from slicebox.core.oneshot import (
    MinimalDockerProvider,
    MinimalSandboxConfig,
    execute,
    hardened_cli_flags,
)
from slicebox.host.procs import CgroupHost
from slicebox.model.exec import ExecRequest

IMAGE = "slicebox-test/busybox:latest"
SLICE = "slicebox-bench-p.slice"
ECHO = ExecRequest(argv=("echo", "hi"))


def timed(action: Callable[[], bytes]) -> tuple[float, bool]:
    """Seconds taken and whether the output was exactly hi."""
    started = time.perf_counter()
    output = action()
    return time.perf_counter() - started, output == b"hi\n"


def report(name: str, ours: list[tuple[float, bool]], bare: list[tuple[float, bool]]) -> None:
    ours_s = statistics.median(t for t, _ in ours)
    bare_s = statistics.median(t for t, _ in bare)
    ours_bad = sum(not ok for _, ok in ours)
    bare_bad = sum(not ok for _, ok in bare)
    print(f"{name}: slicebox median {ours_s * 1000:.0f} ms ({ours_bad}/{len(ours)} wrong output)")
    print(f"{name}: bare     median {bare_s * 1000:.0f} ms ({bare_bad}/{len(bare)} wrong output)")
    print(f"{name}: RATIO slicebox/bare = {ours_s / bare_s:.2f}")


def bench_exec(client: docker.DockerClient, config: MinimalSandboxConfig, count: int) -> None:
    provider = MinimalDockerProvider(client)
    engine = ExecEngine(DockerExecApi.from_env(), CgroupHost())
    container_id = provider.create(config)
    try:
        container = client.containers.get(container_id)
        ours, bare = [], []
        for _ in range(count):
            ours.append(timed(lambda: engine.run(container_id, ECHO).stdout))
            bare.append(timed(lambda: container.exec_run(["echo", "hi"]).output))
    finally:
        provider.destroy(container_id)
    report("exec round trip", ours, bare)


def bench_oneshot(client: docker.DockerClient, config: MinimalSandboxConfig, count: int) -> None:
    provider = MinimalDockerProvider(client)
    engine = ExecEngine(DockerExecApi.from_env(), CgroupHost())
    argv = ["docker", "run", "--rm", *hardened_cli_flags(config), IMAGE, "echo", "hi"]
    ours, bare = [], []
    for _ in range(count):
        ours.append(timed(lambda: execute(ECHO, config, provider=provider, engine=engine).stdout))
        bare.append(timed(lambda: subprocess.run(argv, capture_output=True, check=True).stdout))
    report("one-shot run", ours, bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execs", type=int, default=20)
    parser.add_argument("--oneshots", type=int, default=3)
    args = parser.parse_args()
    config = MinimalSandboxConfig(image=IMAGE, cgroup_parent=SLICE)
    client = docker.from_env()
    try:
        bench_exec(client, config, args.execs)
        bench_oneshot(client, config, args.oneshots)
    finally:
        client.close()
        for unit in (SLICE, "slicebox-bench.slice"):
            subprocess.run(["systemctl", "stop", unit], check=False)


if __name__ == "__main__":
    main()
