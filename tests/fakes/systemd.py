"""An in-memory :class:`slicebox.host.systemd.Systemd`: units with properties and nesting.

It refuses what systemd refuses, with what :class:`~slicebox.host.systemd.PystemdSystemd`
raises for it (the contract both pass is ``tests/fakes/systemd_contract.py``): a transient unit
whose name is taken (running, installed, or left with drop-ins) is ``unit_exists``; stopping an
unknown unit is ``no_such_unit`` except for a slice, which systemd loads on demand. A unit is
"loaded" (listed without ``active_only``) while it runs, is installed, failed, or has drop-ins.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Sequence
from datetime import datetime

from slicebox.host.systemd import UnitStatus
from slicebox.model.errors import HostError
from slicebox.model.limits import Property


class FakeSystemd:
    def __init__(self) -> None:
        self.properties: dict[str, dict[str, int]] = {}
        self.running: set[str] = set()
        self.installed: set[str] = set()
        self.failed: set[str] = set()
        self.children: dict[str, set[str]] = {}
        self.fail_start: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.timers: dict[str, tuple[datetime, list[str]]] = {}
        self.killed: list[tuple[str, int]] = []
        self.descriptions: dict[str, str] = {}
        self.invocations: dict[str, int] = {}  # unit -> the number of its current activation
        self.bound: dict[str, str] = {}  # timer -> the scope it is bound to (BindsTo=)
        self._activations = 0
        self._lock = threading.Lock()  # systemd serialises its bus calls

    def status(self, unit: str) -> UnitStatus:
        with self._lock:
            return UnitStatus(
                load_state="loaded" if self._known(unit) else "not-found",
                active_state=self._active_state(unit),
                fragment_path=f"/etc/systemd/system/{unit}" if unit in self.installed else "",
            )

    def invocation(self, unit: str) -> str:
        with self._lock:
            if unit not in self.running:
                return ""
            if unit not in self.invocations:  # put in ``running`` by a test directly
                self._activations += 1
                self.invocations[unit] = self._activations
            return f"{self.invocations[unit]:032x}"

    def is_active(self, unit: str) -> bool:
        with self._lock:
            return unit in self.running

    def start_transient(self, unit: str, properties: Sequence[Property], description: str) -> None:
        with self._lock:
            self.calls.append(("start_transient", unit))
            if unit in self.running | self.installed | set(self.properties):
                raise HostError(
                    f"systemd says {unit} already exists; set its properties instead",
                    code="unit_exists",
                )
            self._start(unit)
            self.properties[unit] = dict(properties)

    def set_properties(self, unit: str, properties: Sequence[Property]) -> None:
        with self._lock:
            self.calls.append(("set_properties", unit))
            self.properties.setdefault(unit, {}).update(properties)

    def start(self, unit: str) -> None:
        with self._lock:
            self.calls.append(("start", unit))
            self._must_know(unit)
            self._start(unit)

    def stop(self, unit: str) -> None:
        with self._lock:
            self.calls.append(("stop", unit))
            self._must_know(unit)
            self.running.discard(unit)
            self.children.pop(unit, None)
            self.timers.pop(unit, None)
            self.descriptions.pop(unit, None)
            if unit not in self.installed:
                self.properties.pop(unit, None)  # a stopped transient unit loses its files

    def kill(self, unit: str, signal: int) -> None:
        """A killed scope stops: it leaves its slice, as a SIGKILLed container's does."""
        with self._lock:
            self.calls.append(("kill", unit))
            holders = [kids for kids in self.children.values() if unit in kids]
            if unit not in self.running and not holders:
                raise HostError(f"systemd has no unit {unit} loaded", code="no_such_unit")
            self.killed.append((unit, signal))
            self.running.discard(unit)
            for kids in holders:
                kids.discard(unit)
            self._scope_stopped(unit)

    def has_children(self, unit: str) -> bool:
        return bool(self.children.get(unit))

    def list_units(self, pattern: str, *, active_only: bool = False) -> list[str]:
        with self._lock:
            units = self.running if active_only else self._loaded()
            return sorted(u for u in units if fnmatch.fnmatchcase(u, pattern))

    def describe_units(self, pattern: str) -> dict[str, str]:
        with self._lock:
            units = (u for u in self._loaded() if fnmatch.fnmatchcase(u, pattern))
            return {u: self.descriptions.get(u, u) for u in sorted(units)}

    def start_timer(
        self,
        timer: str,
        at: datetime,
        argv: Sequence[str],
        description: str,
        bound_to: str | None = None,
    ) -> None:
        with self._lock:
            self.calls.append(("start_timer", timer))
            if timer in self.running:
                raise HostError(f"systemd says {timer} already exists", code="unit_exists")
            if bound_to is not None and not self._scope_runs(bound_to):
                raise HostError(
                    f"{timer} not started: {bound_to} does not run", code="no_such_unit"
                )
            self._start(timer)
            self.timers[timer] = (at, list(argv))
            self.descriptions[timer] = description
            if bound_to is not None:
                self.bound[timer] = bound_to

    def scope_stopped(self, scope: str) -> None:
        """A scope stopped (its container was removed or exited): the timers bound to it
        stop with it, as systemd stops a unit whose ``BindsTo=`` unit stops."""
        with self._lock:
            self._scope_stopped(scope)

    def _scope_stopped(self, scope: str) -> None:
        for timer in [t for t, bound in self.bound.items() if bound == scope]:
            del self.bound[timer]
            self.running.discard(timer)
            self.timers.pop(timer, None)
            self.descriptions.pop(timer, None)

    def _scope_runs(self, unit: str) -> bool:
        return unit in self.running or any(unit in kids for kids in self.children.values())

    def _start(self, unit: str) -> None:
        if unit in self.fail_start:
            self.failed.add(unit)
            raise HostError(f"systemd could not start {unit}; see `journalctl -u {unit}`")
        self.failed.discard(unit)
        if unit not in self.running:
            self._activations += 1
            self.invocations[unit] = self._activations
        self.running.add(unit)

    def _loaded(self) -> set[str]:
        return self.running | self.installed | self.failed | set(self.properties)

    def _known(self, unit: str) -> bool:
        return unit.endswith(".slice") or unit in self._loaded()

    def _must_know(self, unit: str) -> None:
        if not self._known(unit):
            raise HostError(f"systemd has no unit {unit} loaded", code="no_such_unit")

    def _active_state(self, unit: str) -> str:
        if unit in self.running:
            return "active"
        return "failed" if unit in self.failed else "inactive"
