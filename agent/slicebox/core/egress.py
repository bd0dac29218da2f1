"""Egress by allow-list (issue 18): the sandbox's place on the egress network, its rules and
its resolver.

A sandbox that asks for egress joins one Docker bridge network of slicebox's, at a fixed
address derived from its id, with the agent's resolver (on the bridge's own address) as its
only DNS server. Before its container is made, its nftables objects exist and its address is
mapped to them (``host.nft``): from its first packet it reaches what its entries allow and
nothing else. Its names are answered here: an allowed name is asked upstream, its addresses
go into the sandbox's sets for the answer's TTL before the answer is sent; any other name is
NXDOMAIN, counted per sandbox, and summed up in one audit record when the sandbox goes.

Nothing is stored: the entries and the address are the container's labels, the rules are the
kernel's. A restarted agent maps the addresses it finds labelled back to their sandboxes and
adds the rules of one whose rules are missing; rules no sandbox has are collected.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from ipaddress import IPv4Address, IPv4Network
from typing import NamedTuple, Protocol

from slicebox.core.dnsbounds import Bucket, DeniedTally, SandboxDns
from slicebox.core.egresstally import EgressTally, Project, Released
from slicebox.core.policy import check_reachable
from slicebox.core.recent import Recent
from slicebox.host.addresses import host_addresses
from slicebox.host.nft import Allowed, Counts, Firewall, key_of
from slicebox.model.audit import AuditEvent, AuditRecord
from slicebox.model.dnswire import (
    IN,
    NXDOMAIN,
    REFUSED,
    SERVFAIL,
    DnsFormatError,
    Query,
    parse_query,
    parse_response,
    reply,
)
from slicebox.model.egress import (
    AllowEntry,
    EgressConfig,
    NetworkSpec,
    parse_entries,
    rebinding,
    sandbox_address,
)
from slicebox.model.errors import SliceboxError
from slicebox.model.usage import EgressCounters

log = logging.getLogger(__name__)

NETWORK = "slicebox-egress"  # the Docker network
BRIDGE = "sbx-egress"  # its bridge device, which the rules match
MIN_TTL = 60  # an answer's addresses stay allowed at least this long (seconds)
MAX_TTL = 86400
TTL_GRACE = 30  # past the answer's TTL: a client may connect just as its cache expires
DENIED_NAMES_KEPT = 20  # distinct denied names a summary lists
RELEASED_KEPT = 1024
RESERVED_FOR = 10.0  # seconds the host's addresses and Docker's subnets are taken as known


class Networks(Protocol):
    """Docker's side: the bridge network the sandboxes join."""

    def ensure_network(
        self, name: str, subnet: IPv4Network, gateway: IPv4Address, bridge: str
    ) -> None: ...

    def bridge_subnets(self) -> tuple[IPv4Network, ...]: ...


class Upstream(Protocol):
    async def ask(self, query: bytes, *, tcp: bool = False) -> bytes: ...


class Placement(NamedTuple):
    """Where a sandbox with egress sits: what its create request and labels carry."""

    network: str
    address: IPv4Address
    dns: IPv4Address
    allow: str  # its entries, comma-separated (the ``slicebox.egress`` label)


class Guarded(NamedTuple):
    sandbox_id: str
    user: str
    project: str
    address: IPv4Address
    entries: tuple[AllowEntry, ...]
    placed_at: float  # monotonic; 0 for one adopted from its labels


class Labelled(NamedTuple):
    """An egress sandbox as its labels tell it."""

    sandbox_id: str
    user: str
    project: str
    address: str
    allow: str


class EgressGuard:
    def __init__(
        self,
        config: EgressConfig,
        firewall: Callable[[IPv4Address], Firewall],
        networks: Networks,
        upstream: Upstream,
        audit: Callable[[AuditRecord], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        addresses: Callable[[], tuple[IPv4Network, ...]] = host_addresses,
    ) -> None:
        self._clock = clock
        self._addresses = addresses
        self._found: tuple[float, tuple[IPv4Network, ...]] | None = None
        # Released lately: a listing taken before a release must not bring one back.
        self._released: Recent[str, None] = Recent(RELEASED_KEPT)
        self._config = config
        self._make_firewall = firewall
        self._firewall: Firewall | None = None
        self._networks = networks
        self._upstream = upstream
        self._audit = audit
        self._lock = threading.Lock()
        self._by_address: dict[IPv4Address, Guarded] = {}
        self._by_id: dict[str, Guarded] = {}
        # Per sandbox, bounded (core.dnsbounds): its query rate, names denied, answers opened.
        self._dns: dict[str, SandboxDns] = {}
        self._tcp: dict[IPv4Address, int] = {}  # resolver TCP connections open, per source
        self._gone = Released()  # released sandboxes' last counters, by project (``totals``)

    @property
    def config(self) -> EgressConfig:
        return self._config

    def firewall(self) -> Firewall:
        """The table and the network, made at the first need (an agent that never sees an
        egress request touches neither)."""
        with self._lock:
            if self._firewall is None:
                gateway = self._config.gateway
                self._networks.ensure_network(NETWORK, self._config.subnet, gateway, BRIDGE)
                firewall = self._make_firewall(gateway)
                firewall.ensure_base()
                self._firewall = firewall
            return self._firewall

    # --- a sandbox's life ----------------------------------------------------------------

    def place(self, sandbox_id: str, user: str, project: str, allow: tuple[str, ...]) -> Placement:
        """Its address and rules, before its container exists; ``release`` undoes it."""
        entries = parse_entries(allow)
        check_reachable(entries, self._config, *self.found())
        firewall = self.firewall()
        with self._lock:
            address = sandbox_address(self._config.subnet, sandbox_id, set(self._by_address))
            guarded = Guarded(sandbox_id, user, project, address, entries, self._clock())
            self._register(guarded)
        try:
            firewall.add_sandbox(sandbox_id, address, _allowed(entries))
        except BaseException:
            self._unregister(sandbox_id)
            raise
        text = ",".join(entry.text for entry in entries)
        return Placement(NETWORK, address, self._config.gateway, text)

    def release(self, sandbox_id: str) -> None:
        """Its rules and resolver state go; what it was denied is audited once."""
        state = self._dns.get(sandbox_id)
        denied = state.denied if state is not None else DeniedTally()
        guarded = self._unregister(sandbox_id)
        self._released.put(sandbox_id, None)
        firewall = self._firewall
        counts = firewall.counts(sandbox_id) if firewall else None
        if firewall is not None:
            firewall.remove_sandbox(sandbox_id, guarded.address if guarded else None)
        if guarded is not None:
            self._gone.add((guarded.user, guarded.project), counts, denied.total)
            self._audit(_summary(guarded, denied, counts))

    def guarding(self) -> bool:
        """Whether any sandbox with egress is known here."""
        return bool(self._by_id)

    def counters(self, sandbox_id: str) -> EgressCounters | None:
        """Its packets let through and dropped, and the names refused; None when this agent
        guards no such sandbox."""
        firewall = self._firewall
        counts = firewall.counts(sandbox_id) if firewall and sandbox_id in self._by_id else None
        if counts is None:
            return None
        state = self._dns.get(sandbox_id)
        return EgressCounters(
            allowed_packets=counts.allowed_packets,
            allowed_bytes=counts.allowed_bytes,
            denied_packets=counts.denied_packets,
            denied_bytes=counts.denied_bytes,
            denied_names=state.denied.total if state else 0,
            dropped_queries=state.dropped if state else 0,
            refused_connections=state.refused if state else 0,
        )

    def totals(self) -> dict[Project, EgressTally]:
        """Packets, bytes and refused names by project, the sandboxes guarded now and those
        released since the agent started together: one listing of the table's counters."""
        found = self._gone.sums()
        firewall = self._firewall
        if firewall is None or not self._by_id:
            return found
        every = firewall.all_counts()
        for guarded in list(self._by_id.values()):
            sandbox_id = guarded.sandbox_id
            # Two calls a sandbox only where libnftables cannot list the table's counters.
            counts = (
                every.get(key_of(sandbox_id)) if every is not None else firewall.counts(sandbox_id)
            )
            state = self._dns.get(sandbox_id)
            project = (guarded.user, guarded.project)
            tally = found.get(project, EgressTally())
            found[project] = tally.plus(counts, state.denied.total if state else 0)
        return found

    def sync(self, found: Iterable[Labelled], observed_at: float, busy: frozenset[str]) -> None:
        """Bring the rules and the resolver's map in line with what Docker listed at
        ``observed_at`` (monotonic): a labelled sandbox unknown here (after a restart) is
        mapped again and its rules added where they are missing; one placed before the
        listing that it no longer shows is released; rules of no sandbox placed here go."""
        found = [each for each in found if each.sandbox_id not in busy]
        if not found and self._firewall is None:
            self._collect_leftovers()  # no egress sandbox here: no table, no network made
            return
        firewall = self.firewall()
        present = firewall.sandbox_keys()
        for each in found:
            if each.sandbox_id not in self._by_id and each.sandbox_id not in self._released:
                self._adopt(firewall, each, present)
        listed = {each.sandbox_id for each in found}
        for guarded in list(self._by_id.values()):
            gone = guarded.sandbox_id not in listed and guarded.sandbox_id not in busy
            if gone and guarded.placed_at < observed_at:
                log.info("egress of %s released: its container is gone", guarded.sandbox_id)
                self.release(guarded.sandbox_id)
        keep = {key_of(sandbox_id) for sandbox_id in list(self._by_id)}
        for key in sorted(present - keep):
            log.info("egress rules %s belong to no sandbox; removed", key)
            firewall.remove_sandbox(key)

    def _collect_leftovers(self) -> None:
        """Rules a table kept from before a restart, when no sandbox with egress is left."""
        try:
            firewall = self._make_firewall(self._config.gateway)
        except SliceboxError:  # no nftables binding: there can be no rules either
            return
        for key in sorted(firewall.sandbox_keys()):
            log.info("egress rules %s belong to no sandbox; removed", key)
            firewall.remove_sandbox(key)

    def _adopt(self, firewall: Firewall, each: Labelled, present: set[str]) -> None:
        entries = parse_entries(tuple(a for a in each.allow.split(",") if a))
        address = IPv4Address(each.address)
        guarded = Guarded(each.sandbox_id, each.user, each.project, address, entries, 0.0)
        with self._lock:
            self._register(guarded)
        if key_of(each.sandbox_id) not in present:
            log.warning("egress rules of %s were missing; added again", each.sandbox_id)
            firewall.add_sandbox(each.sandbox_id, address, _allowed(entries))

    def check_hosts(self, network: NetworkSpec) -> None:
        """A wasm plugin's allowed hosts (its runtime's own filter, no rule of ours) as an
        egress sandbox's list: none may be an address of the host's or in Docker's subnets."""
        check_reachable(network.egress.entries(), self._config, *self.found())

    # --- the resolver -------------------------------------------------------------------

    def found(self) -> tuple[IPv4Network, ...]:
        """The host's own addresses and Docker's bridge subnets, read again every
        ``RESERVED_FOR`` seconds: no entry or answer may reach them."""
        now = self._clock()
        if self._found is None or now - self._found[0] > RESERVED_FOR:
            subnets = self._networks.bridge_subnets()
            self._found = (now, (*self._addresses(), *subnets))
        return self._found[1]

    async def _reserved(self) -> tuple[IPv4Network, ...]:
        """What no answer may point at; read again off the loop when it is due."""
        known = self._found
        if known is not None and self._clock() - known[0] <= RESERVED_FOR:
            return self._config.reserved(*known[1])
        try:
            found = await asyncio.to_thread(self.found)
        except SliceboxError as exc:  # Docker not answering: its subnets as last known
            log.info("resolver: Docker's subnets unknown: %s", exc.message)
            found = known[1] if known else self._addresses()
        return self._config.reserved(*found)

    def connected(self, source: str) -> bool:
        """Whether a resolver TCP connection from ``source`` may stay: at most
        ``resolver_tcp_per_sandbox`` from one address and ``resolver_tcp`` in all (the config's
        ``[egress]``); the refused is counted."""
        address = _address(source)
        if address is None:
            return False
        per_sandbox, total = self._config.resolver_tcp_per_sandbox, self._config.resolver_tcp
        if self._tcp.get(address, 0) >= per_sandbox or sum(self._tcp.values()) >= total:
            guarded = self._by_address.get(address)
            state = self._dns.get(guarded.sandbox_id) if guarded else None
            if state is not None:
                state.refused += 1
            return False
        self._tcp[address] = self._tcp.get(address, 0) + 1
        return True

    def disconnected(self, source: str) -> None:
        address = _address(source)
        if address is not None and address in self._tcp:
            self._tcp[address] -= 1
            if not self._tcp[address]:
                del self._tcp[address]

    def admitted(self, source: str) -> bool:
        """Whether a query from ``source`` is within its sandbox's rate; one past it is
        dropped unanswered (the client retries, as for a lost datagram) and counted."""
        address = _address(source)
        guarded = self._by_address.get(address) if address else None
        state = self._dns.get(guarded.sandbox_id) if guarded else None
        if state is None or state.bucket.take():
            return True
        state.dropped += 1
        return False

    async def answer(self, data: bytes, source: str, tcp: bool = False) -> bytes | None:
        """The reply to one query from ``source``; None for what is no DNS query at all."""
        address = _address(source)
        guarded = self._by_address.get(address) if address else None
        try:
            query = parse_query(data)
        except DnsFormatError:
            return None
        if guarded is None:
            return reply(query, REFUSED)
        name = query.question.name
        matching = [entry for entry in guarded.entries if entry.matches_name(name)]
        if not matching or query.question.qclass != IN:
            self._deny(guarded, name)
            return reply(query, NXDOMAIN)
        try:
            return await self._forward(query, guarded, matching, tcp=tcp)
        except (OSError, TimeoutError, DnsFormatError, SliceboxError) as exc:
            log.info("resolver: %s for %s failed: %s", name, guarded.sandbox_id, exc)
            return reply(query, SERVFAIL)

    async def _forward(
        self, query: Query, guarded: Guarded, matching: list[AllowEntry], *, tcp: bool
    ) -> bytes:
        """The upstream's answer (asked the way the client asked), once its addresses are open
        to the sandbox."""
        raw = await self._upstream.ask(query.raw, tcp=tcp)
        answer = parse_response(raw, query)
        internal, reserved = self._config.internal_networks, await self._reserved()
        if any(rebinding(a, guarded.entries, internal, reserved) for a, _ in answer.addresses):
            self._deny(guarded, query.question.name)
            log.info("resolver: a private answer for %s refused", guarded.sandbox_id)
            return reply(query, REFUSED)
        v4 = [(a, ttl) for a, ttl in answer.addresses if isinstance(a, IPv4Address)]
        if not v4:
            return raw
        ttl = min(MAX_TTL, max(MIN_TTL, min(ttl for _, ttl in v4) + TTL_GRACE))
        ports = _ports(matching)
        stale = self._stale(guarded.sandbox_id, [a for a, _ in v4], ports, ttl)
        try:
            if stale:
                await asyncio.to_thread(self._allow, guarded.sandbox_id, stale, ports, ttl)
        except SliceboxError:  # not opened: none may be taken for open
            if (state := self._dns.get(guarded.sandbox_id)) is not None:
                state.opened.clear()
            raise
        return raw

    def _stale(
        self, sandbox_id: str, addresses: list[IPv4Address], ports: list[int], ttl: int
    ) -> list[IPv4Address]:
        """The addresses whose elements need (re)adding: a repeated answer within the first
        half of its elements' timeout costs no nftables call (libnftables reads the table's
        sets for each, and a busy sandbox looks the same name up again and again)."""
        now = self._clock()
        state = self._dns.get(sandbox_id)
        if state is None:  # released meanwhile: its rules are gone, nothing to open
            return []
        opened = state.opened
        stale = [a for a in addresses if opened.get((a, tuple(ports))) < now + ttl / 2]
        for address in stale:
            opened.put((address, tuple(ports)), now + ttl, now)
        return stale

    def _allow(
        self, sandbox_id: str, addresses: list[IPv4Address], ports: list[int], ttl: int
    ) -> None:
        if self._firewall is not None:
            self._firewall.allow_resolved(sandbox_id, addresses, ports, ttl)

    def _deny(self, guarded: Guarded, name: str) -> None:
        if (state := self._dns.get(guarded.sandbox_id)) is not None:
            state.denied.add(name)

    def denied(self, sandbox_id: str) -> dict[str, int]:
        state = self._dns.get(sandbox_id)
        return dict(state.denied.most_common()) if state else {}

    def _register(self, guarded: Guarded) -> None:
        self._by_address[guarded.address] = guarded
        self._by_id[guarded.sandbox_id] = guarded
        config = self._config
        bucket = Bucket(self._clock, config.resolver_queries_per_second, config.resolver_burst)
        self._dns.setdefault(guarded.sandbox_id, SandboxDns(bucket))

    def _unregister(self, sandbox_id: str) -> Guarded | None:
        with self._lock:
            guarded = self._by_id.pop(sandbox_id, None)
            self._dns.pop(sandbox_id, None)
            if guarded is not None:
                self._by_address.pop(guarded.address, None)
            return guarded


def _allowed(entries: tuple[AllowEntry, ...]) -> Allowed:
    networks = tuple(e.network for e in entries if e.network is not None and e.port is None)
    with_port = tuple(
        (e.network, e.port) for e in entries if e.network is not None and e.port is not None
    )
    return Allowed(networks, with_port)


def _ports(matching: list[AllowEntry]) -> list[int]:
    """The ports an answer's addresses are opened for; empty: every port."""
    if any(entry.port is None for entry in matching):
        return []
    return sorted({entry.port for entry in matching if entry.port is not None})


def _address(source: str) -> IPv4Address | None:
    try:
        return IPv4Address(source)
    except ValueError:
        return None


def _summary(guarded: Guarded, denied: DeniedTally, counts: Counts | None) -> AuditRecord:
    names = ", ".join(f"{name} ({n})" for name, n in denied.most_common(DENIED_NAMES_KEPT))
    if denied.total:
        names = f"{denied.total} in all; {names}"
    packets = (
        ""
        if counts is None
        else (f"; packets allowed {counts.allowed_packets}, denied {counts.denied_packets}")
    )
    return AuditRecord(
        event=AuditEvent.EGRESS_SUMMARY,
        sandbox_id=guarded.sandbox_id,
        user=guarded.user,
        project=guarded.project,
        detail=f"denied names: {names or 'none'}{packets}"[:500],
    )
