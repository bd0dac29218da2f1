"""systemd as the native backend meets it: transient slices and services, in memory.

What it does as systemd does (seen in the guest): a slice's ``Description`` is what its
start gave; a service started in a slice runs there until it ends or the slice stops; a
service that ended well is collected at once (gone: ``service_status`` answers None), one that
failed stays ``failed`` with its exit status until ``reset_failed``; stopping a slice stops
every unit in it; unit patterns match with backslashes as themselves (``FNM_NOESCAPE``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slicebox.backends.native.units import INIT_SCRIPT
from slicebox.host.systemd import ListedUnit, ServiceStatus
from slicebox.model.errors import HostError
from slicebox.model.limits import Property
from tests.fakes.systemd import FakeSystemd

RUNNING = ServiceStatus(
    active_state="active",
    sub_state="running",
    result="success",
    main_pid=4242,
    exited=False,
    code=0,
    status=0,
)


class FakeNativeSystemd(FakeSystemd):
    def __init__(self) -> None:
        super().__init__()
        self.services: dict[str, dict[str, Any]] = {}  # unit -> its start's properties
        self.service_states: dict[str, ServiceStatus] = {}
        self.ends_at_once: dict[str, ServiceStatus] = {}  # unit prefix -> how it ends
        self.slice_descriptions: dict[str, str] = {}

    def start_transient(self, unit: str, properties: Sequence[Property], description: str) -> None:
        super().start_transient(unit, properties, description)
        with self._lock:
            self.slice_descriptions[unit] = description

    def start_service(self, unit: str, properties: Mapping[str, Any], *, wait: bool) -> None:
        with self._lock:
            self.calls.append(("start_service", unit))
            if unit in self.running or unit in self.service_states:
                raise HostError(f"systemd says {unit} already exists", code="unit_exists")
            self.services[unit] = dict(properties)
            ended = next((s for p, s in self.ends_at_once.items() if unit.startswith(p)), None)
            if ended is not None:
                self.service_states[unit] = ended
                return
            self.running.add(unit)
            self.children.setdefault(str(properties["Slice"]), set()).add(unit)
            self.service_states[unit] = RUNNING

    def end(self, unit: str, status: ServiceStatus | None) -> None:
        """The service's main process ended: ``None`` for success (collected at once)."""
        with self._lock:
            self.running.discard(unit)
            for kids in self.children.values():
                kids.discard(unit)
            if status is None:
                self.service_states.pop(unit, None)
            else:
                self.service_states[unit] = status

    def service_status(self, unit: str) -> ServiceStatus | None:
        with self._lock:
            return self.service_states.get(unit)

    def listed(self, patterns: Sequence[str]) -> list[ListedUnit]:
        with self._lock:
            units = self._loaded() | set(self.service_states)
            return [
                ListedUnit(
                    name=unit,
                    description=self.slice_descriptions.get(unit, unit),
                    active_state=self._state_of(unit),
                    sub_state="",
                )
                for unit in sorted(units)
                if any(fnmatch.fnmatchcase(unit, pattern) for pattern in patterns)
            ]

    def _state_of(self, unit: str) -> str:
        if unit in self.running:
            return "active"
        status = self.service_states.get(unit)
        return status.active_state if status is not None else self._active_state(unit)

    def stop(self, unit: str) -> None:
        with self._lock:
            if unit in self.service_states and unit not in self.running:
                return  # a failed service: stopping it leaves it failed
            for kid in self.children.get(unit, set()):
                self.running.discard(kid)
                if self.service_states.get(kid) is RUNNING:
                    del self.service_states[kid]
            if unit in self.service_states:
                self.running.discard(unit)
                del self.service_states[unit]
                return
        super().stop(unit)
        with self._lock:
            self.slice_descriptions.pop(unit, None)

    def reset_failed(self, unit: str) -> None:
        with self._lock:
            status = self.service_states.get(unit)
            if status is not None and status.active_state == "failed":
                del self.service_states[unit]


class LiveInitSystemd(FakeNativeSystemd):
    """:class:`FakeNativeSystemd` whose native anchors run their init for real (as a plain
    child process here, no namespace), so an exec goes over the real wire: the order, the
    hello, the go, the report. An exec's scope is its process's session: a stop kills it.
    The init takes orders from this test's own uid (``AGENT_UID`` in its argv)."""

    def __init__(self) -> None:
        super().__init__()
        self.inits: dict[str, subprocess.Popen[bytes]] = {}  # anchor -> its init
        self.scope_pids: dict[str, int] = {}  # scope -> the pid its pidfd named

    def start_service(self, unit: str, properties: Mapping[str, Any], *, wait: bool) -> None:
        if unit.endswith(".scope"):
            [pidfd] = properties["PIDFDs"]
            with self._lock:
                self.scope_pids[unit] = int(_fdinfo_pid(pidfd))
        super().start_service(unit, properties, wait=wait)
        argv = list(properties.get("ExecStart", [("", [], False)])[0][1])
        if unit.endswith(".service") and str(INIT_SCRIPT) in argv:
            script = argv.index(str(INIT_SCRIPT))
            argv[script + 2] = str(os.getuid())  # its AGENT_UID: this test's
            self._start_init(unit, argv, Path(argv[script + 1]))

    def _start_init(self, unit: str, argv: list[str], path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"}
        self.inits[unit] = subprocess.Popen(argv, env=env)
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self, unit: str) -> None:
        pid = self.scope_pids.pop(unit, None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for anchor, init in list(self.inits.items()):
            if unit == anchor or unit == self.services[anchor].get("Slice"):
                init.kill()
                init.wait()
                del self.inits[anchor]
        super().stop(unit)

    def close(self) -> None:
        for init in self.inits.values():
            init.kill()
            init.wait()
        self.inits.clear()


def _fdinfo_pid(pidfd: int) -> str:
    for line in Path(f"/proc/self/fdinfo/{pidfd}").read_text().splitlines():
        if line.startswith("Pid:"):
            return line.split()[1]
    raise AssertionError("not a pidfd")


class ChildClaims:
    """``claims.Claims`` for a plain init: any live process is the init's child (the real
    check, of the anchor's cgroup, is the guest's)."""

    def __init__(self) -> None:
        self.claimed: list[tuple[int, str]] = []

    def claim(self, pid: int, cgroup: str) -> int:
        self.claimed.append((pid, cgroup))
        return os.pidfd_open(pid)
