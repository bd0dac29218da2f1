"""An in-memory :class:`slicebox.host.systemd.Systemd`: units with properties and nesting."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from datetime import datetime

from slicebox.host.systemd import UnitStatus
from slicebox.model.limits import Property


class FakeSystemd:
    def __init__(self) -> None:
        self.properties: dict[str, dict[str, int]] = {}
        self.running: set[str] = set()
        self.installed: set[str] = set()
        self.children: dict[str, set[str]] = {}
        self.fail_start: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.timers: dict[str, tuple[datetime, list[str]]] = {}

    def status(self, unit: str) -> UnitStatus:
        return UnitStatus(
            load_state="loaded",
            active_state="active" if unit in self.running else "inactive",
            fragment_path=f"/etc/systemd/system/{unit}" if unit in self.installed else "",
        )

    def start_transient(self, unit: str, properties: Sequence[Property], description: str) -> None:
        self.calls.append(("start_transient", unit))
        if unit in self.running:
            raise AssertionError(f"{unit} already exists")
        self._start(unit)
        self.properties[unit] = dict(properties)

    def set_properties(self, unit: str, properties: Sequence[Property]) -> None:
        self.calls.append(("set_properties", unit))
        self.properties.setdefault(unit, {}).update(properties)

    def start(self, unit: str) -> None:
        self.calls.append(("start", unit))
        self._start(unit)

    def stop(self, unit: str) -> None:
        self.calls.append(("stop", unit))
        self.running.discard(unit)
        self.children.pop(unit, None)
        self.timers.pop(unit, None)
        if unit not in self.installed:
            self.properties.pop(unit, None)

    def has_children(self, unit: str) -> bool:
        return bool(self.children.get(unit))

    def list_units(self, pattern: str, *, active_only: bool = False) -> list[str]:
        return sorted(u for u in self.running if fnmatch.fnmatchcase(u, pattern))

    def start_timer(self, timer: str, at: datetime, argv: Sequence[str], description: str) -> None:
        self.calls.append(("start_timer", timer))
        self._start(timer)
        self.timers[timer] = (at, list(argv))

    def _start(self, unit: str) -> None:
        from slicebox.model.errors import HostError

        if unit in self.fail_start:
            raise HostError(f"systemd could not start {unit}")
        self.running.add(unit)
