"""Bench: throughput under parallel load, the agent against raw docker-py doing the same work.

    tests/guest/run python3 -m bench.bench_load [--sandboxes 200] [--clients 8] [--execs 400]

Both sides run the same work with the same number of parallel clients in the same run, each
phase in ``--rounds`` rounds with the sides taking turns, in the order A B, B A, ... (a change
in the guest's load falls on both alike, and neither side always follows the phase before):

- slicebox: the real service (the checkout's units under systemd), called on its socket by
  ``--clients`` threads with the Python client: create ``--sandboxes`` sandboxes across 10
  projects, run ``--execs`` execs of ``echo hi`` spread over them (with a list and a usage read
  now and then), destroy them all;
- docker-py: the Engine API directly (``create_container`` + ``start`` with the HostConfig the
  Docker backend derives from the same settings table, ``exec_create`` + ``exec_start``,
  ``remove_container(force=True)``), same clients, same counts.

The agent runs as shipped, its reaper included (a pass every 30 s, ``--reaper-interval``): the
load test's pass every 2 s is a stress, not what a host runs, and its passes over hundreds of
sandboxes fall on both sides' phases unequally.

Printed: creates/s, execs/s and destroys/s of each side and their RATIO (slicebox over
docker-py: 1.0 means the agent adds nothing), the same for the whole work (every operation
over the time all phases took), p50/p99 per route of the agent, and the agent's
RSS and thread count with every sandbox alive (and idle, before the load), and each phase's
CPU seconds per operation by where they were spent (the agent, dockerd, containerd with its
shims and runc, systemd, journald, the sandboxes; "all" is the whole guest, the bench's own
clients included), from cgroup v2's counters, which keep the CPU of processes gone since.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import docker
from tests.host.agentunits import SOCKET, TEST_CONFIG, agent_config, installed_agent

from slicebox.backends.base import SandboxRequest
from slicebox.backends.dockerbody import host_config
from slicebox.client import Client
from slicebox.core.creation import KEEP_ALIVE
from slicebox.model.config import ReaperConfig, parse_config
from slicebox.model.names import slice_names

IMAGE = "slicebox-test/busybox:latest"
PROJECTS = 10
T = TypeVar("T")


class Latencies:
    def __init__(self) -> None:
        self.by_route: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def timed(self, route: str, call: Callable[[], T]) -> T:
        started = time.perf_counter()
        result = call()
        with self._lock:
            self.by_route.setdefault(route, []).append(time.perf_counter() - started)
        return result

    def print(self) -> None:
        for route, seconds in sorted(self.by_route.items()):
            ordered = sorted(seconds)
            p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
            print(
                f"  {route:28} p50 {statistics.median(ordered) * 1000:7.0f} ms  "
                f"p99 {p99 * 1000:7.0f} ms  ({len(ordered)} calls)"
            )


def parallel(clients: int, work: Iterable[T], call: Callable[[T], object]) -> float:
    """Seconds to run ``call`` on every item with ``clients`` threads; any failure raises."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(call, work))
    return time.perf_counter() - started


def agent_stats() -> tuple[int, int]:
    """The agent's RSS (bytes) and thread count, from /proc."""
    pid = subprocess.run(
        ["systemctl", "show", "-P", "MainPID", "slicebox.service"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"])


# Where the guest's CPU goes, by the cgroups that do the work: cgroup v2 counts the CPU of
# processes that have exited too (runc, the shims' children), which /proc would lose.
CGROUP = Path("/sys/fs/cgroup")
CPU_UNITS = {
    "agent": "system.slice/slicebox.service",
    "dockerd": "system.slice/docker.service",
    "containerd": "system.slice/containerd.service",
    "systemd": "init.scope",
    "journald": "system.slice/systemd-journald.service",
    "sandboxes": "slicebox.slice",
}


def cpu_now() -> dict[str, float]:
    """CPU seconds so far of each unit above and of the whole guest ("all")."""
    seconds = {name: _usage(CGROUP / path) for name, path in CPU_UNITS.items()}
    stat = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(v) for i, v in enumerate(stat) if i not in (3, 4))  # less idle, iowait
    seconds["all"] = busy / os.sysconf("SC_CLK_TCK")
    return seconds


def _usage(cgroup: Path) -> float:
    try:
        for line in (cgroup / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    except OSError:  # the unit is not running (the agent, on docker-py's side)
        pass
    return 0.0


class Side:
    """One way of doing the work: its three operations, the sandboxes it made, and what each
    of its phases measured (seconds and CPU seconds by unit, summed over the rounds)."""

    name = ""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.cpu: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def create(self, n: int) -> None: ...

    def exec_(self, n: int) -> None: ...

    def destroy(self, sandbox: str) -> None: ...

    def made(self, sandbox: str) -> None:
        with self._lock:
            self.ids.append(sandbox)

    def phase(self, what: str, clients: int, work: list[T], call: Callable[[T], object]) -> None:
        """One round of a phase: ``call`` on every item, ``clients`` at a time."""
        before = cpu_now()
        seconds = parallel(clients, work, call)
        after = cpu_now()
        self.seconds[what] = self.seconds.get(what, 0.0) + seconds
        self.counts[what] = self.counts.get(what, 0) + len(work)
        spent = self.cpu.setdefault(what, dict.fromkeys(after, 0.0))
        for name in after:
            spent[name] += after[name] - before[name]

    def rate(self, what: str) -> float:
        return self.counts[what] / self.seconds[what]

    def whole_rate(self) -> float:
        """Operations a second over the whole work, every phase's."""
        return sum(self.counts.values()) / sum(self.seconds.values())

    def cpu_per_operation(self, what: str) -> dict[str, float]:
        return {name: spent / self.counts[what] for name, spent in self.cpu[what].items()}


class Slicebox(Side):
    name = "slicebox"

    def __init__(self, latencies: Latencies) -> None:
        super().__init__()
        self.latencies = latencies
        self.client = Client(str(SOCKET), timeout=600)

    def create(self, n: int) -> None:
        body = {"project": f"load{n % PROJECTS}", "ttl_seconds": 3600}
        made = self.latencies.timed(
            "POST /sandboxes", lambda: self.client.request("POST", "/sandboxes", body)
        )
        self.made(str(made["id"]))

    def exec_(self, n: int) -> None:
        sandbox = self.ids[n % len(self.ids)]
        path = f"/sandboxes/{sandbox}/exec"
        ran = self.latencies.timed(
            "POST /sandboxes/{id}/exec",
            lambda: self.client.request("POST", path, {"argv": ["echo", "hi"]}),
        )
        assert ran["stdout"] == "aGkK", ran  # base64 of hi\n
        if n % 20 == 0:
            self.latencies.timed("GET /sandboxes", lambda: self.client.request("GET", "/sandboxes"))
            self.latencies.timed(
                "GET /sandboxes/{id}/usage",
                lambda: self.client.request("GET", f"/sandboxes/{sandbox}/usage"),
            )

    def destroy(self, sandbox: str) -> None:
        self.latencies.timed(
            "DELETE /sandboxes/{id}",
            lambda: self.client.request("DELETE", f"/sandboxes/{sandbox}"),
        )


class DockerPy(Side):
    """The same work on the Engine API directly, with the flags the Docker backend uses."""

    name = "docker-py"

    def __init__(self) -> None:
        super().__init__()
        self.api = docker.APIClient(timeout=600)

    def create(self, n: int) -> None:
        request = SandboxRequest(
            name=f"bench-load-{n}",
            image=IMAGE,
            command=KEEP_ALIVE,
            labels={},
            slice=slice_names("root", f"load{n % PROJECTS}").project,
            limits=parse_config(TEST_CONFIG).sandbox.limits(),
        )
        made = self.api.create_container(
            IMAGE, list(KEEP_ALIVE), name=request.name, host_config=host_config(request)
        )
        self.api.start(made["Id"])
        self.made(made["Id"])

    def exec_(self, n: int) -> None:
        container = self.ids[n % len(self.ids)]
        made = self.api.exec_create(container, ["echo", "hi"])
        assert self.api.exec_start(made["Id"]) == b"hi\n"
        assert self.api.exec_inspect(made["Id"])["ExitCode"] == 0
        if n % 20 == 0:  # the list and the usage read slicebox's side does as often
            self.api.containers(filters={"name": "bench-load-"})
            self.api.stats(container, stream=False, one_shot=True)

    def destroy(self, sandbox: str) -> None:
        self.api.remove_container(sandbox, force=True)


def rounds(count: int, parts: int) -> list[list[int]]:
    """``range(count)`` in ``parts`` slices, each spread over the whole range (n, n+parts...)."""
    return [list(range(start, count, parts)) for start in range(parts)]


def turns(sides: list[Side], index: int) -> list[Side]:
    """The sides in round ``index``'s order: A B, then B A, and so on. What one phase leaves
    behind (the last phase's exited processes, journal flushes, the agent's start) falls on
    the phase right after it, so neither side always goes first."""
    return sides if index % 2 == 0 else sides[::-1]


def interleaved(args: argparse.Namespace, sides: list[Side], notes: list[str]) -> None:
    """Each phase in rounds, the sides taking turns: a change in the guest's load (another
    guest on the same cores, a slow moment of the emulator) falls on both sides alike."""
    ours = sides[0]
    try:
        for index, part in enumerate(rounds(args.sandboxes, args.rounds)):
            for side in turns(sides, index):
                side.phase("creates/s", args.clients, part, side.create)
        rss, threads = agent_stats()
        notes.append(
            f"agent at {len(ours.ids)} sandboxes: RSS {rss / 2**20:.0f} MiB, {threads} threads"
        )
        for index, part in enumerate(rounds(args.execs, args.rounds)):
            for side in turns(sides, index):
                side.phase("execs/s", args.clients, part, side.exec_)
        rss, threads = agent_stats()
        notes.append(f"agent after the execs: RSS {rss / 2**20:.0f} MiB, {threads} threads")
    finally:
        for index in range(args.rounds):
            for side in turns(sides, index):
                made = side.ids[index :: args.rounds]
                side.phase("destroys/s", args.clients, made, side.destroy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--execs", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--reaper-interval",
        type=float,
        default=ReaperConfig().interval_seconds,
        help="seconds between the agent's reaper passes (default: the shipped default; the "
        "load test runs one every 2 s)",
    )
    args = parser.parse_args()
    latencies, notes = Latencies(), []
    config = agent_config(f"interval_seconds = {args.reaper_interval}\n")
    try:
        with installed_agent(config):
            subprocess.run(["systemctl", "start", "slicebox.service"], check=True)
            Client(str(SOCKET), timeout=120).request("GET", "/health")
            rss, threads = agent_stats()
            notes.append(f"agent idle: RSS {rss / 2**20:.0f} MiB, {threads} threads")
            ours, theirs = Slicebox(latencies), DockerPy()
            try:
                interleaved(args, [ours, theirs], notes)
            finally:
                theirs.api.close()
    finally:
        units = [slice_names("root", f"load{n}").project for n in range(PROJECTS)]
        subprocess.run(["systemctl", "stop", *units, "slicebox-root.slice"], check=False)
    report(args, ours, theirs, notes, latencies)


def report(
    args: argparse.Namespace, ours: Side, theirs: Side, notes: list[str], latencies: Latencies
) -> None:
    print(
        f"{args.sandboxes} sandboxes, {args.execs} execs, {args.clients} parallel clients, "
        f"{args.rounds} rounds a phase, the sides taking turns (A B, B A, ...), "
        f"a reaper pass every {args.reaper_interval:g} s"
    )
    for what in ours.counts:
        rate, bare_rate = ours.rate(what), theirs.rate(what)
        print(
            f"  {what:11} slicebox {rate:7.2f}  docker-py {bare_rate:7.2f}  "
            f"RATIO {rate / bare_rate:.2f}"
        )
    # The whole work (every create, exec and destroy) in the time each side took for it.
    whole, bare_whole = ours.whole_rate(), theirs.whole_rate()
    print(
        f"  {'all ops/s':11} slicebox {whole:7.2f}  docker-py {bare_whole:7.2f}  "
        f"RATIO {whole / bare_whole:.2f}"
    )
    print("CPU seconds per operation, by where it was spent (slicebox | docker-py):")
    for what in ours.counts:
        print(f"  {what}")
        mine, bare = ours.cpu_per_operation(what), theirs.cpu_per_operation(what)
        for name in mine:
            print(f"    {name:11} {mine[name]:6.2f} | {bare[name]:6.2f}")
    for note in notes:
        print(f"  {note}")
    latencies.print()


if __name__ == "__main__":
    main()
