"""Bench: what egress by allow-list costs a connection, one guest run.

    tests/guest/run python3 -m bench.bench_egress [--connections 40] [--rounds 5] [--extra 200]

Two sandboxes of the same image and hardening: one made by the agent (the real service) with
``egress.allow = [pkgs.test]``, its names through the agent's resolver and its packets through
slicebox's nftables table; the other made with docker-py on Docker's plain bridge, its DNS
pointed straight at the same nameserver. In each, ``--connections`` ``wget`` of
``http://pkgs.test:8000/`` in a row (busybox resolves the name for every one: a lookup and a
TCP connection each), timed inside the sandbox from ``/proc/uptime``, rounds interleaved.

Then ``--extra`` more sandboxes' rule sets (sets, counters, chain, map entry; made through the
same ``host.nft`` calls, for addresses no container has) are loaded and the egress side is
timed again: what 200 sandboxes' rules cost a new connection. The world (servers, zone) is
``tests.host.egressworld``: nothing leaves the guest.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from ipaddress import IPv4Address

import docker
from tests.host import egressworld as w
from tests.host.agentunits import SOCKET, agent_config, installed_agent
from tests.host.helpers import TEST_IMAGE, sh

from slicebox.backends.base import SandboxRequest
from slicebox.backends.dockerbody import host_config
from slicebox.client import Client
from slicebox.core.creation import KEEP_ALIVE
from slicebox.core.egress import BRIDGE
from slicebox.host.nft import Allowed, Firewall, libnftables
from slicebox.model.api import CreateSandbox
from slicebox.model.config import parse_config
from slicebox.model.exec import ExecRequest
from slicebox.model.limits import Limits

GATEWAY = IPv4Address("10.213.0.1")
# No reaper pass while the bench runs: the extra rule sets belong to no container, and a pass
# would (rightly) collect them mid-measurement.
CONFIG = agent_config("interval_seconds = 3600\n") + (
    f'[egress]\nupstream = ["{w.NAMESERVER}"]\ninternal_networks = ["{w.INTERNAL}"]\n'
    "[[egress.rule]]\n"  # egress is closed by default: the bench's operator opens it
)
LOOP = (
    "read a _ < /proc/uptime; i=0; while [ $i -lt {n} ]; do "
    "wget -q -O /dev/null -T 5 http://pkgs.test:8000/ || exit 1; i=$((i+1)); done; "
    "read b _ < /proc/uptime; echo $a $b"
)


def seconds_per_connection(out: str, connections: int) -> float:
    start, end = (float(x) for x in out.split())
    return (end - start) / connections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--extra", type=int, default=200)
    args = parser.parse_args()
    loop = LOOP.format(n=args.connections)
    api = docker.APIClient(timeout=300)
    plain_id = ""
    wall = Firewall(libnftables(), BRIDGE, GATEWAY)
    extra = [f"bench-{n}" for n in range(args.extra)]
    try:
        with w.world(), installed_agent(CONFIG):
            sh("systemctl", "start", "slicebox.service")
            client = Client(str(SOCKET), timeout=300)
            spec = {"project": "ebench", "network": {"egress": {"allow": ["pkgs.test"]}}}
            box = client.create(CreateSandbox.model_validate(spec))
            plain_id = _plain(api)

            def guarded() -> float:
                request = ExecRequest.model_validate(
                    {"argv": loop, "shell": True, "timeout": 300, "cwd": "/"}
                )
                result = client.exec(box.id, request)
                assert result.exit_code == 0, result.stdout
                return seconds_per_connection(result.stdout.decode(), args.connections)

            def plain() -> float:
                exec_id = api.exec_create(plain_id, ["sh", "-c", loop])["Id"]
                out = api.exec_start(exec_id).decode()
                return seconds_per_connection(out, args.connections)

            ours, bare = _interleaved(args.rounds, guarded, plain)
            for n, name in enumerate(extra):
                wall.add_sandbox(name, IPv4Address("10.213.200.0") + n, Allowed())
            loaded, bare_loaded = _interleaved(args.rounds, guarded, plain)
            client.destroy(box.id)
    finally:
        for name in extra:
            wall.remove_sandbox(name)
        if plain_id:
            api.remove_container(plain_id, force=True)
        api.close()
    _report(args, ours, bare, loaded, bare_loaded)


def _plain(api: docker.APIClient) -> str:
    """The same sandbox on Docker's plain bridge, DNS straight to the world's nameserver."""
    config = parse_config("")
    request = SandboxRequest(
        name="bench-plain",
        image=TEST_IMAGE,
        command=KEEP_ALIVE,
        labels={},
        slice="system.slice",
        limits=Limits(cpus=config.sandbox.cpus, memory_bytes=256 * 2**20, pids=100),
        network="bridge",
        dns=(w.NAMESERVER,),
    )
    plain = host_config(request) | {"NetworkMode": "bridge"}  # docker0 itself, not slicebox's
    created = api.create_container(
        TEST_IMAGE, list(KEEP_ALIVE), host_config=plain, user="65534:65534"
    )
    api.start(created["Id"])
    return str(created["Id"])


def _interleaved(
    rounds: int, guarded: Callable[[], float], plain: Callable[[], float]
) -> tuple[list[float], list[float]]:
    ours: list[float] = []
    bare: list[float] = []
    for index in range(rounds):
        order = [(guarded, ours), (plain, bare)]
        for call, into in order if index % 2 == 0 else order[::-1]:
            into.append(call())
    return ours, bare


def _report(
    args: argparse.Namespace,
    ours: list[float],
    bare: list[float],
    loaded: list[float],
    bare_loaded: list[float],
) -> None:
    print(
        f"{args.connections} connections a round (a lookup and a TCP connection each), "
        f"{args.rounds} rounds, medians"
    )
    mine, theirs = statistics.median(ours), statistics.median(bare)
    print(f"  egress sandbox   {mine * 1000:7.1f} ms a connection")
    print(f"  plain bridge     {theirs * 1000:7.1f} ms a connection   RATIO {mine / theirs:.2f}")
    heavy, heavy_bare = statistics.median(loaded), statistics.median(bare_loaded)
    print(
        f"  with {args.extra} more sandboxes' rule sets: {heavy * 1000:.1f} ms "
        f"(plain {heavy_bare * 1000:.1f}), RATIO to before {heavy / mine:.2f}"
    )


if __name__ == "__main__":
    main()
