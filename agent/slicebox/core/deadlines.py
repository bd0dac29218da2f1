"""Sandbox deadlines that systemd enforces by itself, even while the agent is down.

A sandbox's TTL is a transient systemd timer, ``slicebox-ttl-<sandbox>-<epoch>.timer``, whose
service kills the sandbox's scope at the deadline (``systemctl kill --signal=SIGKILL
docker-<id>.scope``); the container then shows as exited and the reaper removes it. The deadline
is in the unit's name, so reading it back needs no property call, and extending it is arming a
later timer and stopping the earlier one: the labels (immutable) keep the original
``expires_at``, systemd holds the current one. Timers live in ``/run``: they survive
``daemon-reload`` and agent restarts, not a reboot (after which no sandbox is running anyway).

A scope's own ``RuntimeMaxSec`` would be simpler but cannot be changed once the scope runs
(systemd 257 refuses it), so a deadline could never be extended.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict

from slicebox.host.systemd import Systemd
from slicebox.model.errors import HostError
from slicebox.model.names import scope_name

log = logging.getLogger(__name__)

PREFIX = "slicebox-ttl-"
PATTERN = f"{PREFIX}*.timer"


class Timer(BaseModel):
    """One armed deadline, as its unit name says."""

    model_config = ConfigDict(frozen=True)

    unit: str
    sandbox_id: str
    at: datetime


def timer_unit(sandbox_id: str, at: datetime) -> str:
    return f"{PREFIX}{sandbox_id}-{int(at.timestamp())}.timer"


def parse_timer(unit: str) -> Timer | None:
    """The timer a unit name stands for; None for a name slicebox does not make."""
    if not unit.startswith(PREFIX) or not unit.endswith(".timer"):
        return None
    sandbox_id, _, epoch = unit[len(PREFIX) : -len(".timer")].rpartition("-")
    if not sandbox_id or not epoch.isdigit():
        return None
    return Timer(unit=unit, sandbox_id=sandbox_id, at=datetime.fromtimestamp(int(epoch), UTC))


def latest(timers: Iterable[Timer]) -> dict[str, datetime]:
    """Each sandbox's deadline: the latest of its timers."""
    found: dict[str, datetime] = {}
    for timer in timers:
        if timer.sandbox_id not in found or timer.at > found[timer.sandbox_id]:
            found[timer.sandbox_id] = timer.at
    return found


def kill_command(container_id: str, systemctl: str) -> list[str]:
    return [systemctl, "kill", "--signal=SIGKILL", scope_name(container_id)]


class Deadlines:
    """Arm, extend, read and disarm sandbox deadlines over :class:`Systemd`."""

    def __init__(self, systemd: Systemd, systemctl: str | None = None) -> None:
        self._systemd = systemd
        self._systemctl = systemctl or shutil.which("systemctl") or "/usr/bin/systemctl"

    def timers(self) -> list[Timer]:
        """Every armed deadline, as systemd lists them."""
        found = (parse_timer(unit) for unit in self._systemd.list_units(PATTERN))
        return [timer for timer in found if timer is not None]

    def current(self) -> dict[str, datetime]:
        """Each sandbox's deadline now: the latest of its timers."""
        return latest(self.timers())

    def arm(self, sandbox_id: str, container_id: str, at: datetime) -> str:
        """Make ``at`` the sandbox's deadline; earlier timers are stopped once it is armed."""
        unit = timer_unit(sandbox_id, at)
        older = [t for t in self.timers() if t.sandbox_id == sandbox_id and t.unit != unit]
        if not self._systemd.status(unit).active:
            self._systemd.start_timer(
                unit,
                at,
                kill_command(container_id, self._systemctl),
                f"slicebox deadline of {sandbox_id}",
            )
        self.stop(older)
        return unit

    def disarm(self, sandbox_id: str) -> None:
        self.stop([t for t in self.timers() if t.sandbox_id == sandbox_id])

    def stop(self, timers: Sequence[Timer]) -> None:
        for timer in timers:
            try:
                self._systemd.stop(timer.unit)
            except HostError as exc:
                # An elapsed timer may vanish between listing and stopping: that is its goal.
                if self._systemd.status(timer.unit).active:
                    raise
                log.debug("%s already gone: %s", timer.unit, exc)
