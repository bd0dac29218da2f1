"""Bench: slicebox exec and one-shot runs against bare Docker, as ratios measured in one run.

    tests/guest/run python3 bench/bench_exec.py [--execs N] [--oneshots N]

1. Exec round trip of ``echo hi`` in one sandbox made by ``SandboxManager.create`` (the agent's
   create path: admission, slices, labels, deadline): ``ExecEngine.run`` (create, raw attach,
   inspect, cgroup reads) vs docker-py's ``Container.exec_run``, interleaved so both see the
   same load. Also counts outputs that were not exactly ``hi\\n``.
2. One-shot run: ``Service.run`` (create, exec, destroy, final usage, journal audit) vs
   ``docker run --rm`` with the flags the Docker backend derives from the same settings table
   (``run_flags``), interleaved.

Absolute times under emulation say little about real hosts; the ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable

import docker
from tests.fakes.threadside import created

from slicebox.backends.base import SandboxRequest
from slicebox.backends.docker import DockerBackend
from slicebox.backends.dockerbody import run_flags
from slicebox.core.blocking import from_thread
from slicebox.core.creation import KEEP_ALIVE
from slicebox.core.deadlines import Deadlines
from slicebox.core.execution import ExecEngine
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.service import Service
from slicebox.core.slices import SliceManager
from slicebox.core.telemetry import MemoryIntegrator, TreeReader, UsageReader
from slicebox.host.cgroupfs import CgroupFS
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor, SystemJournal
from slicebox.host.procs import CgroupHost
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.config import Config, parse_config, read_host_memory
from slicebox.model.exec import ExecRequest
from slicebox.model.names import slice_names
from slicebox.model.spec import SandboxSpec

IMAGE = "slicebox-test/busybox:latest"
USER = "bench-" + uuid.uuid4().hex[:6]
PROJECT = "p"
ECHO = ExecRequest(argv=("echo", "hi"))


class Agent:
    """The agent's parts over the real host, assembled as ``server.runtime`` does."""

    def __init__(self, config: Config) -> None:
        systemd = PystemdSystemd()
        self.backend = DockerBackend.from_env()
        self.engine = ExecEngine(self.backend, CgroupHost())
        self.manager = SandboxManager(
            self.backend,
            SliceManager(systemd),
            config=config,
            host_memory=read_host_memory(),
            instance_id="bench-" + uuid.uuid4().hex[:8],
            deadlines=Deadlines(systemd),
        )
        self.service = Service(
            self.manager,
            self.engine,
            usage=UsageReader(CgroupFS(), integrator=MemoryIntegrator(time.monotonic)),
            tree=TreeReader(CgroupFS()),
            auditor=Auditor(SystemJournal()),  # the agent audits every action too
            pid_of=lambda sandbox: None,
        )
        self.who = Identity(uid=0, gid=0, pid=os.getpid(), user_name=USER, is_admin=True)


def baseline_flags(config: Config) -> list[str]:
    """``docker run`` flags for what the agent creates with every default."""
    request = SandboxRequest(
        name="bare",
        image=IMAGE,
        command=KEEP_ALIVE,
        labels={},
        slice=slice_names(USER, PROJECT).project,
        limits=config.sandbox.limits(),
    )
    return run_flags(request)


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


def bench_exec(agent: Agent, client: docker.DockerClient, count: int) -> None:
    sandbox = created(agent.manager, SandboxSpec(user=USER, project=PROJECT))
    try:
        container = client.containers.get(sandbox.container_id)
        ours, bare = [], []
        for _ in range(count):
            ours.append(timed(lambda: agent.engine.run(sandbox.container_id, ECHO).stdout))
            bare.append(timed(lambda: container.exec_run(["echo", "hi"]).output))
    finally:
        agent.manager.destroy(sandbox.id)
    report("exec round trip", ours, bare)


def bench_oneshot(agent: Agent, config: Config, count: int) -> None:
    argv = ["docker", "run", "--rm", *baseline_flags(config), IMAGE, "echo", "hi"]
    run = RunRequest(sandbox=CreateSandbox(user=USER, project=PROJECT), exec=ECHO)
    ours, bare = [], []
    for _ in range(count):
        ours.append(
            timed(
                lambda: (
                    from_thread(lambda b: agent.service.run(agent.who, run, None, b)).result.stdout
                )
            )
        )
        bare.append(timed(lambda: subprocess.run(argv, capture_output=True, check=True).stdout))
    report("one-shot run", ours, bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execs", type=int, default=20)
    parser.add_argument("--oneshots", type=int, default=3)
    args = parser.parse_args()
    config = parse_config(f'default_image = "{IMAGE}"\n')
    agent = Agent(config)
    client = docker.from_env()
    try:
        bench_exec(agent, client, args.execs)
        bench_oneshot(agent, config, args.oneshots)
    finally:
        client.close()
        names = slice_names(USER, PROJECT)
        for unit in (names.project, names.user):
            subprocess.run(["systemctl", "stop", unit], check=False)


if __name__ == "__main__":
    main()
