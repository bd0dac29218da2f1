"""Network egress by allow-list (issue 18): what a sandbox may reach, and who may ask for what.

A sandbox asks ``"network": {"egress": {"allow": [...]}}``. Each entry is one of

- a name, ``pypi.org``: the name itself (and what its answer's CNAME chain leads to);
- a wildcard, ``*.githubusercontent.com``: every name below it at any depth, not the apex;
- an IPv4 address or network, ``10.20.0.0/16``;

each with an optional port, ``example.org:443`` (TCP and UDP). Names are reached through the
agent's resolver, which answers only allowed names and puts their addresses into the sandbox's
nftables sets (``host.nft``, ``core.egress``); addresses and networks go there at create.

The operator's ``[[egress.rule]]`` tables say which users and projects may ask for which
entries: patterns written the same way, plus ``*`` for any entry. No rule (the default): no
egress for anyone.

Some space is never an entry nor an answer, whatever the rules say (``RESERVED``, the egress
subnet itself, and at run time the host's own addresses and Docker's bridge subnets): loopback,
link-local (metadata services), "this network", multicast and the rest of class E, so also
``0.0.0.0/0``, unless the operator names it in ``[egress] internal_networks``. The host itself is
out of reach at the packet level whatever is listed (``host.nft``): only the resolver answers.
"""

import hashlib
import re
from enum import StrEnum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, ip_network
from typing import NamedTuple, Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from slicebox.model.base import Model

MAX_ENTRIES = 64
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
# Answers pointing here are refused unless an allowed network covers them (DNS rebinding):
# private, loopback, link-local, shared (CGNAT), reserved, multicast and unspecified space.
_SHARED = ip_network("100.64.0.0/10")
# Never reached unless the operator names it internal: the host and the services that answer
# on every host (loopback, link-local metadata), and space that is no one's to ask for.
RESERVED: tuple[IPv4Network, ...] = tuple(
    IPv4Network(text)
    for text in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")
)


class EntryKind(StrEnum):
    NAME = "name"
    WILDCARD = "wildcard"
    NETWORK = "network"


class AllowEntry(NamedTuple):
    """One parsed entry; ``text`` is its normal form (lower case, a network in CIDR form)."""

    kind: EntryKind
    text: str
    name: str = ""  # a name, or what a wildcard's ``*.`` stands below
    network: IPv4Network | None = None
    port: int | None = None

    def matches_name(self, name: str) -> bool:
        if self.kind is EntryKind.NAME:
            return name == self.name
        return self.kind is EntryKind.WILDCARD and name.endswith("." + self.name)

    def covers(self, address: IPv4Address) -> bool:
        return self.network is not None and address in self.network


def parse_entry(text: str) -> AllowEntry:
    """An entry from its text; ValueError with a message that says what to write instead."""
    host, port = _split_port(text.strip().lower().rstrip("."))
    suffix = "" if port is None else f":{port}"
    if host in {"*", ""}:
        raise ValueError(f"{text!r}: name a host, a '*.domain' or a network (no bare '*')")
    if host[0].isdigit() and _looks_like_address(host):
        network = _network(text, host)
        return AllowEntry(EntryKind.NETWORK, f"{network}{suffix}", network=network, port=port)
    if host.startswith("*."):
        domain = _name(text, host[2:])
        return AllowEntry(EntryKind.WILDCARD, f"*.{domain}{suffix}", name=domain, port=port)
    name = _name(text, host)
    return AllowEntry(EntryKind.NAME, f"{name}{suffix}", name=name, port=port)


def _split_port(text: str) -> tuple[str, int | None]:
    if text.startswith("[") or text.count(":") > 1:
        raise ValueError(f"{text!r}: IPv6 is not supported; the egress network is IPv4 only")
    if ":" not in text:
        return text, None
    host, _, port = text.partition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: a port is a number from 1 to 65535")
    return host, int(port)


def _looks_like_address(host: str) -> bool:
    return all(part.isdigit() for part in host.split("/", maxsplit=1)[0].split("."))


def _network(text: str, host: str) -> IPv4Network:
    try:
        network = ip_network(host, strict=True)
    except ValueError as exc:
        raise ValueError(f"{text!r}: not an IPv4 address or network ({exc})") from exc
    if not isinstance(network, IPv4Network):  # pragma: no cover - ruled out by the parse
        raise ValueError(f"{text!r}: the egress network is IPv4 only")
    return network


def _name(text: str, name: str) -> str:
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(
            f"{text!r}: not a host name (labels of letters, digits, '-' and '_', up to 63 "
            "characters each; '*.' only as the first label)"
        )
    return name


def parse_entries(texts: tuple[str, ...]) -> tuple[AllowEntry, ...]:
    entries: dict[str, AllowEntry] = {}
    for text in texts:
        entry = parse_entry(text)
        entries.setdefault(entry.text, entry)
    return tuple(entries.values())


class Egress(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    allow: tuple[str, ...] = Field(min_length=1, max_length=MAX_ENTRIES)

    @field_validator("allow")
    @classmethod
    def _entries(cls, allow: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(entry.text for entry in parse_entries(allow))

    def entries(self) -> tuple[AllowEntry, ...]:
        return parse_entries(self.allow)


class NetworkSpec(Model):
    """A network a sandbox asks for that is more than a mode's name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    egress: Egress


# --- the operator's side --------------------------------------------------------------------


class EgressRule(Model):
    """Users and projects (names, or ``*``) and the entries they may ask for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    users: frozenset[str] = Field(
        default=frozenset({"*"}), description='the users it applies to ("*": every user)'
    )
    projects: frozenset[str] = Field(
        default=frozenset({"*"}), description='the projects it applies to ("*": every project)'
    )
    allow: tuple[str, ...] = Field(
        default=("*",),
        description="what they may ask for: names, *.domain, IPv4 addresses or networks, each "
        'with an optional :port; "*": anything',
    )

    @field_validator("allow")
    @classmethod
    def _patterns(cls, allow: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(p if p.strip() == "*" else parse_entry(p).text for p in allow)

    def applies(self, user: str, project: str) -> bool:
        return bool({"*", user} & self.users) and bool({"*", project} & self.projects)


class EgressConfig(Model):
    """``[egress]``: the network egress sandboxes share, its resolver's upstream, the rules."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    subnet: IPv4Network = Field(
        default=IPv4Network("10.213.0.0/16"),
        description="slicebox's bridge network (private, /8 to /24); the resolver listens on "
        "its first address",
    )
    upstream: tuple[IPv4Address, ...] = Field(
        default=(),
        description="where the resolver asks; empty: the nameservers of the host's "
        "/etc/resolv.conf",
    )
    internal_networks: tuple[IPv4Network, ...] = Field(
        default=(),
        description="private networks an allowed name may resolve into (an internal mirror); "
        "any other private answer is refused as DNS rebinding",
    )
    rule: tuple[EgressRule, ...] = Field(
        default=(),
        description="who may ask for what, one [[egress.rule]] table each; none: no egress "
        "for anyone",
    )
    resolver_queries_per_second: float = Field(
        default=100.0,
        gt=0,
        le=10_000,
        description="queries one sandbox may ask the resolver a second; past them (and the "
        "burst) no answer",
    )
    resolver_burst: int = Field(
        default=300, ge=1, le=100_000, description="queries one sandbox may ask at once"
    )
    resolver_tcp_per_sandbox: int = Field(
        default=8, ge=1, le=256, description="resolver TCP connections one sandbox holds"
    )
    resolver_tcp: int = Field(
        default=64,
        ge=1,
        le=1024,
        description="resolver TCP connections of all sandboxes (at most 1024: far below the "
        "agent's descriptor limit)",
    )

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, subnet: IPv4Network) -> IPv4Network:
        if not subnet.is_private or not 8 <= subnet.prefixlen <= 24:
            raise ValueError("the egress subnet is a private IPv4 network from /8 to /24")
        return subnet

    @model_validator(mode="after")
    def _resolver_caps(self) -> Self:
        if self.resolver_tcp_per_sandbox > self.resolver_tcp:
            raise ValueError("resolver_tcp_per_sandbox is over resolver_tcp: raise resolver_tcp")
        return self

    @property
    def gateway(self) -> IPv4Address:
        """The bridge's address on the host: where the resolver listens."""
        return self.subnet.network_address + 1

    def reserved(self, *found: IPv4Network) -> tuple[IPv4Network, ...]:
        """Space no entry or answer may fall in: ``RESERVED``, the egress subnet, and what the
        host has (``found``: its own addresses, Docker's bridge subnets)."""
        return (*RESERVED, self.subnet, *found)

    def unreachable(self, entries: tuple[AllowEntry, ...], *found: IPv4Network) -> list[str]:
        """The entries that reach into reserved space and no internal network covers."""
        reserved = self.reserved(*found)
        return [
            e.text
            for e in entries
            if e.network is not None
            and any(e.network.overlaps(r) for r in reserved)
            and not any(e.network.subnet_of(n) for n in self.internal_networks)
        ]

    def refused(self, user: str, project: str, entries: tuple[AllowEntry, ...]) -> list[str]:
        """The entries no rule for ``user``/``project`` permits (empty: all permitted)."""
        patterns = [p for rule in self.rule if rule.applies(user, project) for p in rule.allow]
        return [e.text for e in entries if not any(permits(p, e) for p in patterns)]


def permits(pattern: str, entry: AllowEntry) -> bool:
    """Whether an operator's pattern covers a requested entry (a port, if any, must match)."""
    if pattern == "*":
        return True
    allowed = parse_entry(pattern)
    if allowed.port is not None and allowed.port != entry.port:
        return False
    if allowed.network is not None:
        return entry.network is not None and entry.network.subnet_of(allowed.network)
    if allowed.kind is EntryKind.NAME:
        return entry.kind is EntryKind.NAME and entry.name == allowed.name
    if entry.kind is EntryKind.NETWORK:
        return False
    same = entry.kind is EntryKind.WILDCARD and entry.name == allowed.name
    return same or entry.name.endswith("." + allowed.name)


def rebinding(
    address: IPv4Address | IPv6Address,
    entries: tuple[AllowEntry, ...],
    internal: tuple[IPv4Network, ...] = (),
    reserved: tuple[IPv4Network, ...] = RESERVED,
) -> bool:
    """An answer's address in reserved space, or in private-like space that neither an
    allowed network nor one of the operator's internal networks covers: refused."""
    if not isinstance(address, IPv4Address):
        mapped = address.ipv4_mapped or address.sixtofour
        if mapped is not None:
            return rebinding(mapped, entries, internal, reserved)
        return (
            address.is_private
            or address.is_loopback
            or address.is_link_local
            or address.is_site_local
            or address.is_multicast
            or address.is_unspecified
        )
    if any(address in n for n in internal):
        return False
    if any(address in r for r in reserved):
        return True
    special = (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_reserved
        or address.is_multicast
        or address.is_unspecified
        or address in _SHARED
    )
    covered = any(e.covers(address) for e in entries) or any(address in n for n in internal)
    return special and not covered


def sandbox_address(subnet: IPv4Network, sandbox_id: str, taken: set[IPv4Address]) -> IPv4Address:
    """The sandbox's fixed address on the egress network: a hash of its id into the subnet's
    hosts (past the gateway), the next free one when that is taken."""
    hosts = subnet.num_addresses - 3  # less the network, the gateway and the broadcast
    if len(taken) >= hosts:
        raise ValueError(f"the egress subnet {subnet} is full")
    start = int.from_bytes(hashlib.sha256(sandbox_id.encode()).digest()[:8], "big") % hosts
    for step in range(hosts):
        address = subnet.network_address + 2 + (start + step) % hosts
        if address not in taken:
            return address
    raise ValueError(f"the egress subnet {subnet} is full")  # pragma: no cover
