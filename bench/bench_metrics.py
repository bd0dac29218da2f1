"""Bench: what a scrape of ``GET /metrics`` costs with N sandboxes, against ``docker ps``.

    tests/guest/run python3 -m bench.bench_metrics [--sandboxes 200] [--rounds 15]

The checkout's agent runs as the system service (its units under systemd) with its metrics
listener on. The bench makes ``--sandboxes`` sandboxes across 10 projects of one user, then,
in ``--rounds`` rounds taking turns (so a change in the guest's load falls on both alike):

- a scrape: ``GET /metrics`` on the agent's socket as root (every series), the whole answer
  read; rounds are more than a second apart, so no scrape is answered from the one before;
- ``docker ps``: the Engine API's list of every container (``GET /containers/json?all=1``,
  what ``docker ps -a`` asks), on Docker's socket from the same process; and the ``docker ps``
  command itself, once a round, as an operator runs it.

Printed: the median of each and the RATIO scrape / Engine API list (below 1.0: a scrape costs
less than one ``docker ps``), the same with per-sandbox series on (``[metrics] per_sandbox``),
the exposition's size, and the agent's RSS before its first scrape and after every round of
both (the RSS delta of metrics at work). Every sandbox, slice and file it made is removed at
the end.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
from tests.host.agentunits import CONFIG, SOCKET, agent_config, installed_agent

from bench.bench_load import agent_stats
from slicebox.client import Client
from slicebox.model.api import CreateSandbox
from slicebox.model.names import slice_names

USER = "root"
PROJECTS = 10
FRESH = 1.1  # seconds between scrapes: more than the agent keeps one collection
TOKEN = Path("/etc/slicebox/metrics-bench.token")


def scrape() -> bytes:
    """``GET /metrics`` on the socket, read to its end (the answer closes the connection)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(SOCKET))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := s.recv(1 << 16):
            chunks.append(chunk)
    answer = b"".join(chunks)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return answer


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def docker_ps() -> None:
    """``docker ps -a -q``, the command an operator runs."""
    subprocess.run(["docker", "ps", "-a", "-q"], capture_output=True, check=True)


def rounds(count: int, api: docker.APIClient) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"scrape": [], "engine list": [], "docker ps": []}
    for n in range(count):
        time.sleep(FRESH)
        pairs: list[tuple[str, Callable[[], object]]] = [
            ("scrape", scrape),
            ("engine list", lambda: api.containers(all=True)),
        ]
        for name, call in pairs if n % 2 == 0 else reversed(pairs):
            times[name].append(timed(call))
        times["docker ps"].append(timed(docker_ps))
    return times


def report(label: str, times: dict[str, list[float]]) -> None:
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"  {label:16} {name:12} p50 {median * 1000:8.1f} ms")
    ratio = medians["scrape"] / medians["engine list"]
    print(f"  {label:16} RATIO scrape/docker ps {ratio:.2f} (below 1.0: cheaper than docker ps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    api = docker.APIClient()
    client = Client(str(SOCKET), timeout=300)
    TOKEN.parent.mkdir(exist_ok=True)
    listen = f'[metrics]\nlisten = "127.0.0.1:19464"\ntoken_file = "{TOKEN}"\n'
    try:
        with installed_agent(agent_config() + listen):
            TOKEN.write_text("bench-token\n")
            TOKEN.chmod(0o600)
            subprocess.run(["systemctl", "start", "slicebox.service"], check=True)
            client.health()
            specs = [
                CreateSandbox(user=USER, project=f"metrics{n % PROJECTS}")
                for n in range(args.sandboxes)
            ]
            with ThreadPoolExecutor(args.clients) as pool:
                made = list(pool.map(client.create, specs))
            rss_before, _ = agent_stats()
            print(f"metrics with {len(made)} sandboxes ({args.rounds} rounds):")
            report("levels", rounds(args.rounds, api))
            size = len(scrape())
            CONFIG.write_text(agent_config() + listen + "per_sandbox = true\n")
            subprocess.run(["systemctl", "reload", "slicebox.service"], check=True)
            time.sleep(2)
            report("per sandbox", rounds(args.rounds, api))
            rss_after, threads = agent_stats()
            print(f"  exposition {size / 1024:.0f} KiB; per sandbox {len(scrape()) / 1024:.0f} KiB")
            print(
                f"  agent RSS before its first scrape {rss_before / 2**20:.1f} MiB, after "
                f"{2 * args.rounds + 2} scrapes {rss_after / 2**20:.1f} MiB: delta "
                f"{(rss_after - rss_before) / 2**20:+.1f} MiB ({threads} threads)"
            )
            with ThreadPoolExecutor(args.clients) as pool:
                list(pool.map(lambda view: client.destroy(view.id), made))
    finally:
        TOKEN.unlink(missing_ok=True)
        units = [slice_names(USER, f"metrics{n}").project for n in range(PROJECTS)]
        subprocess.run(["systemctl", "stop", *units], check=False)
        api.close()


if __name__ == "__main__":
    main()
