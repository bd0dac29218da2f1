"""Sandbox deadlines that systemd enforces by itself, even while the agent is down.

A sandbox's TTL is a transient systemd timer, ``slicebox-ttl-<sandbox>-<epoch>.timer``, whose
service runs ``sliceboxd expire <sandbox> <container> --deadline <epoch>`` at the deadline
(:mod:`slicebox.core.expiry`): it reads the final usage from the scope's cgroup, audits the
expiry and removes the container, agent or no agent. The program's absolute path is found when
the timer is armed (the agent's own ``sliceboxd``, else the one on ``PATH``); when there is
none, the timer falls back to killing the scope (``systemctl kill --signal=SIGKILL
docker-<id>.scope``) and the reaper later removes the exited container, unaudited as expired.
Each timer is bound to the container's scope (``BindsTo=``): systemd stops it when the scope
stops (the container removed, killed or exited), so a destroy makes no timer call, and a
container that runs no more gets no timer. The deadline is in the unit's name, so reading it
back needs no property call, and extending it is arming a later timer and stopping the
earlier one: the labels (immutable) keep the original ``expires_at``, systemd holds the
current one. Timers live in ``/run``: they survive ``daemon-reload`` and agent restarts, not a
reboot (after which no sandbox is running anyway).

An acquired warm-pool member's lineage rides on its timer too: the Description says
``slicebox deadline of <sandbox>; lease task=... root=...`` (:class:`~slicebox.model.pool.Lease`),
systemd lists Descriptions with the names, and an extension carries the lease to its new timer.
Why there: ``docs/pool.md``.

A scope's own ``RuntimeMaxSec`` would be simpler but cannot be changed once the scope runs
(systemd 257 refuses it), so a deadline could never be extended.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

from pydantic import ConfigDict

from slicebox.host.systemd import Systemd
from slicebox.model.base import Model
from slicebox.model.errors import HostError, SandboxNotRunning
from slicebox.model.names import DOCKER_SCOPES, SCOPE_PREFIX_ENV, scope_name, scope_prefix
from slicebox.model.pool import Lease, parse_lease

log = logging.getLogger(__name__)

PREFIX = "slicebox-ttl-"
PATTERN = f"{PREFIX}*.timer"
PROGRAM = "sliceboxd"


class Timer(Model):
    """One armed deadline, as its unit name says."""

    model_config = ConfigDict(frozen=True)

    unit: str
    sandbox_id: str
    at: datetime
    lease: Lease | None = None  # a pool member's lineage, when the timer holds one


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


def described(unit: str, description: str) -> Timer | None:
    """The timer a unit name stands for, with the lease its Description holds, if any."""
    timer = parse_timer(unit)
    lease = parse_lease(description) if timer is not None else None
    return timer if lease is None or timer is None else timer.model_copy(update={"lease": lease})


def description(sandbox_id: str, lease: Lease | None) -> str:
    own = f"slicebox deadline of {sandbox_id}"
    return own if lease is None else f"{own}; {lease.describe()}"


def own_pattern(sandbox_id: str) -> str:
    """The glob of one sandbox's timers (sandbox ids hold no glob characters)."""
    return f"{PREFIX}{sandbox_id}-*.timer"


def latest(timers: Iterable[Timer]) -> dict[str, datetime]:
    """Each sandbox's deadline: the latest of its timers."""
    found: dict[str, datetime] = {}
    for timer in timers:
        if timer.sandbox_id not in found or timer.at > found[timer.sandbox_id]:
            found[timer.sandbox_id] = timer.at
    return found


ENV_PROGRAM = "/usr/bin/env"


def expire_command(
    program: str,
    sandbox_id: str,
    container_id: str,
    at: datetime,
    docker_host: str | None = None,
) -> list[str]:
    """What the timer runs: ``sliceboxd expire``, told which deadline it enforces. The timer's
    service does not inherit the agent's environment: the engine the agent found (its
    ``docker_host``) is passed on as DOCKER_HOST, so the command removes from the same daemon
    without finding it again, and a scope prefix other than Docker's (Podman's), so it can
    kill the scope while the engine is down."""
    env = [f"DOCKER_HOST={docker_host}"] if docker_host else []
    if scope_prefix() != DOCKER_SCOPES:  # the expiry kills the scope when the engine is down
        env.append(f"{SCOPE_PREFIX_ENV}={scope_prefix()}")
    prefix = [ENV_PROGRAM, *env] if env else []
    deadline = str(int(at.timestamp()))
    return [*prefix, program, "expire", sandbox_id, container_id, "--deadline", deadline]


def kill_command(container_id: str, systemctl: str) -> list[str]:
    """The fallback when no ``sliceboxd`` is found: the scope dies, nothing is audited."""
    return [systemctl, "kill", "--signal=SIGKILL", scope_name(container_id)]


def find_program(
    argv0: str | None = None,
    which: Callable[[str], str | None] = shutil.which,
    runnable: Callable[[str], bool] = lambda path: os.access(path, os.X_OK),
) -> str | None:
    """The absolute path of ``sliceboxd`` for a timer's service, which has neither the agent's
    working directory nor, necessarily, its ``PATH``: the program the agent itself runs as
    (``/usr/bin/sliceboxd`` from the package, a console script elsewhere), else the one on
    ``PATH``; None when there is neither."""
    own = sys.argv[0] if argv0 is None else argv0
    found = [own] if os.path.basename(own) == PROGRAM else []
    found += [path for path in (which(PROGRAM),) if path]
    for path in found:
        absolute = os.path.abspath(path)
        if runnable(absolute):
            return absolute
    return None


class Deadlines:
    """Arm, extend, read and disarm sandbox deadlines over :class:`Systemd`.

    ``program`` finds the ``sliceboxd`` a timer runs, asked at every arm (the default finds
    none, so a timer only kills the scope; the agent passes :func:`find_program`)."""

    def __init__(
        self,
        systemd: Systemd,
        systemctl: str | None = None,
        program: Callable[[], str | None] = lambda: None,
        docker_host: str | None = None,
    ) -> None:
        self._systemd = systemd
        self._docker_host = docker_host  # the agent's engine, for the expiry command
        self._systemctl = systemctl or shutil.which("systemctl") or "/usr/bin/systemctl"
        self._program = program
        self._warned = False

    def timers(self) -> list[Timer]:
        """Every armed deadline, as systemd lists them."""
        found = (parse_timer(unit) for unit in self._systemd.list_units(PATTERN))
        return [timer for timer in found if timer is not None]

    def timers_of(self, sandbox_id: str) -> list[Timer]:
        """The sandbox's own timers: systemd matches the name, so the answer does not grow
        with the number of sandboxes."""
        found = (parse_timer(unit) for unit in self._systemd.list_units(own_pattern(sandbox_id)))
        return [timer for timer in found if timer is not None and timer.sandbox_id == sandbox_id]

    def leased(self, sandbox_id: str | None = None) -> list[Timer]:
        """The timers (every one, or the sandbox's own) with the leases their Descriptions
        hold: one systemd call, as ``timers`` is."""
        pattern = PATTERN if sandbox_id is None else own_pattern(sandbox_id)
        found = (described(u, d) for u, d in self._systemd.describe_units(pattern).items())
        return [t for t in found if t is not None and sandbox_id in (None, t.sandbox_id)]

    def current(self) -> dict[str, datetime]:
        """Each sandbox's deadline now: the latest of its timers."""
        return latest(self.timers())

    def current_of(self, sandbox_id: str) -> datetime | None:
        """The sandbox's deadline now, if a timer holds one."""
        return latest(self.timers_of(sandbox_id)).get(sandbox_id)

    def arm(
        self, sandbox_id: str, container_id: str, at: datetime, lease: Lease | None = None
    ) -> str:
        """Make ``at`` the sandbox's deadline; earlier timers are stopped once it is armed.
        ``lease``: an acquired pool member's, carried to the new timer."""
        unit = timer_unit(sandbox_id, at)
        older = [t for t in self.timers_of(sandbox_id) if t.unit != unit]
        if not self._systemd.status(unit).active:
            self._start(unit, sandbox_id, container_id, at, lease)
        self.stop(older)
        return unit

    def arm_new(
        self, sandbox_id: str, container_id: str, at: datetime, lease: Lease | None = None
    ) -> str:
        """``arm`` for a sandbox being created: its id is new, so it has no timer to look for
        or stop, and arming is one systemd call. Should a timer of that name exist after all,
        systemd refuses it (``unit_exists``) and the create fails and is undone. An idle pool
        member has no timer either: its acquire arms its first, with the ``lease``."""
        unit = timer_unit(sandbox_id, at)
        self._start(unit, sandbox_id, container_id, at, lease)
        return unit

    def _start(
        self, unit: str, sandbox_id: str, container_id: str, at: datetime, lease: Lease | None
    ) -> None:
        """Start the timer, bound to the container's scope: systemd stops it when the scope
        stops (the container removed, or exited), so no destroy needs to disarm it. A container
        that runs no more gets none (``SandboxNotRunning``): the reaper removes it as exited."""
        command = self._command(sandbox_id, container_id, at)
        scope = scope_name(container_id)
        try:
            self._systemd.start_timer(unit, at, command, description(sandbox_id, lease), scope)
        except HostError as exc:
            if exc.code != "no_such_unit":
                raise
            raise SandboxNotRunning(
                f"sandbox {sandbox_id} has stopped (its command ended or it was killed), so it "
                "has no deadline to arm; destroy it, or the reaper removes it"
            ) from exc

    def _command(self, sandbox_id: str, container_id: str, at: datetime) -> list[str]:
        program = self._program()
        if program is not None:
            return expire_command(program, sandbox_id, container_id, at, self._docker_host)
        if not self._warned:
            self._warned = True
            log.warning(
                "no %s program found for the deadline timers; they kill the scope only, and "
                "the reaper audits the exited container, without its final usage",
                PROGRAM,
            )
        return kill_command(container_id, self._systemctl)

    def disarm(self, sandbox_id: str) -> None:
        self.stop(self.timers_of(sandbox_id))

    def stop(self, timers: Sequence[Timer]) -> None:
        for timer in timers:
            try:
                self._systemd.stop(timer.unit)
            except HostError as exc:
                # An elapsed timer may vanish between listing and stopping: that is its goal.
                if self._systemd.is_active(timer.unit):
                    raise
                log.debug("%s already gone: %s", timer.unit, exc)
