"""Bench: throughput under parallel load, the agent against raw docker-py doing the same work.

    tests/guest/run python3 -m bench.bench_load [--sandboxes 200] [--clients 8] [--execs 400]

Both sides run the same work with the same number of parallel clients, one side after the
other in the same run:

- slicebox: the real service (the checkout's units under systemd), called on its socket by
  ``--clients`` threads with the Python client: create ``--sandboxes`` sandboxes across 10
  projects, run ``--execs`` execs of ``echo hi`` spread over them (with a list and a usage read
  now and then), destroy them all;
- docker-py: the Engine API directly (``create_container`` + ``start`` with the HostConfig the
  Docker backend derives from the same settings table, ``exec_create`` + ``exec_start``,
  ``remove_container(force=True)``), same clients, same counts.

Printed: creates/s, execs/s and destroys/s of each side and their RATIO (slicebox over
docker-py: 1.0 means the agent adds nothing), p50/p99 per route of the agent, and the agent's
RSS and thread count with every sandbox alive (and idle, before the load).
"""

from __future__ import annotations

import argparse
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
from slicebox.backends.docker import host_config
from slicebox.cli.client import Client
from slicebox.core.sandboxes import KEEP_ALIVE
from slicebox.model.config import parse_config
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


class Rates:
    def __init__(self, name: str) -> None:
        self.name = name
        self.rates: dict[str, float] = {}

    def add(self, what: str, count: int, seconds: float) -> None:
        self.rates[what] = count / seconds


def run_slicebox(args: argparse.Namespace, latencies: Latencies) -> tuple[Rates, list[str]]:
    rates, notes = Rates("slicebox"), []
    client = Client(str(SOCKET), timeout=600)
    rss, threads = agent_stats()
    notes.append(f"agent idle: RSS {rss / 2**20:.0f} MiB, {threads} threads")
    ids: list[str] = []
    lock = threading.Lock()

    def create(n: int) -> None:
        body = {"project": f"load{n % PROJECTS}", "ttl_seconds": 3600}
        made = latencies.timed(
            "POST /sandboxes", lambda: client.request("POST", "/sandboxes", body)
        )
        with lock:
            ids.append(str(made["id"]))

    def exec_(n: int) -> None:
        sandbox = ids[n % len(ids)]
        path = f"/sandboxes/{sandbox}/exec"
        ran = latencies.timed(
            "POST /sandboxes/{id}/exec",
            lambda: client.request("POST", path, {"argv": ["echo", "hi"]}),
        )
        assert ran["stdout"] == "aGkK", ran  # base64 of hi\n
        if n % 20 == 0:
            latencies.timed("GET /sandboxes", lambda: client.request("GET", "/sandboxes"))
            latencies.timed(
                "GET /sandboxes/{id}/usage",
                lambda: client.request("GET", f"/sandboxes/{sandbox}/usage"),
            )

    def destroy(sandbox: str) -> None:
        latencies.timed(
            "DELETE /sandboxes/{id}", lambda: client.request("DELETE", f"/sandboxes/{sandbox}")
        )

    try:
        rates.add(
            "creates/s", args.sandboxes, parallel(args.clients, range(args.sandboxes), create)
        )
        rss, threads = agent_stats()
        notes.append(f"agent at {len(ids)} sandboxes: RSS {rss / 2**20:.0f} MiB, {threads} threads")
        rates.add("execs/s", args.execs, parallel(args.clients, range(args.execs), exec_))
        rss, threads = agent_stats()
        notes.append(f"agent after the execs: RSS {rss / 2**20:.0f} MiB, {threads} threads")
    finally:
        rates.add("destroys/s", len(ids), parallel(args.clients, list(ids), destroy))
    return rates, notes


def run_docker(args: argparse.Namespace) -> Rates:
    rates = Rates("docker-py")
    api = docker.APIClient(timeout=600)
    ids: list[str] = []
    lock = threading.Lock()

    def create(n: int) -> None:
        request = SandboxRequest(
            name=f"bench-load-{n}",
            image=IMAGE,
            command=KEEP_ALIVE,
            labels={},
            slice=slice_names("root", f"load{n % PROJECTS}").project,
            limits=parse_config(TEST_CONFIG).sandbox.limits(),
        )
        made = api.create_container(
            IMAGE, list(KEEP_ALIVE), name=request.name, host_config=host_config(request)
        )
        api.start(made["Id"])
        with lock:
            ids.append(made["Id"])

    def exec_(n: int) -> None:
        made = api.exec_create(ids[n % len(ids)], ["echo", "hi"])
        assert api.exec_start(made["Id"]) == b"hi\n"
        assert api.exec_inspect(made["Id"])["ExitCode"] == 0

    def destroy(container: str) -> None:
        api.remove_container(container, force=True)

    try:
        rates.add(
            "creates/s", args.sandboxes, parallel(args.clients, range(args.sandboxes), create)
        )
        rates.add("execs/s", args.execs, parallel(args.clients, range(args.execs), exec_))
    finally:
        rates.add("destroys/s", len(ids), parallel(args.clients, list(ids), destroy))
        api.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--execs", type=int, default=400)
    args = parser.parse_args()
    latencies = Latencies()
    config = agent_config("interval_seconds = 2\n")
    try:
        with installed_agent(config):
            subprocess.run(["systemctl", "start", "slicebox.service"], check=True)
            Client(str(SOCKET), timeout=120).request("GET", "/health")
            ours, notes = run_slicebox(args, latencies)
        theirs = run_docker(args)
    finally:
        units = [slice_names("root", f"load{n}").project for n in range(PROJECTS)]
        subprocess.run(["systemctl", "stop", *units, "slicebox-root.slice"], check=False)
    print(f"{args.sandboxes} sandboxes, {args.execs} execs, {args.clients} parallel clients")
    for what, rate in ours.rates.items():
        bare = theirs.rates[what]
        print(f"  {what:11} slicebox {rate:7.2f}  docker-py {bare:7.2f}  RATIO {rate / bare:.2f}")
    for note in notes:
        print(f"  {note}")
    latencies.print()


if __name__ == "__main__":
    main()
