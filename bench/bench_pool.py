"""Bench: a one-shot ``echo hi`` cold, from the warm pool, and as raw docker-py, in one run.

    tests/guest/run python3 -m bench.bench_pool [--rounds N]

The agent is the real service (the checkout's units) with one ``[[pool]]`` of size 2 for the
pooled key; the cold side asks for another memory limit, so no pool serves it. Each slicebox
call is ``POST /v1/run`` through the Python client on the socket; the floor is docker-py
creating, starting, exec'ing in and removing a container with the same HostConfig. The rounds
interleave the three sides. A pooled run waits until the pool says it has a member ready
before it is timed (the refill is in the background; a run that found none would be a cold
run, which the cold side measures). Reported: p50 and p99 of each side, the ratios of the
medians, and the pool's own acquire p50 and hit rate. Absolute times under emulation say
little about real hosts.

Then what an idle member costs, to decide whether freezing idle members is worth it (issue
15): with the pool full and nothing asked, the CPU its members' scopes use over ``--idle``
seconds (what a frozen scope would not use), beside the whole guest's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import docker
from tests.host.agentunits import CONFIG, SOCKET, agent_config, installed_agent
from tests.host.helpers import sh, wait_for

from slicebox.backends.base import SandboxRequest
from slicebox.backends.dockerbody import host_config
from slicebox.client import Client
from slicebox.core.creation import KEEP_ALIVE
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.config import parse_config
from slicebox.model.exec import ExecRequest
from slicebox.model.names import slice_names

IMAGE = "slicebox-test/busybox:latest"
USER, PROJECT = "bench", "pool"
POOL = f'[[pool]]\nuser = "{USER}"\nproject = "{PROJECT}"\nsize = 2\nmemory = "64MB"\n'
ECHO = ExecRequest(argv=("echo", "hi"))
CGROUP = Path("/sys/fs/cgroup")


def run_request(memory: str) -> RunRequest:
    return RunRequest(sandbox=CreateSandbox(user=USER, project=PROJECT, memory=memory), exec=ECHO)


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


class Sides:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.api = docker.APIClient(timeout=600)
        self.times: dict[str, list[float]] = {"cold": [], "pooled": [], "docker-py": []}

    def cold(self) -> None:
        ran = self.client.run(run_request("96MB"))
        assert ran.result.stdout == b"hi\n", ran

    def pooled(self) -> None:
        ran = self.client.run(run_request("64MB"))
        assert ran.result.stdout == b"hi\n", ran

    def ready(self) -> bool:
        return any(p.ready > 0 for p in self.client.pools().pools)

    def raw(self) -> None:
        request = SandboxRequest(
            name="bench-pool-raw",
            image=IMAGE,
            command=KEEP_ALIVE,
            labels={},
            slice=slice_names(USER, PROJECT).project,
            limits=parse_config("").sandbox.limits(),
        )
        made = self.api.create_container(
            IMAGE, list(KEEP_ALIVE), name=request.name, host_config=host_config(request)
        )
        try:
            self.api.start(made["Id"])
            run = self.api.exec_create(made["Id"], ["echo", "hi"])
            assert self.api.exec_start(run["Id"]) == b"hi\n"
        finally:
            self.api.remove_container(made["Id"], force=True)

    def round(self) -> None:
        self.times["cold"].append(timed(self.cold))
        wait_for(self.ready, timeout=300, step=0.5)
        self.times["pooled"].append(timed(self.pooled))
        self.times["docker-py"].append(timed(self.raw))


def report(sides: Sides) -> None:
    p50 = {name: statistics.median(samples) for name, samples in sides.times.items()}
    for name, samples in sides.times.items():
        print(
            f"{name:10} p50 {p50[name] * 1000:7.0f} ms  p99 {percentile(samples, 0.99) * 1000:7.0f}"
            f" ms  ({len(samples)} runs)"
        )
    print(f"RATIO cold/pooled {p50['cold'] / p50['pooled']:.2f} (goal >= 5)")
    print(f"RATIO pooled/docker-py {p50['pooled'] / p50['docker-py']:.2f}")
    print(f"RATIO cold/docker-py {p50['cold'] / p50['docker-py']:.2f}")
    (pool,) = sides.client.pools().pools
    acquire = pool.acquire_seconds_p50 or 0.0
    print(
        f"pool: acquire p50 {acquire * 1000:.1f} ms, hit rate {pool.hit_rate}, "
        f"refill p50 {pool.refill_seconds_p50} s"
    )


def idle_cost(client: Client, seconds: float) -> None:
    """CPU seconds per second of the idle members' scopes, and of the whole guest."""
    wait_for(lambda: client.pools().pools[0].ready == 2, timeout=300, step=0.5)
    idle = [s for s in client.list_sandboxes() if s.user == USER and s.pool == "idle"]
    project = (
        CGROUP / "slicebox.slice" / f"slicebox-{USER}.slice" / slice_names(USER, PROJECT).project
    )
    scopes = [project / f"docker-{s.container_id}.scope" for s in idle]
    before, all_before = [usage(scope) for scope in scopes], busy()
    time.sleep(seconds)
    after, all_after = [usage(scope) for scope in scopes], busy()
    for member, start, end in zip(idle, before, after, strict=True):
        print(f"idle member {member.id}: {(end - start) / seconds * 1e6:.0f} us of CPU a second")
    print(f"the whole guest meanwhile: {(all_after - all_before) / seconds:.2f} CPU-s a second")


def usage(cgroup: Path) -> float:
    for line in (cgroup / "cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    raise AssertionError(f"no usage_usec in {cgroup}")


def busy() -> float:
    stat = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(v) for i, v in enumerate(stat) if i not in (3, 4)) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of the idle reading")
    args = parser.parse_args()
    with installed_agent(agent_config() + POOL):
        sh("systemctl", "start", "slicebox.socket")
        client = Client(str(SOCKET), timeout=600)
        client.health()
        sides = Sides(client)
        try:
            sides.round()  # warm-up: images, slices, the agent's first imports; not counted
            for samples in sides.times.values():
                samples.clear()
            for _ in range(args.rounds):
                sides.round()
            report(sides)
            idle_cost(client, args.idle)
        finally:
            empty_pool(client)
            sides.api.close()


def empty_pool(client: Client) -> None:
    """No [[pool]] any more, then a reaper pass: the idle members go before the agent stops."""
    CONFIG.write_text(agent_config())
    sh("systemctl", "reload", "slicebox.service")
    wait_for(lambda: client.pools().pools == [], timeout=60)
    client.reap()


if __name__ == "__main__":
    main()
