"""slicebox's nftables table: a sandbox on the egress network reaches its allowed set and no more.

Everything is in one table, ``inet slicebox``, written through libnftables' JSON API (Debian's
``python3-nftables``); nothing of Docker's tables is touched. Its base chains hook ``forward``
and ``input`` at priority -10, before Docker's (0): a drop here is final whatever Docker's
rules accept afterwards. A packet from the egress bridge goes to ``guard``, which jumps by its
source address through the ``sandboxes`` verdict map to that sandbox's chain; a source no
sandbox has (one not yet or no longer mapped, IPv6) is dropped and counted as ``stray``. On the
host itself (the ``input`` hook: any of its addresses, the bridge's own included) only the
resolver's port on the bridge's address is open to every sandbox; all else is dropped and
counted as ``host``, whatever a sandbox's list names.

A sandbox's chain accepts, and counts in its ``ok`` counter, packets of connections already
established and packets to its four sets: networks and addresses (``net``), the same with a
port (``netp``), and what the resolver answered for its names, which expire with the answer's
TTL (``dns``, ``dnsp``); everything else is dropped and counted in its ``deny`` counter.
The rules live in the kernel: they hold while the agent is down or restarting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network
from typing import Any, NamedTuple, Protocol

from slicebox.model.errors import HostError, Unavailable

log = logging.getLogger(__name__)

TABLE = "slicebox"
FAMILY = "inet"
PRIORITY = -10
SANDBOX_CHAIN = "sb_"
RESOLVER_PORT = 53
Json = dict[str, Any]


class NftApi(Protocol):
    """libnftables' one call: a JSON command batch in, (rc, JSON output, error text) out."""

    def json_cmd(self, data: Json) -> tuple[int, Any, str]: ...


def libnftables() -> NftApi:
    """The real library; Unavailable when python3-nftables is not installed."""
    try:
        import nftables  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise Unavailable(
            "network egress needs nftables' Python binding: install python3-nftables",
            code="egress_unavailable",
        ) from exc
    api = nftables.Nftables()
    api.set_json_output(True)
    api.set_handle_output(False)
    return api  # type: ignore[no-any-return]


class Allowed(NamedTuple):
    """What a sandbox may reach without its resolver: networks, some with a port."""

    networks: tuple[IPv4Network, ...] = ()
    with_port: tuple[tuple[IPv4Network, int], ...] = ()


class Counts(NamedTuple):
    allowed_packets: int
    allowed_bytes: int
    denied_packets: int
    denied_bytes: int


def key_of(sandbox_id: str) -> str:
    """The name part of a sandbox's objects: its id with '-' as '_' (ids are the agent's)."""
    return sandbox_id.replace("-", "_").replace(".", "_").replace(":", "_")


class Firewall:
    def __init__(self, api: NftApi, bridge: str, gateway: IPv4Address) -> None:
        self._api, self._bridge, self._gateway = api, bridge, gateway
        # One libnftables context keeps its output in buffers of its own: one call at a time.
        self._calls = threading.Lock()

    def _call(self, commands: list[Json]) -> tuple[int, Any, str]:
        with self._calls:
            return self._api.json_cmd({"nftables": commands})

    # --- the table --------------------------------------------------------------------------

    def ensure_base(self) -> None:
        """Make the table and its base chains, or renew their rules in one transaction, never
        touching the sandboxes' chains and sets (an agent's restart keeps them)."""
        bridge = _match({"meta": {"key": "iifname"}}, self._bridge)
        resolver = [
            bridge,
            _match(_payload("ip", "daddr"), str(self._gateway)),
            _match({"meta": {"key": "l4proto"}}, {"set": ["tcp", "udp"]}),
            _match(_payload("th", "dport"), RESOLVER_PORT),
            {"accept": None},
        ]
        guard = [{"jump": {"target": "guard"}}]
        self._run(
            _add("table", {}),
            _add("map", {"name": "sandboxes", "type": "ipv4_addr", "map": "verdict"}),
            _add("counter", {"name": "stray"}),
            _add("counter", {"name": "host"}),
            _add("chain", {"name": "guard"}),
            {"flush": {"chain": _obj({"name": "guard"})}},
            _rule("guard", {"vmap": {"key": _payload("ip", "saddr"), "data": "@sandboxes"}}),
            _rule("guard", {"counter": "stray"}, {"drop": None}),
            *_base_chain("forward", [[bridge, *guard]]),
            *_base_chain("input", [resolver, [bridge, {"counter": "host"}, {"drop": None}]]),
        )

    # --- one sandbox ------------------------------------------------------------------------

    def add_sandbox(self, sandbox_id: str, address: IPv4Address, allowed: Allowed) -> None:
        """Its sets, counters and chain, then its address mapped to the chain: one transaction,
        so its first packet meets all of it or none of it (dropped as stray)."""
        key = key_of(sandbox_id)
        ok, deny = f"ok_{key}", f"deny_{key}"
        addr, port = _payload("ip", "daddr"), _payload("th", "dport")
        pair = {"concat": [addr, port]}
        l4 = _match({"meta": {"key": "l4proto"}}, {"set": ["tcp", "udp"]})
        established = _match({"ct": {"key": "state"}}, ["established", "related"], op="in")
        nets = [_net(n) for n in allowed.networks]
        pairs = [{"concat": [_net(n), p]} for n, p in allowed.with_port]
        self._run(
            _add("counter", {"name": ok}),
            _add("counter", {"name": deny}),
            _set(f"net_{key}", "ipv4_addr", "interval", nets),
            _set(f"netp_{key}", ["ipv4_addr", "inet_service"], "interval", pairs),
            _set(f"dns_{key}", "ipv4_addr", "timeout", []),
            _set(f"dnsp_{key}", ["ipv4_addr", "inet_service"], "timeout", []),
            _add("chain", {"name": SANDBOX_CHAIN + key}),
            {"flush": {"chain": _obj({"name": SANDBOX_CHAIN + key})}},
            *(
                _rule(SANDBOX_CHAIN + key, *match, {"counter": ok}, {"accept": None})
                for match in (
                    [established],
                    [_match(addr, f"@net_{key}")],
                    [_match(addr, f"@dns_{key}")],
                    [l4, _match(pair, f"@netp_{key}")],
                    [l4, _match(pair, f"@dnsp_{key}")],
                )
            ),
            _rule(SANDBOX_CHAIN + key, {"counter": deny}, {"drop": None}),
            _add("element", {"name": "sandboxes", "elem": [[str(address), _jump(key)]]}),
        )

    def allow_resolved(
        self, sandbox_id: str, addresses: Sequence[IPv4Address], ports: Sequence[int], ttl: int
    ) -> None:
        """A resolver answer's addresses, for ``ttl`` seconds (any port when ``ports`` is
        empty). Adding an element present already renews its timeout."""
        key = key_of(sandbox_id)
        if ports:
            name = f"dnsp_{key}"
            values: list[object] = [{"concat": [str(a), p]} for a in addresses for p in ports]
        else:
            name, values = f"dns_{key}", [str(a) for a in addresses]
        elems = [{"elem": {"val": value, "timeout": ttl}} for value in values]
        if elems:
            self._run(_add("element", {"name": name, "elem": elems}))

    def remove_sandbox(self, sandbox_id: str, address: IPv4Address | None = None) -> None:
        """Its map entry, chain, sets and counters, in one transaction; a part that is gone
        already is skipped (the reaper's collection and a destroy may meet)."""
        key = key_of(sandbox_id)
        chain = SANDBOX_CHAIN + key
        present = self.sandbox_chains()
        mapped = [a for a, target in self.mapped().items() if target == chain]
        if address is not None and address not in mapped:
            mapped.append(address)
        commands: list[Json] = []
        for each in mapped:
            commands.append(
                {"delete": {"element": _obj({"name": "sandboxes", "elem": [str(each)]})}}
            )
        if chain in present:
            commands += [{"flush": {"chain": _obj({"name": chain})}}]
            commands += [{"delete": {"chain": _obj({"name": chain})}}]
        for kind, name in _objects(key):
            commands.append({"delete": {kind: _obj({"name": name})}})
        self._run_tolerant(commands)

    def counts(self, sandbox_id: str) -> Counts | None:
        """Its counters; None when it has none (no egress, or gone)."""
        key = key_of(sandbox_id)
        rc, out, _ = self._call([{"list": {"counter": _obj({"name": f"ok_{key}"})}}])
        rc2, out2, _ = self._call([{"list": {"counter": _obj({"name": f"deny_{key}"})}}])
        if rc or rc2:
            return None
        ok, deny = _counter(out), _counter(out2)
        if ok is None or deny is None:
            return None
        return Counts(ok[0], ok[1], deny[0], deny[1])

    def all_counts(self) -> dict[str, Counts] | None:
        """Every sandbox's counters by its key (``key_of``), in one call for the whole table
        (a scrape with many egress sandboxes makes one libnftables call, not two each); None
        when the table cannot be listed so."""
        rc, out, _ = self._call([{"list": {"counters": {"family": FAMILY, "table": TABLE}}}])
        if rc:
            return None
        found: dict[str, list[int]] = {}
        for item in _items(out):
            counter = item.get("counter")
            if not isinstance(counter, dict) or counter.get("table") != TABLE:
                continue
            kind, _, key = str(counter.get("name", "")).partition("_")
            if kind in ("ok", "deny") and key:
                values = found.setdefault(key, [0, 0, 0, 0])
                at = 0 if kind == "ok" else 2
                values[at : at + 2] = [int(counter.get("packets", 0)), int(counter.get("bytes", 0))]
        return {key: Counts(*values) for key, values in found.items()}

    # --- what is there ----------------------------------------------------------------------

    def sandbox_chains(self) -> set[str]:
        rc, out, _ = self._call([{"list": {"chains": {"family": FAMILY}}}])
        if rc:
            return set()
        return {
            item["chain"]["name"]
            for item in _items(out)
            if "chain" in item
            and item["chain"].get("table") == TABLE
            and item["chain"]["name"].startswith(SANDBOX_CHAIN)
        }

    def sandbox_keys(self) -> set[str]:
        return {name.removeprefix(SANDBOX_CHAIN) for name in self.sandbox_chains()}

    def mapped(self) -> dict[IPv4Address, str]:
        """Address -> the chain the verdict map jumps to for it."""
        rc, out, _ = self._call([{"list": {"map": _obj({"name": "sandboxes"})}}])
        if rc:
            return {}
        found: dict[IPv4Address, str] = {}
        for item in _items(out):
            for pair in item.get("map", {}).get("elem", []):
                address, verdict = pair
                target = (
                    verdict.get("jump", {}).get("target") if isinstance(verdict, dict) else None
                )
                if isinstance(address, str) and target:
                    found[IPv4Address(address)] = target
        return found

    # --- transport --------------------------------------------------------------------------

    def _run(self, *commands: Json, check: bool = True) -> None:
        rc, _, error = self._call(list(commands))
        if rc and check:
            raise HostError(
                f"nftables refused slicebox's rules: {error.strip()}", code="egress_failed"
            )

    def _run_tolerant(self, commands: list[Json]) -> None:
        """A batch whose parts may be gone already: one transaction, else one at a time."""
        if not commands:
            return
        rc, _, _ = self._call(commands)
        if rc:
            for command in commands:
                self._call([command])


def _obj(fields: Json) -> Json:
    return {"family": FAMILY, "table": TABLE, **fields}


def _add(kind: str, fields: Json) -> Json:
    return {"add": {kind: _obj(fields) if kind != "table" else {"family": FAMILY, "name": TABLE}}}


def _base_chain(hook: str, rules: list[list[Json]]) -> list[Json]:
    chain = {"name": hook, "type": "filter", "hook": hook, "prio": PRIORITY, "policy": "accept"}
    return [
        _add("chain", chain),
        {"flush": {"chain": _obj({"name": hook})}},
        *(_rule(hook, *expr) for expr in rules),
    ]


def _rule(chain: str, *expr: Json) -> Json:
    return {"add": {"rule": _obj({"chain": chain, "expr": list(expr)})}}


def _set(name: str, kind: str | list[str], flag: str, elems: Sequence[object]) -> Json:
    fields: Json = {"name": name, "type": kind, "flags": [flag]}
    if elems:
        fields["elem"] = elems
    return _add("set", fields)


def _match(left: Json, right: object, op: str = "==") -> Json:
    return {"match": {"op": op, "left": left, "right": right}}


def _payload(protocol: str, field: str) -> Json:
    return {"payload": {"protocol": protocol, "field": field}}


def _jump(key: str) -> Json:
    return {"jump": {"target": SANDBOX_CHAIN + key}}


def _net(network: IPv4Network) -> object:
    if network.prefixlen == 32:
        return str(network.network_address)
    return {"prefix": {"addr": str(network.network_address), "len": network.prefixlen}}


def _objects(key: str) -> list[tuple[str, str]]:
    sets = [("set", f"{prefix}_{key}") for prefix in ("net", "netp", "dns", "dnsp")]
    return [*sets, ("counter", f"ok_{key}"), ("counter", f"deny_{key}")]


def _items(out: Any) -> list[Json]:
    if not isinstance(out, dict):
        return []
    return [item for item in out.get("nftables", []) if isinstance(item, dict)]


def _counter(out: Any) -> tuple[int, int] | None:
    for item in _items(out):
        if "counter" in item:
            return int(item["counter"].get("packets", 0)), int(item["counter"].get("bytes", 0))
    return None
