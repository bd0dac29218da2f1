"""A reaper pass (observe + plan) vs the bare listing a cron script would do, for N sandboxes.

Run on a real host (the guest):  tests/guest/run python3 bench/bench_reaper.py [--count 30]

Creates COUNT sandboxes through the real lifecycle (slices, hardened containers, deadline
timers), then times, REPEAT times each: a dry-run reaper pass (list managed containers with
their labels and states, running slices, deadline timers and state directories, then plan)
against the raw alternative, ``docker ps -a --filter label=slicebox.managed=true`` with each
container inspected for its labels (which alone decides nothing about slices or deadlines).
Prints the medians and their ratio; removes everything it made, also on Ctrl-C. Absolute
times under emulation say little; the ratio in one run is the point.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import docker
from tests.fakes.threadside import created

from slicebox.backends.docker import DockerBackend
from slicebox.core.deadlines import Deadlines
from slicebox.core.reaper import Reaper
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.journal import Auditor
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.config import ReaperConfig, parse_config, read_host_memory
from slicebox.model.spec import SandboxSpec

USER = "benchreap"


class NoJournal:
    """A dry run audits nothing; a real pass here would write to no journal."""

    def send(self, fields: Mapping[str, str]) -> None:
        pass


def median_seconds(function: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def raw_listing(client: docker.DockerClient) -> int:
    found = client.api.containers(all=True, filters={"label": "slicebox.managed=true"})
    return len([client.api.inspect_container(c["Id"])["Config"]["Labels"] for c in found])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    client = docker.from_env()
    systemd = PystemdSystemd()
    slices = SliceManager(systemd)
    manager = SandboxManager(
        DockerBackend.from_env(),
        slices,
        config=parse_config('default_image = "slicebox-test/busybox:latest"\n'),
        host_memory=read_host_memory(),
        instance_id="run-bench",
        deadlines=Deadlines(systemd),
    )
    with tempfile.TemporaryDirectory() as state:
        reaper = Reaper(
            manager,
            slices,
            DockerBackend.from_env(),
            auditor=Auditor(NoJournal()),
            config=lambda: ReaperConfig(state_dir=Path(state)),
        )
        made: list[str] = []
        try:
            for index in range(args.count):
                spec = {"user": USER, "project": f"p{index % 3}", "memory": "16MB"}
                made.append(created(manager, SandboxSpec.model_validate(spec)).id)
            assert reaper.run(dry_run=True).plan == [], "a clean host plans nothing"
            ours = median_seconds(lambda: reaper.run(dry_run=True), args.repeat)
            raw = median_seconds(lambda: raw_listing(client), args.repeat)
        finally:
            for sandbox_id in made:
                manager.destroy(sandbox_id)
    print(f"{args.count} sandboxes: reaper pass (observe + plan) {ours * 1000:.0f} ms")
    print(f"{args.count} sandboxes: docker ps -a + inspect each  {raw * 1000:.0f} ms")
    print(f"ratio reaper / raw listing: {ours / raw:.2f}")
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
