"""A sandbox's expiry, carried out at its deadline by its deadline timer, not by the agent.

The timer (:mod:`slicebox.core.deadlines`) runs ``sliceboxd expire SANDBOX CONTAINER --deadline
EPOCH`` as its own transient service: as root, in ``system.slice``, never inside the scope it
kills, whether or not the agent runs. :meth:`Expiry.expire` then tells the story the agent's
reaper would tell for an expired sandbox:

1. It acts only when the deadline is due: a later deadline (an extension, whose earlier timer
   fired before the extend stopped it; or a label deadline still ahead) leaves the sandbox be.
2. It reads the final usage from the scope's cgroup while the cgroup still exists, and writes
   one ``reaper_action`` audit record with rule ``expired``, as the reaper's destroy does
   (``journalctl SLICEBOX_REAPER_RULE=expired`` finds both); its detail says the deadline timer
   did it.
3. It kills and removes the container as the agent does (Docker's forced remove, then waiting
   for the scope to stop), removes its credentials (and its workspace volume with its root
   task's last sandbox), stops the sandbox's other timers, and the project and user slices
   if nothing is left in them.

Everything else writes nothing, so a second run, or a run after the agent's own destroy, adds
no second record: no container with that sandbox id (gone already), or a container that runs
nothing (exited, dead, never started: the reaper removes it under its own rule).

When Docker does not answer, the deadline is still enforced: the scope is found in the slice
tree, its counters read and the record written without what only labels say, and the scope is
killed through systemd (``KillUnit``, SIGKILL). The container then shows as exited and the
reaper removes it when Docker and the agent are back; the same happens when a removal fails.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum

from slicebox.backends.base import SandboxBackend, SandboxState
from slicebox.core.deadlines import timer_unit
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.telemetry import SandboxCgroups, SandboxMeta, UsageReader, find_scope
from slicebox.core.views import cgroups_of, meta_of
from slicebox.host.journal import Auditor
from slicebox.host.systemd import Systemd
from slicebox.model.audit import AuditEvent, AuditRecord
from slicebox.model.errors import SliceboxError
from slicebox.model.labels import selector, stamp
from slicebox.model.names import parse_slice, scope_name
from slicebox.model.reaper import Kind, Rule

log = logging.getLogger(__name__)

# Nothing runs in these: the reaper removes them under its own rule (exited, never_started).
IDLE = frozenset({SandboxState.EXITED, SandboxState.DEAD, SandboxState.CREATED})


class Result(StrEnum):
    EXPIRED = "expired"  # audited, then killed and removed
    KILLED = "killed"  # audited, scope killed through systemd; the reaper removes the container
    NOT_DUE = "not_due"  # its deadline is later than this timer's
    GONE = "gone"  # nothing of it runs any more
    IDLE = "idle"  # its container runs nothing; the reaper's


class Expiry:
    """Expire one sandbox whose deadline timer fired."""

    def __init__(
        self,
        sandboxes: SandboxManager,
        backend: SandboxBackend,
        systemd: Systemd,
        *,
        usage: UsageReader,
        auditor: Auditor,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._sandboxes = sandboxes
        self._backend = backend
        self._systemd = systemd
        self._usage = usage
        self._auditor = auditor
        self._clock = clock

    def expire(
        self, sandbox_id: str, container_id: str, deadline: datetime | None = None
    ) -> Result:
        """Expire the sandbox if ``deadline`` (its timer's; now when None) is its deadline."""
        due = deadline or self._clock()
        try:
            found = self._backend.find(selector(sandbox_id=sandbox_id))
        except SliceboxError as exc:
            log.warning("%s: Docker did not answer (%s); killing its scope", sandbox_id, exc)
            return self._kill(sandbox_id, container_id, due, str(exc.message))
        if not found or found[0].state is SandboxState.REMOVING:
            log.info("%s is gone already; nothing to expire", sandbox_id)
            return Result.GONE
        if found[0].state in IDLE:
            log.info("%s runs nothing (%s); the reaper removes it", sandbox_id, found[0].state)
            return Result.IDLE
        sandbox = Sandbox.from_info(found[0])
        if not self._due(sandbox_id, sandbox.expires_at, due):
            return Result.NOT_DUE
        self._audit_expired(sandbox, due)
        return self._remove(sandbox, deadline)

    def _due(self, sandbox_id: str, label: datetime | None, due: datetime) -> bool:
        """Whether the sandbox's deadline now (its latest timer, else its label) is ``due``, to
        the second a timer holds it: a later one means it was extended meanwhile."""
        deadlines = self._sandboxes.deadlines
        held = deadlines.current_of(sandbox_id) if deadlines is not None else None
        current = held or label
        if current is not None and int(current.timestamp()) > int(due.timestamp()):
            log.info("%s: its deadline is %s now, not %s", sandbox_id, stamp(current), stamp(due))
            return False
        return True

    def _audit_expired(self, sandbox: Sandbox, due: datetime) -> None:
        pid = self._pid(sandbox.container_id)
        usage = self._final_usage(cgroups_of(sandbox), meta_of(sandbox, pid))
        self._auditor.record(
            AuditRecord(
                event=AuditEvent.REAPER_ACTION,
                sandbox_id=sandbox.id,
                root_task_id=sandbox.lineage.root_task_id,
                task_id=sandbox.lineage.task_id,
                user=sandbox.user,
                project=sandbox.project,
                rule=Rule.EXPIRED.value,
                usage=usage,
                detail=f"{Kind.DESTROY.value} {sandbox.id}: its deadline {stamp(due)} has passed; "
                "its deadline timer expired it (sliceboxd expire)"[:500],
            )
        )

    def _remove(self, sandbox: Sandbox, deadline: datetime | None) -> Result:
        try:
            self._sandboxes.remove_container(sandbox.container_id)
            self._sandboxes.forget(sandbox)  # its credentials, its workspace volume if due
            self._stop_other_timers(sandbox.id, deadline)
            # The slices stay: the agent's reaper stops them past their grace. This process
            # cannot see the agent's creates in flight, so stopping a slice here could race one
            # placing a sandbox into it (which systemd would then re-create without ceilings).
        except SliceboxError as exc:
            log.warning("%s: removal failed (%s); killing its scope", sandbox.id, exc)
            self._kill_scope(sandbox.container_id)
            return Result.KILLED
        log.info("%s expired at its deadline %s", sandbox.id, stamp(deadline or self._clock()))
        return Result.EXPIRED

    def _stop_other_timers(self, sandbox_id: str, deadline: datetime | None) -> None:
        """Stop what else is armed for it, but not its own timer: stopping the unit that
        started this very process would only risk the process. Timers bound to the scope
        (every one this version arms) have stopped with it already; this is for those armed
        before timers were bound."""
        deadlines = self._sandboxes.deadlines
        if deadlines is None:
            return
        own = timer_unit(sandbox_id, deadline) if deadline is not None else ""
        deadlines.stop([t for t in deadlines.timers_of(sandbox_id) if t.unit != own])

    def _kill(self, sandbox_id: str, container_id: str, due: datetime, why: str) -> Result:
        """Docker did not answer: find the scope in the slice tree, audit, kill it."""
        scope = find_scope(self._usage.cgroups.files, container_id)
        if scope is None:
            log.info("%s: no scope of container %s runs; nothing to kill", sandbox_id, container_id)
            return Result.GONE
        if not self._due(sandbox_id, None, due):
            return Result.NOT_DUE
        where = SandboxCgroups.of_scope(scope)
        user, project = _owner(where)
        usage = self._final_usage(where, None)
        self._auditor.record(
            AuditRecord(
                event=AuditEvent.REAPER_ACTION,
                sandbox_id=sandbox_id,
                user=user,
                project=project,
                rule=Rule.EXPIRED.value,
                usage=usage,
                detail=f"kill {sandbox_id}: its deadline {stamp(due)} has passed; its deadline "
                f"timer killed its scope through systemd (Docker did not answer: {why}); the "
                "reaper removes the container"[:500],
            )
        )
        self._kill_scope(container_id)
        return Result.KILLED

    def _final_usage(
        self, where: SandboxCgroups, meta: SandboxMeta | None
    ) -> dict[str, object] | None:
        """The usage for the record; a read that fails costs the numbers, not the expiry."""
        try:
            return self._usage.final_usage(where, meta, self._clock()).to_wire()
        except Exception:
            log.exception("could not read the final usage of %s", where.scope)
            return None

    def _kill_scope(self, container_id: str) -> None:
        try:
            self._systemd.kill(scope_name(container_id), signal.SIGKILL)
        except SliceboxError as exc:
            if exc.code != "no_such_unit":
                raise
            log.info("the scope of %s stopped already", container_id)

    def _pid(self, container_id: str) -> int | None:
        try:
            return self._backend.sandbox_pid(container_id)
        except SliceboxError:
            return None


def _owner(where: SandboxCgroups) -> tuple[str, str]:
    """The user and project a scope's slice names say (no labels needed)."""
    try:
        user, project = parse_slice(where.project.rsplit("/", 1)[-1])
    except SliceboxError:
        return "", ""
    return user, project or ""
