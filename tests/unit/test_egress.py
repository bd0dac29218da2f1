"""Egress by allow-list: entries and rules (model.egress), the table (host.nft, over a fake
libnftables that fails as the kernel does), the guard and its resolver (core.egress)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from ipaddress import IPv4Address, IPv4Network

import pytest
from pydantic import ValidationError

from slicebox.core.egress import BRIDGE, NETWORK, EgressGuard, Labelled
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.core.views import view_of
from slicebox.host.nft import Allowed, Firewall, key_of
from slicebox.model import dnswire
from slicebox.model.audit import AuditEvent, AuditRecord
from slicebox.model.config import parse_config
from slicebox.model.egress import (
    EgressConfig,
    EgressRule,
    EntryKind,
    parse_entries,
    parse_entry,
    permits,
    rebinding,
    sandbox_address,
)
from slicebox.model.errors import HostError, PolicyViolation, Unavailable
from slicebox.model.spec import SandboxSpec
from slicebox.model.usage import EgressCounters, Level, LevelNode
from tests.fakes.docker import FakeDocker
from tests.fakes.nft import FakeNftApi
from tests.fakes.systemd import FakeSystemd
from tests.fakes.threadside import created

GATEWAY = IPv4Address("10.213.0.1")
HOST_ADDRESSES = (IPv4Network("192.0.2.10/32"), IPv4Network("10.0.2.15/32"))


# --- entries ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "normal", "port"),
    [
        ("PyPI.org", EntryKind.NAME, "pypi.org", None),
        ("pypi.org.", EntryKind.NAME, "pypi.org", None),
        ("*.githubusercontent.com", EntryKind.WILDCARD, "*.githubusercontent.com", None),
        ("example.org:443", EntryKind.NAME, "example.org:443", 443),
        ("10.20.0.0/16", EntryKind.NETWORK, "10.20.0.0/16", None),
        ("192.0.2.7", EntryKind.NETWORK, "192.0.2.7/32", None),
        ("192.0.2.7:53", EntryKind.NETWORK, "192.0.2.7/32:53", 53),
        ("1password.com", EntryKind.NAME, "1password.com", None),
    ],
)
def test_entries_parse_to_a_normal_form(
    text: str, kind: EntryKind, normal: str, port: int | None
) -> None:
    entry = parse_entry(text)
    assert (entry.kind, entry.text, entry.port) == (kind, normal, port)
    assert parse_entry(entry.text) == entry, "the normal form parses to itself"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("*", "no bare '*'"),
        ("", "no bare '*'"),
        ("10.20.0.1/16", "not an IPv4 address"),
        ("example.org:0", "port"),
        ("example.org:http", "port"),
        ("2001:db8::/32", "IPv6"),
        ("[2001:db8::1]:443", "IPv6"),
        ("exa mple.org", "not a host name"),
        ("a.*.org", "not a host name"),
        ("-bad.org", "not a host name"),
        ("x" * 64 + ".org", "not a host name"),
    ],
)
def test_bad_entries_are_refused_with_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_entry(text)


def test_names_and_wildcards_match_what_they_say() -> None:
    name, wild = parse_entry("pypi.org"), parse_entry("*.example.com")
    assert name.matches_name("pypi.org")
    assert not name.matches_name("files.pypi.org")
    assert wild.matches_name("a.example.com")
    assert wild.matches_name("a.b.example.com")
    assert not wild.matches_name("example.com"), "a wildcard is below its domain, not it"
    assert not wild.matches_name("badexample.com")


def test_a_spec_takes_an_egress_list_and_refuses_a_bad_one() -> None:
    spec = SandboxSpec.model_validate(
        {"user": "u", "project": "p", "network": {"egress": {"allow": ["PyPI.org", "pypi.org"]}}}
    )
    assert not isinstance(spec.network, str)
    assert spec.network.egress.allow == ("pypi.org",), "normalised, repeats dropped"
    bad: object
    for bad in ({"egress": {"allow": []}}, {"egress": {"allow": ["*"]}}, {"egress": {}}):
        with pytest.raises(ValidationError):
            SandboxSpec.model_validate({"user": "u", "project": "p", "network": bad})
    too_many = [f"h{n}.example.org" for n in range(65)]
    with pytest.raises(ValidationError):
        SandboxSpec.model_validate(
            {"user": "u", "project": "p", "network": {"egress": {"allow": too_many}}}
        )


# --- the operator's rules -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "entry", "allowed"),
    [
        ("*", "anything.org:22", True),
        ("pypi.org", "pypi.org", True),
        ("pypi.org", "files.pypi.org", False),
        ("*.org", "pypi.org", True),
        ("*.org", "*.pypi.org", True),
        ("*.pypi.org", "*.pypi.org", True),
        ("*.pypi.org", "pypi.org", False),
        ("*.org", "10.0.0.0/8", False),
        ("10.0.0.0/8", "10.20.0.0/16", True),
        ("10.0.0.0/8", "11.0.0.0/16", False),
        ("10.0.0.0/16", "10.0.0.0/8", False),
        ("10.0.0.0/8", "pypi.org", False),
        ("*.org:443", "pypi.org:443", True),
        ("*.org:443", "pypi.org", False),
        ("*.org:443", "pypi.org:80", False),
    ],
)
def test_a_pattern_permits_what_it_covers(pattern: str, entry: str, allowed: bool) -> None:
    assert permits(parse_entry(pattern).text if pattern != "*" else "*", parse_entry(entry)) is (
        allowed
    )


def test_rules_apply_by_user_and_project_and_none_means_no_egress() -> None:
    config = EgressConfig(
        rule=(
            EgressRule(users=frozenset({"alice"}), allow=("*.org",)),
            EgressRule(projects=frozenset({"infra"}), allow=("10.0.0.0/8",)),
        )
    )
    entries = parse_entries(("pypi.org", "10.1.0.0/16"))
    assert config.refused("alice", "web", entries) == ["10.1.0.0/16"]
    assert config.refused("alice", "infra", entries) == []
    assert config.refused("bob", "web", entries) == ["pypi.org", "10.1.0.0/16"]
    assert EgressConfig(rule=()).refused("alice", "web", entries) == ["pypi.org", "10.1.0.0/16"]


def test_the_config_reads_egress_and_refuses_a_public_subnet() -> None:
    config = parse_config(
        '[egress]\nsubnet = "10.99.0.0/24"\nupstream = ["10.77.0.53"]\n'
        '[[egress.rule]]\nusers = ["alice"]\nallow = ["*.example.org:443"]\n'
    )
    assert config.egress.gateway == IPv4Address("10.99.0.1")
    assert config.egress.upstream == (IPv4Address("10.77.0.53"),)
    assert config.egress.rule[0].allow == ("*.example.org:443",)
    assert parse_config("").egress.rule == (), "by default no one may ask"
    with pytest.raises(Exception, match="private IPv4"):
        parse_config('[egress]\nsubnet = "8.8.0.0/16"\n')


def test_rebinding_is_a_private_answer_no_allowed_network_names() -> None:
    entries = parse_entries(("pypi.org", "10.20.0.0/16"))
    for private in ("10.1.2.3", "127.0.0.1", "169.254.169.254", "192.168.1.1", "100.64.0.1"):
        assert rebinding(IPv4Address(private), entries), private
    assert not rebinding(IPv4Address("10.20.3.4"), entries), "the list names that range"
    assert not rebinding(IPv4Address("151.101.0.223"), entries)


def test_addresses_are_stable_per_id_and_skip_taken_ones() -> None:
    subnet = IPv4Network("10.213.0.0/29")  # 5 hosts past the gateway
    first = sandbox_address(subnet, "sbx-1", set())
    assert first == sandbox_address(subnet, "sbx-1", set())
    assert first in subnet
    assert first not in (subnet[0], subnet[1], subnet[-1])
    taken = {first}
    for _ in range(4):
        taken.add(sandbox_address(subnet, "sbx-1", taken))
    assert len(taken) == 5
    with pytest.raises(ValueError, match="full"):
        sandbox_address(subnet, "sbx-1", taken)


# --- the table ----------------------------------------------------------------------------


def firewall(api: FakeNftApi | None = None) -> tuple[Firewall, FakeNftApi]:
    api = api or FakeNftApi()
    wall = Firewall(api, BRIDGE, GATEWAY)
    wall.ensure_base()
    return wall, api


def test_the_base_is_made_once_and_renewed_without_losing_sandboxes() -> None:
    wall, api = firewall()
    wall.add_sandbox("sbx-1", IPv4Address("10.213.0.9"), Allowed())
    wall.ensure_base()  # a restarted agent
    table = api.table()
    assert {name: spec["hook"] for name, spec in table.base.items()} == {
        "forward": "forward",
        "input": "input",
    }
    assert all(spec["prio"] < 0 for spec in table.base.values()), "before Docker's filter"
    assert len(table.chains["forward"]) == 1
    assert len(table.chains["input"]) == 2
    assert len(table.chains["guard"]) == 2
    assert wall.sandbox_keys() == {"sbx_1"}
    assert wall.mapped() == {IPv4Address("10.213.0.9"): "sb_sbx_1"}


def test_a_sandbox_is_added_whole_and_removed_whole() -> None:
    wall, api = firewall()
    allowed = Allowed((IPv4Network("10.20.0.0/16"),), ((IPv4Network("192.0.2.7/32"), 443),))
    wall.add_sandbox("sbx-1", IPv4Address("10.213.0.9"), allowed)
    table = api.table()
    assert set(table.sets) == {"net_sbx_1", "netp_sbx_1", "dns_sbx_1", "dnsp_sbx_1"}
    assert len(table.elements["net_sbx_1"]) == len(table.elements["netp_sbx_1"]) == 1
    assert len(table.chains["sb_sbx_1"]) == 6, "established, 4 sets, the counted drop"
    wall.allow_resolved("sbx-1", [IPv4Address("151.101.0.223")], [], 90)
    wall.allow_resolved("sbx-1", [IPv4Address("151.101.0.223")], [], 300)  # renewed
    assert list(table.elements["dns_sbx_1"].values()) == [300]
    wall.allow_resolved("sbx-1", [IPv4Address("151.101.0.1")], [443, 80], 60)
    assert len(table.elements["dnsp_sbx_1"]) == 2
    wall.remove_sandbox("sbx-1")
    table = api.table()
    assert (table.sets, table.counters.keys() - {"stray", "host"}, table.maps["sandboxes"]) == (
        {},
        set(),
        {},
    )
    assert set(table.chains) == {"forward", "input", "guard"}
    wall.remove_sandbox("sbx-1")  # twice is fine: the reaper and a destroy may meet


def test_a_half_removed_sandbox_is_removed_the_rest_of_the_way() -> None:
    wall, api = firewall()
    wall.add_sandbox("sbx-1", IPv4Address("10.213.0.9"), Allowed())
    api.json_cmd(
        {"nftables": [{"delete": {"set": {"family": "inet", "table": "slicebox", "name": "x"}}}]}
    )
    api.table().sets.pop("dnsp_sbx_1")  # gone behind our back
    api.table().elements.pop("dnsp_sbx_1")
    wall.remove_sandbox("sbx-1")
    assert wall.sandbox_keys() == set()
    assert api.table().sets == {}


def test_counters_read_per_sandbox_and_none_when_gone() -> None:
    wall, api = firewall()
    wall.add_sandbox("sbx-1", IPv4Address("10.213.0.9"), Allowed())
    api.hit("deny_sbx_1", 3, 180)
    api.hit("ok_sbx_1", 5, 900)
    counts = wall.counts("sbx-1")
    assert counts is not None
    assert (counts.allowed_packets, counts.allowed_bytes) == (5, 900)
    assert (counts.denied_packets, counts.denied_bytes) == (3, 180)
    assert wall.counts("sbx-2") is None


def test_a_refused_batch_changes_nothing_and_says_so() -> None:
    wall, _api = firewall()
    wall.add_sandbox("sbx-1", IPv4Address("10.213.0.9"), Allowed())
    with pytest.raises(HostError) as raised:  # the address is sbx-1's already
        wall.add_sandbox("sbx-2", IPv4Address("10.213.0.9"), Allowed())
    assert raised.value.code == "egress_failed"
    assert wall.sandbox_keys() == {"sbx_1"}, "the whole transaction was undone"


# --- the guard and its resolver -----------------------------------------------------------


class Networks:
    def __init__(self) -> None:
        self.made: list[tuple[str, IPv4Network, IPv4Address, str]] = []

    def ensure_network(
        self, name: str, subnet: IPv4Network, gateway: IPv4Address, bridge: str
    ) -> None:
        self.made.append((name, subnet, gateway, bridge))

    def bridge_subnets(self) -> tuple[IPv4Network, ...]:
        return (IPv4Network("172.17.0.0/16"), IPv4Network("10.213.0.0/16"))


class Zone:
    """An upstream nameserver: name -> (type, ttl, value) records, asked queries counted."""

    def __init__(self, records: dict[str, list[tuple[int, int, str]]]) -> None:
        self.records = records
        self.asked: Counter[str] = Counter()

    async def ask(self, query: bytes, *, tcp: bool = False) -> bytes:
        parsed = dnswire.parse_query(query)
        name = parsed.question.name
        self.asked[name] += 1
        if name not in self.records:
            return dnswire.reply(parsed, dnswire.NXDOMAIN)
        answers = [(name, rtype, ttl, value) for rtype, ttl, value in self.records[name]]
        return dnswire.build_response(parsed, answers)


class Guarded:
    """A guard over a fake table; given another's ``api``, an agent restarted on its kernel."""

    def __init__(self, config: EgressConfig | None = None, api: FakeNftApi | None = None) -> None:
        self.api = api or FakeNftApi()
        self.networks = Networks()
        self.zone = Zone(
            {
                "pypi.org": [(dnswire.A, 120, "151.101.0.223"), (dnswire.AAAA, 120, "2a04::1")],
                "evil.example.org": [(dnswire.A, 30, "10.1.2.3")],
                "inside.example.org": [(dnswire.A, 30, "10.20.0.5")],
                "git.example.net": [(dnswire.A, 10, "151.101.64.9")],
            }
        )
        self.audited: list[AuditRecord] = []
        self.now = 100.0
        self.guard = EgressGuard(
            config or EgressConfig(),
            lambda gateway: Firewall(self.api, BRIDGE, gateway),
            self.networks,
            self.zone,
            self.audited.append,
            clock=lambda: self.now,
            addresses=lambda: HOST_ADDRESSES,
        )

    def ask(self, source: IPv4Address, name: str, qtype: int = dnswire.A) -> dnswire.Answer | int:
        query = dnswire.build_query(name, qtype, 77)
        raw = asyncio.run(self.guard.answer(query, str(source)))
        assert raw is not None
        answer = dnswire.parse_response(raw, dnswire.parse_query(query))
        return answer if answer.rcode == dnswire.NOERROR else answer.rcode


ALLOW = ("pypi.org", "*.example.org", "10.20.0.0/16", "git.example.net:443")


def test_a_placed_sandbox_gets_its_address_rules_and_network() -> None:
    world = Guarded()
    placed = world.guard.place("sbx-1", "alice", "web", ALLOW)
    assert world.networks.made == [(NETWORK, IPv4Network("10.213.0.0/16"), GATEWAY, BRIDGE)]
    assert placed.dns == GATEWAY
    assert placed.network == NETWORK
    assert placed.address in IPv4Network("10.213.0.0/16")
    assert placed.allow == ",".join(ALLOW)
    table = world.api.table()
    assert table.maps["sandboxes"] == {str(placed.address): {"jump": {"target": "sb_sbx_1"}}}
    assert len(table.elements["net_sbx_1"]) == 1


def test_the_resolver_answers_allowed_names_and_opens_their_addresses_first() -> None:
    world = Guarded()
    placed = world.guard.place("sbx-1", "alice", "web", ALLOW)
    answer = world.ask(placed.address, "pypi.org")
    assert isinstance(answer, dnswire.Answer)
    assert [str(a) for a, _ in answer.addresses] == ["151.101.0.223", "2a04::1"]
    dns = world.api.table().elements["dns_sbx_1"]
    assert dns == {repr("151.101.0.223"): 150}, "the TTL and a grace; only IPv4"
    world.ask(placed.address, "git.example.net")
    assert world.api.table().elements["dnsp_sbx_1"] == {
        repr({"concat": ["151.101.64.9", 443]}): 60
    }, "a port-limited name opens its port only, for at least a minute"


def test_the_resolver_refuses_what_is_not_allowed_and_counts_it() -> None:
    world = Guarded()
    placed = world.guard.place("sbx-1", "alice", "web", ALLOW)
    assert world.ask(placed.address, "github.com") == dnswire.NXDOMAIN
    assert world.ask(placed.address, "github.com") == dnswire.NXDOMAIN
    assert world.ask(placed.address, "example.org") == dnswire.NXDOMAIN, "not the apex"
    assert world.zone.asked["github.com"] == 0, "never asked upstream"
    assert world.ask(placed.address, "evil.example.org") == dnswire.REFUSED, "rebinding"
    inside = world.ask(placed.address, "inside.example.org")
    assert isinstance(inside, dnswire.Answer), "a private answer the list's network covers"
    assert world.ask(IPv4Address("10.213.9.9"), "pypi.org") == dnswire.REFUSED, "no sandbox"
    assert world.guard.denied("sbx-1") == {
        "github.com": 2,
        "example.org": 1,
        "evil.example.org": 1,
    }
    assert world.api.table().elements["dns_sbx_1"] == {repr("10.20.0.5"): 60}
    counters = world.guard.counters("sbx-1")
    assert counters is not None
    assert counters.denied_names == 4


def test_garbage_gets_no_answer_and_a_dead_upstream_servfail() -> None:
    world = Guarded()
    placed = world.guard.place("sbx-1", "alice", "web", ALLOW)
    assert asyncio.run(world.guard.answer(b"\x00\x01junk", str(placed.address))) is None

    async def dead(query: bytes, *, tcp: bool = False) -> bytes:
        raise TimeoutError

    world.zone.ask = dead  # type: ignore[method-assign]
    assert world.ask(placed.address, "pypi.org") == dnswire.SERVFAIL


def test_release_removes_everything_and_audits_one_summary() -> None:
    world = Guarded()
    placed = world.guard.place("sbx-1", "alice", "web", ALLOW)
    world.ask(placed.address, "github.com")
    world.api.hit("deny_sbx_1", 4, 240)
    world.guard.release("sbx-1")
    world.guard.release("sbx-1")  # a second destroy's
    assert [r.event for r in world.audited] == [AuditEvent.EGRESS_SUMMARY]
    summary = world.audited[0]
    assert (summary.sandbox_id, summary.user, summary.project) == ("sbx-1", "alice", "web")
    assert summary.detail is not None
    assert "github.com (1)" in summary.detail
    assert "denied 4" in summary.detail
    assert world.api.table().chains.keys() == {"forward", "input", "guard"}
    assert world.ask(placed.address, "pypi.org") == dnswire.REFUSED


def test_many_places_at_once_get_distinct_addresses() -> None:
    world = Guarded(EgressConfig(subnet=IPv4Network("10.213.0.0/24")))
    placed: list[IPv4Address] = []
    lock = threading.Lock()

    def place(n: int) -> None:
        address = world.guard.place(f"sbx-{n}", "alice", "web", ("pypi.org",)).address
        with lock:
            placed.append(address)

    threads = [threading.Thread(target=place, args=(n,)) for n in range(60)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(placed)) == 60
    assert len(world.api.table().maps["sandboxes"]) == 60


def test_sync_adopts_after_a_restart_releases_the_gone_and_collects_the_stale() -> None:
    world = Guarded()
    before = world.guard.place("sbx-1", "alice", "web", ALLOW)
    world.guard.place("sbx-2", "alice", "web", ALLOW)
    after = Guarded(api=world.api)  # same kernel table, nothing in memory
    # sbx-2's container went while the agent was down; sbx-3's rules were lost.
    found = [
        Labelled("sbx-1", "alice", "web", str(before.address), ",".join(ALLOW)),
        Labelled("sbx-3", "bob", "api", "10.213.7.7", "pypi.org"),
    ]
    after.guard.sync(found, observed_at=after.now, busy=frozenset())
    assert after.api.table().chains.keys() - {"forward", "input", "guard"} == {
        "sb_sbx_1",
        "sb_sbx_3",
    }
    assert isinstance(after.ask(before.address, "pypi.org"), dnswire.Answer), "served again"
    assert isinstance(after.ask(IPv4Address("10.213.7.7"), "pypi.org"), dnswire.Answer)
    # sbx-1 is destroyed behind its back (an expiry while it was down): the next pass.
    after.now = 200.0
    after.guard.sync(found[1:], observed_at=after.now, busy=frozenset())
    assert key_of("sbx-1") not in after.guard.firewall().sandbox_keys()
    assert [r.sandbox_id for r in after.audited] == ["sbx-1"]


def test_sync_spares_what_was_placed_after_the_listing_or_is_busy() -> None:
    world = Guarded()
    world.now = 50.0
    world.guard.place("sbx-new", "alice", "web", ALLOW)  # listed before it existed
    world.guard.place("sbx-busy", "alice", "web", ALLOW)
    world.guard.sync([], observed_at=40.0, busy=frozenset())
    world.guard.sync([], observed_at=60.0, busy=frozenset({"sbx-new", "sbx-busy"}))
    assert world.guard.firewall().sandbox_keys() == {"sbx_new", "sbx_busy"}
    assert world.audited == []


def test_an_agent_that_never_saw_egress_makes_no_table() -> None:
    world = Guarded()
    world.guard.sync([], observed_at=1.0, busy=frozenset())
    assert world.api.tables == {}
    assert world.networks.made == []


def test_rules_left_from_before_a_restart_go_when_no_sandbox_has_egress() -> None:
    world = Guarded()
    world.guard.place("sbx-1", "alice", "web", ALLOW)
    after = Guarded(api=world.api)
    after.guard.sync([], observed_at=1.0, busy=frozenset())
    assert Firewall(world.api, BRIDGE, GATEWAY).sandbox_keys() == set()
    assert after.networks.made == [], "no network made for it"


def test_the_operators_internal_networks_may_be_answered() -> None:
    entries = parse_entries(("mirror.corp",))
    internal = (IPv4Network("10.77.1.0/24"),)
    assert not rebinding(IPv4Address("10.77.1.10"), entries, internal)
    assert rebinding(IPv4Address("10.77.9.9"), entries, internal)


# --- through the sandbox manager's create and destroy --------------------------------------


GRANTED = "[[egress.rule]]\n"  # anyone may ask for anything: egress is closed by default


class Managed:
    def __init__(self, config: str = GRANTED) -> None:
        self.egress = Guarded()
        self.systemd = FakeSystemd()
        self.docker = FakeDocker(self.systemd)
        self.manager = SandboxManager(
            self.docker,
            SliceManager(self.systemd),
            config=parse_config(config),
            host_memory=4096 * 1024 * 1024,
            instance_id="run-1",
            egress=self.egress.guard,
        )

    def spec(self, allow: list[str], user: str = "alice") -> SandboxSpec:
        return SandboxSpec.model_validate(
            {"user": user, "project": "web", "network": {"egress": {"allow": allow}}}
        )


def test_a_create_with_egress_is_placed_labelled_and_its_destroy_releases_it() -> None:
    world = Managed()
    box = created(world.manager, world.spec(["pypi.org", "10.20.0.0/16"]))
    request = world.docker.requests[box.container_id]
    assert request.network == NETWORK
    assert request.dns == (str(GATEWAY),)
    assert request.address is not None
    assert IPv4Address(request.address) in IPv4Network("10.213.0.0/16")
    assert box.lineage.egress == "pypi.org,10.20.0.0/16"
    assert view_of(box).egress == ("pypi.org", "10.20.0.0/16")
    assert box.lineage.egress_address == request.address
    assert world.egress.api.table().maps["sandboxes"] == {
        request.address: {"jump": {"target": f"sb_{key_of(box.id)}"}}
    }
    plain = created(world.manager, SandboxSpec.model_validate({"user": "alice", "project": "web"}))
    assert world.docker.requests[plain.container_id].address is None, "no egress, no place"
    world.manager.destroy(box.id)
    assert world.egress.api.table().maps["sandboxes"] == {}
    assert [r.event for r in world.egress.audited] == [AuditEvent.EGRESS_SUMMARY]


def test_a_create_that_fails_to_start_leaves_no_rule() -> None:
    world = Managed()
    world.docker.fail_start = True
    with pytest.raises(Exception, match="cannot start"):
        created(world.manager, world.spec(["pypi.org"]))
    assert world.egress.api.table().maps["sandboxes"] == {}
    assert world.egress.guard.firewall().sandbox_keys() == set()


def test_policy_refuses_what_no_rule_allows_before_anything_is_made() -> None:
    world = Managed('[[egress.rule]]\nusers = ["alice"]\nallow = ["*.org"]\n')
    with pytest.raises(PolicyViolation) as refused:
        created(world.manager, world.spec(["pypi.org", "10.0.0.0/8"]))
    assert refused.value.code == "policy_egress"
    assert "10.0.0.0/8" in refused.value.message
    with pytest.raises(PolicyViolation, match="not allowed for user 'bob'"):
        created(world.manager, world.spec(["pypi.org"], user="bob"))
    assert world.docker.containers == {}
    assert world.egress.api.tables == {}, "nothing made"


def test_an_agent_without_egress_refuses_it_clearly() -> None:
    systemd = FakeSystemd()
    docker = FakeDocker(systemd)
    manager = SandboxManager(
        docker,
        SliceManager(systemd),
        config=parse_config(GRANTED),
        host_memory=2**32,
        instance_id="r",
    )
    with pytest.raises(Unavailable) as refused:
        created(manager, Managed().spec(["pypi.org"]))
    assert refused.value.code == "egress_unavailable"
    assert docker.containers == {}


def test_the_level_tree_carries_a_sandbox_nodes_egress_counters() -> None:
    scope = "docker-abc.scope"
    sandbox = LevelNode(level=Level.SANDBOX, unit=scope, cgroup=f"s/u/p/{scope}")
    other = LevelNode(level=Level.SANDBOX, unit="docker-def.scope", cgroup="s/u/p/docker-def")
    project = LevelNode(level=Level.PROJECT, unit="p", cgroup="s/u/p", children=(sandbox, other))
    tree = LevelNode(level=Level.MANAGED, unit="s", cgroup="s", children=(project,))
    counters = EgressCounters(
        allowed_packets=1, allowed_bytes=2, denied_packets=3, denied_bytes=4, denied_names=5
    )
    marked = tree.with_egress({scope: counters})
    assert [node.egress for node in marked.walk()] == [None, None, counters, None]
    assert tree.with_egress({}) is tree


def test_a_repeated_answer_adds_no_element_until_half_its_timeout_is_gone() -> None:
    world = Guarded()
    placed = world.guard.place("sbx-1", "alice", "web", ALLOW)
    world.ask(placed.address, "pypi.org")
    batches = len(world.api.batches)
    world.now += 60  # the element (150 s) has more than half its time left
    world.ask(placed.address, "pypi.org")
    assert len(world.api.batches) == batches, "no nftables call"
    world.now += 20  # now less than half
    world.ask(placed.address, "pypi.org")
    assert len(world.api.batches) == batches + 1, "renewed"


def test_an_answer_whose_addresses_cannot_be_opened_is_servfail() -> None:
    world = Guarded()
    placed = world.guard.place("sbx-1", "alice", "web", ALLOW)
    world.api.table().sets.pop("dns_sbx_1")  # the kernel refuses the element
    assert world.ask(placed.address, "pypi.org") == dnswire.SERVFAIL
    world.api.table().sets["dns_sbx_1"] = {}
    world.api.table().elements["dns_sbx_1"] = {}
    answer = world.ask(placed.address, "pypi.org")
    assert isinstance(answer, dnswire.Answer), "tried again, not taken as open"
    assert world.api.table().elements["dns_sbx_1"] == {repr("151.101.0.223"): 150}
