"""Bench: a child's create through a nested sandbox's own socket against the same create
through the host's socket (issue 44's target: at most 1.2).

    tests/guest/run python3 -m bench.bench_nested [--rounds 3] [--per-round 5]

The checkout's agent runs as the system service. One nested parent (the image of
tests/host/nestedimage.py: the guest's python and the checkout's client). Each side keeps one
warm client and times a create (the answer, the sandbox running) of the same shape in the same
project, destroying each before the next (its destroy is not timed). The sides take turns by
rounds, ``--per-round`` creates each: the host's in this process, the nested one's in one
exec in the parent (its own client, its own clock), so a change in the guest's load falls on
both alike. Printed: each side's median and the RATIO nested / host. Everything is removed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tests.host import nestedimage
from tests.host.agentunits import admin, agent_config, installed_agent
from tests.host.helpers import ordinary_user, sh

from slicebox.client import Client
from slicebox.model.api import CreateSandbox
from slicebox.model.exec import ExecRequest

USER, PROJECT = "sbxnestbench", "bench"
CONFIG = agent_config() + "[nested]\ncreates_per_minute = 10000\n"
SHAPE = {"memory": "64MB", "cpus": 0.5, "pids": 64, "ttl_seconds": 600}
INNER = """
import json, sys, time
from slicebox.client import Client
from slicebox.model.api import CreateSandbox
spec = CreateSandbox.model_validate(json.loads(sys.argv[1]))
client = Client()
client.health()
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    made = client.create(spec)
    times.append(time.perf_counter() - start)
    client.destroy(made.id)
print(json.dumps(times))
"""


def host_side(client: Client, spec: CreateSandbox, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        made = client.create(spec)
        times.append(time.perf_counter() - start)
        client.destroy(made.id)
    return times


def nested_side(parent: str, spec: CreateSandbox, count: int) -> list[float]:
    body = json.dumps(spec.model_dump(mode="json", exclude_none=True, exclude={"user"}))
    request = ExecRequest(
        argv=("python3", "-", body, str(count)), stdin=INNER.encode(), timeout=3600
    )
    ran = admin().exec(parent, request)
    if ran.exit_code != 0:
        raise SystemExit(ran.stderr.decode(errors="replace"))
    times: list[float] = json.loads(ran.stdout)
    return times


def bench(rounds: int, per_round: int) -> None:
    with installed_agent(CONFIG), ordinary_user(USER):
        sh("systemctl", "start", "slicebox.socket")
        image = nestedimage.build()
        client = admin()
        parent = client.create(
            CreateSandbox(
                user=USER,
                project=PROJECT,
                image=image,
                memory="256MB",
                nested={"max_children": 2},
            )
        ).id
        try:
            spec = CreateSandbox.model_validate(
                {"user": USER, "project": PROJECT, "image": image, **SHAPE}
            )
            host_side(client, spec, 1)  # both warm: the image known, the slices there
            nested_side(parent, spec, 1)
            times: dict[str, list[float]] = {"host": [], "nested": []}
            for n in range(rounds):
                sides = ["host", "nested"] if n % 2 == 0 else ["nested", "host"]
                for name in sides:
                    if name == "host":
                        times[name].extend(host_side(client, spec, per_round))
                    else:
                        times[name].extend(nested_side(parent, spec, per_round))
        finally:
            client.destroy(parent)
            nestedimage.remove()
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"create of a sandbox, {rounds} rounds of {per_round} each side, taking turns:")
    for name, median in medians.items():
        print(f"  {name:8} p50 {median * 1000:8.1f} ms")
    print(f"  RATIO nested / host {medians['nested'] / medians['host']:.2f} (target <= 1.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=5)
    options = parser.parse_args()
    bench(options.rounds, options.per_round)


if __name__ == "__main__":
    main()
