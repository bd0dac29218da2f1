"""The slice manager: the mechanism that makes slices exist with given ceilings.

Why transient units plus runtime drop-ins (as systemd 257 behaves, pinned by
``tests/host/test_slices.py``): a slice started with ``StartTransientUnit`` is written to
``/run/systemd/transient/`` with its properties, so ``systemctl daemon-reload`` re-reads it and
the ceilings stay in force. A later change goes through ``SetUnitProperties(runtime=True)``,
which writes a drop-in beside it (``/run/systemd/transient/<unit>.d/``) that a reload re-reads
too; stopping a transient slice removes all its files, so nothing is left behind in ``/run``.

A slice that runs already (say, one systemd made implicitly for a container) or is installed as
a file (``slices/slicebox.slice``) is never re-created: it receives the same runtime drop-ins,
under ``/run/systemd/system.control/``, which a reload re-reads as well. Nothing goes under
``/etc``: ceilings derive from the config and are re-applied at agent start and on reload, and
``/run`` vanishes at reboot together with the containers the ceilings were for. Note that
systemd reports a slice without a unit file as ``loaded`` even before it exists, so "installed"
is decided by ``FragmentPath``, not by ``LoadState``.

A slice is only stopped when empty: stopping a slice stops every unit inside it. Creates run
concurrently and nothing locks between our look at a slice and our start of it: when systemd
answers that the unit already exists, the slice is there as asked, and ``ensure`` sets its
ceilings instead, so two creates in a new project both succeed.

A slice's ceilings are written once per activation, not at every create: ``SetUnitProperties``
rewrites the slice's drop-in files and its cgroup files, and a create made that call for each
of its three slices, a large share of what systemd spent on a create beside the container's own
scope (docs/benchmarks.md). ``ensure`` remembers which properties it set on which activation
(systemd's ``InvocationID``) and asks only whether the slice still runs that activation: a
slice stopped and started again, by anyone, has a new one and is given its ceilings again. A
change of the config goes through ``update``, which sets them whatever was remembered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from slicebox.host.systemd import Systemd
from slicebox.model.config import Config
from slicebox.model.errors import HostError, InvalidName
from slicebox.model.limits import Ceiling, Property, ceiling_properties
from slicebox.model.names import MANAGED_SLICE, PREFIX, parse_slice

log = logging.getLogger(__name__)


class SliceManager:
    """Ensure, update and remove slices over a :class:`Systemd`."""

    def __init__(
        self,
        systemd: Systemd,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._systemd = systemd
        self._clock = clock
        self._sleep = sleep
        # unit -> (the activation it was given properties in, those properties)
        self._applied: dict[str, tuple[str, list[Property]]] = {}
        self._lock = threading.Lock()

    def ensure(self, unit: str, ceiling: Ceiling) -> bool:
        """Make ``unit`` run with ``ceiling``; True when this call created or started it."""
        properties = ceiling_properties(ceiling)
        invocation = self._systemd.invocation(unit)
        if invocation:
            with self._lock:
                if self._applied.get(unit) == (invocation, properties):
                    return False  # running, with these ceilings since it started
            self._systemd.set_properties(unit, properties)
            with self._lock:  # of the activation read before: a restart since is seen next time
                self._applied[unit] = (invocation, properties)
            return False
        status = self._systemd.status(unit)
        if status.active or status.installed:
            return self._configure(unit, properties, start=not status.active)
        log.info("creating %s with %s", unit, properties)
        try:
            self._systemd.start_transient(unit, properties, f"slicebox {unit}")
        except HostError as exc:
            if exc.code != "unit_exists":
                raise
            # Another create made it between our look and our start (or it lingers with
            # drop-ins): it exists, which is what was asked; give it these ceilings.
            log.info("%s appeared meanwhile; setting its properties", unit)
            self._configure(unit, properties, start=True)
            return False
        return True

    def _configure(self, unit: str, properties: list[Property], *, start: bool) -> bool:
        self._systemd.set_properties(unit, properties)
        if start:
            self._systemd.start(unit)  # joins a start in progress; a no-op on a running unit
        return start

    def update(self, unit: str, ceiling: Ceiling) -> bool:
        """Change the ceilings of a running slice live; False when it is not running."""
        if not self._systemd.status(unit).active:
            return False
        self._forget(unit)
        self._systemd.set_properties(unit, ceiling_properties(ceiling))
        return True

    def remove_if_empty(self, unit: str) -> bool:
        """Stop ``unit`` when nothing runs inside it; True when it was stopped."""
        if not self._systemd.status(unit).active or self._systemd.has_children(unit):
            return False
        log.info("removing empty %s", unit)
        self._forget(unit)
        self._systemd.stop(unit)
        return True

    def _forget(self, unit: str) -> None:
        with self._lock:
            self._applied.pop(unit, None)

    def wait_stopped(self, unit: str, timeout: float = 10.0) -> bool:
        """Wait until ``unit`` (a container's scope) has stopped; False on timeout."""
        deadline = self._clock() + timeout
        while self._systemd.is_active(unit):  # one call once it has stopped and is unloaded
            if self._clock() > deadline:
                log.warning("%s still active after %ss", unit, timeout)
                return False
            self._sleep(0.05)
        return True

    def running_slices(self) -> list[str]:
        """The user and project slices that exist now (not the managed one)."""
        return self._systemd.list_units(f"{PREFIX}-*.slice", active_only=True)

    def reapply(self, config: Config, host_memory: int) -> list[str]:
        """Write the ceilings ``config`` gives to every running slice; the updated units."""
        updated = (
            [MANAGED_SLICE]
            if self.update(MANAGED_SLICE, config.managed_ceiling(host_memory))
            else []
        )
        for unit in self.running_slices():
            ceiling = _ceiling_of(unit, config, host_memory)
            if ceiling is not None and self.update(unit, ceiling):
                updated.append(unit)
        return updated


def _ceiling_of(unit: str, config: Config, host_memory: int) -> Ceiling | None:
    try:
        user, project = parse_slice(unit)
    except InvalidName:
        log.warning("ignoring %s: not a name slicebox makes", unit)
        return None
    if project is None:
        return config.user_ceiling(user, host_memory)
    return config.project_ceiling(user, project, host_memory)
