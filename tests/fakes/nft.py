"""libnftables' JSON call, in memory, failing the way the kernel fails.

A batch is one transaction: it is applied to a copy and kept only if every command succeeds
(rc 1 and an error text otherwise, nothing changed). ``add`` of what exists is no error;
``delete`` of what does not is ENOENT; a chain with rules, or one a map element jumps to,
cannot be deleted (EBUSY); a map key added again with another verdict is EEXIST; an element of
a timeout set added again gets its new timeout. Only what ``host.nft`` sends is understood.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]


class _Refused(Exception):
    pass


@dataclass
class Table:
    chains: dict[str, list[Json]] = field(default_factory=dict)  # name -> rules' expr lists
    base: dict[str, Json] = field(default_factory=dict)
    sets: dict[str, Json] = field(default_factory=dict)  # name -> its definition
    elements: dict[str, dict[str, Any]] = field(default_factory=dict)  # set -> key -> value
    maps: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters: dict[str, list[int]] = field(default_factory=dict)  # name -> [packets, bytes]


class FakeNftApi:
    def __init__(self) -> None:
        self.tables: dict[tuple[str, str], Table] = {}
        self.batches: list[list[Json]] = []
        self._entered = threading.Lock()

    def json_cmd(self, data: Json) -> tuple[int, Any, str]:
        # One context's buffers are not safe across threads: a second caller at once is a bug.
        if not self._entered.acquire(blocking=False):
            raise AssertionError("libnftables' context used by two threads at once")
        try:
            return self._batch(data["nftables"])
        finally:
            self._entered.release()

    def _batch(self, commands: list[Json]) -> tuple[int, Any, str]:
        self.batches.append(commands)
        before = copy.deepcopy(self.tables)
        output: list[Json] = []
        try:
            for command in commands:
                ((verb, body),) = command.items()
                output += getattr(self, "_" + verb)(body) or []
        except _Refused as exc:
            self.tables = before
            return 1, "", f"Error: {exc}"
        return 0, {"nftables": output}, ""

    # --- what tests look at --------------------------------------------------------------

    def table(self, family: str = "inet", name: str = "slicebox") -> Table:
        return self.tables[(family, name)]

    def hit(self, counter: str, packets: int, size: int) -> None:
        """Packets the kernel counted."""
        values = self.table().counters[counter]
        values[0] += packets
        values[1] += size

    # --- verbs ---------------------------------------------------------------------------

    def _add(self, body: Json) -> None:
        ((kind, spec),) = body.items()
        if kind == "table":
            self.tables.setdefault((spec["family"], spec["name"]), Table())
            return
        table = self._table(spec)
        name = spec.get("name", "")
        if kind == "chain":
            table.chains.setdefault(name, [])
            if "hook" in spec:
                table.base[name] = spec
        elif kind == "rule":
            self._refer(table, spec["expr"])
            self._chain(table, spec["chain"]).append(spec["expr"])
        elif kind == "set":
            if name not in table.sets:
                table.sets[name] = spec
                table.elements[name] = {}
            for elem in spec.get("elem", []):
                table.elements[name][repr(elem)] = None
        elif kind == "map":
            table.maps.setdefault(name, {})
        elif kind == "counter":
            table.counters.setdefault(name, [0, 0])
        elif kind == "element":
            self._add_elements(table, name, spec["elem"])
        else:
            raise _Refused(f"unknown object {kind}")

    def _add_elements(self, table: Table, name: str, elems: list[Any]) -> None:
        if name in table.maps:
            for key, verdict in elems:
                target = verdict["jump"]["target"]
                self._chain(table, target)
                known = table.maps[name].get(key)
                if known is not None and known != verdict:
                    raise _Refused("Could not process rule: File exists")
                table.maps[name][key] = verdict
            return
        if name not in table.sets:
            raise _Refused(f"Could not process rule: No such file or directory (set {name})")
        for elem in elems:
            value = elem["elem"]["val"] if isinstance(elem, dict) and "elem" in elem else elem
            timeout = (
                elem["elem"].get("timeout") if isinstance(elem, dict) and "elem" in elem else None
            )
            table.elements[name][repr(value)] = timeout

    def _flush(self, body: Json) -> None:
        spec = body["chain"]
        self._chain(self._table(spec), spec["name"]).clear()

    def _delete(self, body: Json) -> None:
        ((kind, spec),) = body.items()
        if kind == "table":
            if self.tables.pop((spec["family"], spec["name"]), None) is None:
                raise _Refused("Could not process rule: No such file or directory")
            return
        table = self._table(spec)
        getattr(self, f"_delete_{kind}")(table, spec.get("name", ""), spec)

    def _delete_element(self, table: Table, name: str, spec: Json) -> None:
        entries = table.maps.get(name)
        if entries is None:
            raise _Refused("Could not process rule: No such file or directory")
        for key in spec["elem"]:
            if entries.pop(key, None) is None:
                raise _Refused("Could not process rule: No such file or directory")

    def _delete_chain(self, table: Table, name: str, spec: Json) -> None:
        rules = self._chain(table, name)
        jumped = any(v["jump"]["target"] == name for m in table.maps.values() for v in m.values())
        if rules or jumped:
            raise _Refused("Could not process rule: Device or resource busy")
        del table.chains[name]

    def _delete_set(self, table: Table, name: str, spec: Json) -> None:
        if table.sets.pop(name, None) is None:
            raise _Refused("Could not process rule: No such file or directory")
        if any(f"@{name}'" in repr(rule) for rules in table.chains.values() for rule in rules):
            raise _Refused("Could not process rule: Device or resource busy")
        del table.elements[name]

    def _delete_counter(self, table: Table, name: str, spec: Json) -> None:
        if table.counters.pop(name, None) is None:
            raise _Refused("Could not process rule: No such file or directory")
        if any(repr({"counter": name}) in repr(r) for rs in table.chains.values() for r in rs):
            raise _Refused("Could not process rule: Device or resource busy")

    def _list(self, body: Json) -> list[Json]:
        ((kind, spec),) = body.items()
        if kind == "chains":
            return [
                {"chain": {"family": family, "table": name, "name": chain}}
                for (family, name), table in self.tables.items()
                if family == spec["family"]
                for chain in table.chains
            ]
        table = self._table(spec)
        if kind == "counters":
            return [
                {
                    "counter": {
                        "family": spec["family"],
                        "table": spec["table"],
                        "name": name,
                        "packets": packets,
                        "bytes": size,
                    }
                }
                for name, (packets, size) in table.counters.items()
            ]
        if kind == "counter":
            if spec["name"] not in table.counters:
                raise _Refused("Could not process rule: No such file or directory")
            packets, size = table.counters[spec["name"]]
            return [{"counter": {**spec, "packets": packets, "bytes": size}}]
        if kind == "map":
            if spec["name"] not in table.maps:
                raise _Refused("Could not process rule: No such file or directory")
            elems = [[key, verdict] for key, verdict in table.maps[spec["name"]].items()]
            return [{"map": {**spec, "elem": elems}}]
        raise _Refused(f"cannot list {kind}")

    # --- helpers -------------------------------------------------------------------------

    def _table(self, spec: Json) -> Table:
        table = self.tables.get((spec["family"], spec["table"]))
        if table is None:
            raise _Refused("Could not process rule: No such file or directory (table)")
        return table

    def _chain(self, table: Table, name: str) -> list[Json]:
        if name not in table.chains:
            raise _Refused(f"Could not process rule: No such file or directory (chain {name})")
        return table.chains[name]

    def _refer(self, table: Table, expr: list[Json]) -> None:
        """What a rule names must exist: its sets, counters and jump targets."""
        text = repr(expr)
        for name in table.sets:
            text = text.replace(f"'@{name}'", "'<set>'")
        if "'@" in text and "'@sandboxes'" not in text:
            raise _Refused("Could not process rule: No such file or directory (set)")
        for item in expr:
            named = item.get("counter")
            if isinstance(named, str) and named not in table.counters:
                raise _Refused("Could not process rule: No such file or directory (counter)")
            if "jump" in item:
                self._chain(table, item["jump"]["target"])
