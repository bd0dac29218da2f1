"""Issue 38 on egress: what no list may name and no answer may point at (model.egress,
core.policy, core.egress), the host out of reach at the packet level (host.nft), and the
resolver's state bounded per sandbox (core.dnsbounds, core.egress, server.resolver)."""

from __future__ import annotations

import asyncio
import socket
from ipaddress import IPv4Address, IPv4Network, IPv6Address
from pathlib import Path

import pytest

from slicebox.core.dnsbounds import DENIED_NAMES_KEPT, Bucket, DeniedTally, Opened
from slicebox.core.policy import admit
from slicebox.host.addresses import host_addresses, local_addresses
from slicebox.model import dnswire
from slicebox.model.config import parse_config
from slicebox.model.egress import EgressConfig, NetworkSpec, parse_entries, rebinding
from slicebox.model.errors import PolicyViolation
from slicebox.model.spec import SandboxSpec
from slicebox.server.resolver import serve_resolver
from tests.unit.test_egress import GATEWAY, Guarded

GRANTED = "[[egress.rule]]\n"
DEFAULTS = EgressConfig()
QUERY_BURST = DEFAULTS.resolver_burst
TCP_PER_SANDBOX, TCP_MAX = DEFAULTS.resolver_tcp_per_sandbox, DEFAULTS.resolver_tcp


def spec(*allow: str, network: object = None) -> SandboxSpec:
    chosen = network if network is not None else {"egress": {"allow": list(allow)}}
    return SandboxSpec.model_validate({"user": "alice", "project": "web", "network": chosen})


# --- what no entry may name ------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        "0.0.0.0/0",
        "0.0.0.0/1",
        "10.213.0.1",  # the gateway: the resolver, and the host
        "10.213.0.0/16:22",
        "10.213.4.7",  # another sandbox
        "10.0.0.0/8",  # wider than the egress subnet
        "169.254.169.254",
        "169.254.0.0/16:80",
        "127.0.0.1",
        "127.0.0.53:53",
        "224.0.0.251",
        "255.255.255.255",
    ],
)
def test_an_entry_in_reserved_space_is_refused_at_create_whatever_the_rules(entry: str) -> None:
    with pytest.raises(PolicyViolation) as refused:
        admit(spec(entry), parse_config(GRANTED), host_memory=2**32)
    assert refused.value.code == "policy_egress"
    assert "internal_networks" in refused.value.message


@pytest.mark.parametrize("entry", ["151.101.0.0/16", "192.0.2.7:443", "10.20.0.0/16", "pypi.org"])
def test_public_and_other_private_entries_pass(entry: str) -> None:
    assert admit(spec(entry), parse_config(GRANTED), host_memory=2**32)


def test_an_internal_network_admits_what_it_covers_and_no_more() -> None:
    config = EgressConfig(internal_networks=(IPv4Network("169.254.169.254/32"),))
    entries = parse_entries(("169.254.169.254", "169.254.169.253", "0.0.0.0/0"))
    assert config.unreachable(entries) == ["169.254.169.253/32", "0.0.0.0/0"]


def test_egress_and_bridge_are_closed_by_default() -> None:
    with pytest.raises(PolicyViolation) as refused:
        admit(spec("pypi.org"), parse_config(""), host_memory=2**32)
    assert refused.value.code == "policy_egress"
    with pytest.raises(PolicyViolation) as bridge:
        admit(spec(network="bridge"), parse_config(""), host_memory=2**32)
    assert bridge.value.code == "policy_network"
    allowed = parse_config('allowed_networks = ["none", "bridge"]\n')
    assert admit(spec(network="bridge"), allowed, host_memory=2**32)


def test_the_host_s_own_addresses_and_docker_s_subnets_are_refused_when_placed() -> None:
    world = Guarded()
    for entry in ("192.0.2.10", "10.0.2.15:22", "172.17.0.0/16", "172.17.0.1"):
        with pytest.raises(PolicyViolation) as refused:
            world.guard.place("sbx-1", "alice", "web", (entry,))
        assert refused.value.code == "policy_egress", entry
    assert world.networks.made == [], "refused before anything is made"
    inside = Guarded(EgressConfig(internal_networks=(IPv4Network("10.0.2.15/32"),)))
    assert inside.guard.place("sbx-1", "alice", "web", ("10.0.2.15",)).allow == "10.0.2.15/32"


# --- what no answer may point at ---------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    ["169.254.169.254", "127.0.0.1", "10.213.0.1", "0.0.0.0", "224.0.0.1"],
)
def test_an_answer_into_reserved_space_is_rebinding_even_when_an_entry_covers_it(
    address: str,
) -> None:
    entries = parse_entries(("0.0.0.0/1", "128.0.0.0/1"))  # as an older label could say
    reserved = EgressConfig().reserved()
    assert rebinding(IPv4Address(address), entries, (), reserved)
    internal = (IPv4Network(f"{address}/32"),)
    assert not rebinding(IPv4Address(address), entries, internal, reserved)


@pytest.mark.parametrize("address", ["::1", "fe80::1", "::ffff:169.254.169.254", "::", "ff02::1"])
def test_ipv6_equivalents_are_refused(address: str) -> None:
    assert rebinding(IPv6Address(address), ())


def test_the_resolver_refuses_an_answer_pointing_at_the_host_or_a_bridge() -> None:
    world = Guarded()
    world.zone.records["host.example.org"] = [(dnswire.A, 60, "192.0.2.10")]
    world.zone.records["docker.example.org"] = [(dnswire.A, 60, "172.17.0.2")]
    world.zone.records["meta.example.org"] = [(dnswire.A, 60, "169.254.169.254")]
    placed = world.guard.place("sbx-1", "alice", "web", ("*.example.org",))
    for name in ("host.example.org", "docker.example.org", "meta.example.org"):
        assert world.ask(placed.address, name) == dnswire.REFUSED, name
    assert world.api.table().elements["dns_sbx_1"] == {}


def test_the_host_s_local_addresses_are_read_from_the_fib_trie(tmp_path: Path) -> None:
    trie = tmp_path / "fib_trie"
    trie.write_text(
        "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n"
        "     |-- 10.0.2.15\n        /32 host LOCAL\n     |-- 10.0.2.255\n"
        "        /32 link BROADCAST\n     |-- 127.0.0.1\n        /32 host LOCAL\n"
        "Local:\n     |-- 10.0.2.15\n        /32 host LOCAL\n"
    )
    assert host_addresses(trie) == (IPv4Network("10.0.2.15/32"), IPv4Network("127.0.0.1/32"))
    assert local_addresses("") == ()
    assert host_addresses(tmp_path / "missing") == ()


# --- the host at the packet level ----------------------------------------------------------------


def test_the_input_hook_opens_the_resolver_and_drops_the_rest_from_the_bridge() -> None:
    """Before, it jumped to the sandbox's chain: a listed host address was reachable."""
    world = Guarded()
    world.guard.place("sbx-1", "alice", "web", ("pypi.org",))
    table = world.api.table()
    text = repr(table.chains["input"])
    assert "guard" not in text, "the host is not reached through a sandbox's list"
    assert "'drop'" in text
    assert "'host'" in text
    assert "53" in text
    assert str(GATEWAY) in text
    assert "host" in table.counters


# --- the resolver's bounds ---------------------------------------------------------------------


def test_the_bucket_lets_a_burst_through_then_the_rate() -> None:
    now = [0.0]
    bucket = Bucket(lambda: now[0], rate=10, burst=5)
    assert [bucket.take() for _ in range(6)] == [True] * 5 + [False]
    now[0] += 0.35
    assert [bucket.take() for _ in range(4)] == [True] * 3 + [False]


def test_the_denied_tally_keeps_the_most_counted_and_the_total() -> None:
    tally = DeniedTally(kept=3)
    for name in ["a"] * 5 + ["b"] * 3 + [f"junk{n}" for n in range(1000)] + ["a"]:
        tally.add(name)
    assert tally.total == 1009
    ranked = tally.most_common()
    assert len(ranked) == 3
    assert ranked[0] == ("a", 6), "a frequent name stays, however much junk follows"


def test_opened_answers_are_bounded() -> None:
    opened = Opened(kept=4)
    for n in range(10):
        opened.put((IPv4Address(f"192.0.2.{n}"), ()), until=100.0, now=0.0)
        assert len(opened) <= 4
    opened = Opened(kept=4)
    for n in range(4):
        opened.put((IPv4Address(f"192.0.2.{n + 100}"), ()), until=100.0, now=0.0)
    opened.put((IPv4Address("192.0.2.200"), ()), until=10.0, now=200.0)  # the rest expired
    assert len(opened) == 1


def test_a_flood_of_denied_names_is_rate_limited_counted_and_bounded() -> None:
    world = Guarded()  # the defaults: 300 at once (resolver_burst)
    placed = world.guard.place("sbx-1", "alice", "web", ("pypi.org",))

    async def flood(count: int) -> list[bytes | None]:
        source, guard = str(placed.address), world.guard
        return [
            await guard.answer(dnswire.build_query(f"d{n}.nowhere.test", 1, n), source)
            if guard.admitted(source)
            else None
            for n in range(count)
        ]

    answered = asyncio.run(flood(20_000))
    assert sum(a is not None for a in answered) == int(QUERY_BURST), "the clock stood still"
    counters = world.guard.counters("sbx-1")
    assert counters is not None
    assert counters.dropped_queries == 20_000 - int(QUERY_BURST)
    assert counters.denied_names == int(QUERY_BURST)
    world.now += 60.0  # a minute later: a full burst again
    asyncio.run(flood(5_000))  # d0..d299 again: 300 distinct names in all
    assert len(world.guard.denied("sbx-1")) == DENIED_NAMES_KEPT
    world.guard.release("sbx-1")
    detail = world.audited[-1].detail
    assert detail is not None
    assert detail.startswith("denied names: 600 in all; "), detail


@pytest.mark.parametrize("caps", [(TCP_PER_SANDBOX, TCP_MAX), (2, 5)])
def test_tcp_connections_are_capped_per_sandbox_and_in_all(caps: tuple[int, int]) -> None:
    """At the defaults, and at the operator's own caps ([egress] resolver_tcp_*)."""
    per_sandbox, total = caps
    fields = {"resolver_tcp_per_sandbox": per_sandbox, "resolver_tcp": total}
    world = Guarded(EgressConfig.model_validate(fields))
    one = world.guard.place("sbx-1", "alice", "web", ("pypi.org",))
    source = str(one.address)
    assert all(world.guard.connected(source) for _ in range(per_sandbox))
    assert not world.guard.connected(source)
    counters = world.guard.counters("sbx-1")
    assert counters is not None
    assert counters.refused_connections == 1
    world.guard.disconnected(source)
    assert world.guard.connected(source), "a closed one frees its place"
    others = [f"10.213.{n // 250}.{n % 250 + 2}" for n in range(total)]
    taken = sum(world.guard.connected(other) for other in others)
    assert taken == total - per_sandbox


def test_the_resolver_closes_tcp_connections_its_gate_refuses() -> None:
    class Gate:
        def __init__(self) -> None:
            self.open = 0

        def admitted(self, source: str) -> bool:
            return True

        def connected(self, source: str) -> bool:
            if self.open >= 2:
                return False
            self.open += 1
            return True

        def disconnected(self, source: str) -> None:
            self.open -= 1

    async def silent(query: bytes, source: str, tcp: bool) -> bytes | None:
        return b"x"

    async def scenario() -> list[bytes]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        gate = Gate()
        close = await serve_resolver(IPv4Address("127.0.0.1"), silent, port=port, gate=gate)
        try:
            streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
            got = []
            for reader, writer in streams:
                try:
                    writer.write(b"\x00\x01q")
                    await writer.drain()
                    got.append(await asyncio.wait_for(reader.read(3), 5))
                except ConnectionResetError:
                    got.append(b"")
            for _, writer in streams:
                writer.close()
            return got
        finally:
            await close()

    got = asyncio.run(scenario())
    assert got[:2] == [b"\x00\x01x", b"\x00\x01x"]
    assert got[2:] == [b"", b"", b""], "closed at once, no answer"


def test_the_resolver_s_caps_are_the_operator_s_and_checked() -> None:
    """[egress] resolver_*: a smaller burst answers that many of a flood; a per-sandbox cap
    over the total, or past the descriptor room, is refused at load."""
    world = Guarded(EgressConfig.model_validate({"resolver_burst": 10}))
    placed = world.guard.place("sbx-1", "alice", "web", ("pypi.org",))
    source = str(placed.address)
    admitted = sum(world.guard.admitted(source) for _ in range(100))
    assert admitted == 10
    with pytest.raises(ValueError, match="raise resolver_tcp"):
        EgressConfig.model_validate({"resolver_tcp_per_sandbox": 9, "resolver_tcp": 8})
    with pytest.raises(ValueError, match="less than or equal to 1024"):
        EgressConfig.model_validate({"resolver_tcp": 5000})


def test_a_wasm_plugin_s_hosts_name_no_address_of_the_host_s_own_or_docker_s() -> None:
    """A wasm plugin's allowed hosts are its runtime's filter, made from the same allow-list:
    the host's own LAN address (and Docker's bridge subnets) are refused as for an egress
    sandbox (before: checked against the reserved networks only, at admission)."""
    world = Guarded()  # Docker's bridge 172.17.0.0/16; the host at 10.0.2.15 and 192.0.2.10

    def check(*allow: str) -> None:
        world.guard.check_hosts(NetworkSpec.model_validate({"egress": {"allow": list(allow)}}))

    check("151.101.0.223", "pypi.org")
    for reached in ("10.0.2.15", "172.17.0.5"):
        with pytest.raises(PolicyViolation) as refused:
            check("pypi.org", reached)
        assert refused.value.code == "policy_egress"
        assert reached in refused.value.message
