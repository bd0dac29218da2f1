"""The reaper's executor: observe the real host, plan (:mod:`slicebox.core.reaping`), act.

Actions run one at a time; a failed action is audited and the rest go on. ``dry_run`` stops
after planning. Passes are serialized. The executor remembers, in memory only, since when each
slice has been seen empty, so that the planner stops it once its grace is over; a restarted
agent starts every grace again, which only keeps a slice a little longer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from slicebox.backends.base import Removal, SandboxBackend, SandboxInfo, SnapshotEngine
from slicebox.core.credentials import CredentialStore
from slicebox.core.deadlines import Timer
from slicebox.core.instruments import NOWHERE, Instruments
from slicebox.core.reaping import FinalUsage, Observed, plan_pass
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.journal import Auditor
from slicebox.model.audit import AuditEvent, AuditRecord
from slicebox.model.config import ReaperConfig
from slicebox.model.errors import HostError, NotFound, SliceboxError
from slicebox.model.labels import VOLUME_MARK, selector
from slicebox.model.reaper import Action, Kind, Outcome, Report, Rule
from slicebox.model.snapshots import LABEL, Released, released

log = logging.getLogger(__name__)


class PoolView(Protocol):
    """What the reaper asks of the warm pool (``core.pool.WarmPool``)."""

    def trims(self) -> dict[str, tuple[int, float]]: ...

    def ready_since(self) -> dict[str, datetime]: ...

    def withdraw(self, sandbox_id: str) -> bool: ...


class Reaper:
    """Observe the host, plan, and carry the plan out (or only show it)."""

    def __init__(
        self,
        sandboxes: SandboxManager,
        slices: SliceManager,
        backend: SandboxBackend,
        *,
        auditor: Auditor,
        config: Callable[[], ReaperConfig],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        final_usage: FinalUsage | None = None,
        pool: PoolView | None = None,
        instruments: Instruments = NOWHERE,
        images: SnapshotEngine | None = None,
    ) -> None:
        """``images``: the engine's snapshot images, whose released ones a pass removes."""
        self.instruments = instruments  # each action counted by rule and outcome
        self._images = images
        self._listed: list[SandboxInfo] = []  # the last pass's listing (``listed``)
        self._pool = pool
        self._sandboxes = sandboxes
        self._slices = slices
        self._backend = backend
        self._auditor = auditor
        self._config = config
        self._clock = clock
        self._final_usage = final_usage
        self._adopted: set[str] = set()
        self._empty_since: dict[str, datetime] = {}  # slice unit -> seen empty since
        self._pass = threading.Lock()  # one pass at a time: periodic and on demand

    @property
    def adopted(self) -> frozenset[str]:
        return frozenset(self._adopted)

    def observe(self) -> Observed:
        deadlines = self._sandboxes.deadlines
        state_dir = self._config().state_dir
        return Observed(
            instance_id=self._sandboxes.instance_id,
            # in flight first: a create that finishes meanwhile is then seen as a container,
            # and as busy if it leaves in flight holding its sandbox (a one-shot's)
            in_flight=self._sandboxes.in_flight(),
            busy=self._sandboxes.busy(),
            containers=self._backend.find(selector()),
            slices=self._slices.running_slices(),
            timers=deadlines.leased() if deadlines is not None else [],
            state_dirs=sorted(p.name for p in _children(state_dir)),
            volumes=self._backend.volumes({VOLUME_MARK: "true"}),
            released=self._released(),
            adopted=self.adopted,
            empty_since=self._seen_empty_since(),
            pools=self._pool.trims() if self._pool is not None else {},
            ready_since=self._pool.ready_since() if self._pool is not None else {},
        )

    def _released(self) -> list[Released]:
        """The released snapshot images; none when the engine cannot say (a host running
        native sandboxes only while Docker is down): the next pass looks again."""
        if self._images is None:
            return []
        try:
            return released(self._images.images({LABEL: "true"}))
        except SliceboxError as exc:
            log.info("reaper: snapshot images not listed: %s", exc.message)
            return []

    def listed(self) -> list[SandboxInfo]:
        """Every backend's sandboxes as the last pass listed them (at start, then every
        interval): what a scrape knows of sandboxes without asking a backend itself."""
        return self._listed

    def _seen_empty_since(self) -> dict[str, datetime]:
        """Since when each slice is empty: the first pass that saw it so, or the last destroy
        in it since, whichever is later (a slice used between passes starts its grace anew)."""
        vacated = self._sandboxes.vacated()
        return {unit: max(at, vacated.get(unit, at)) for unit, at in self._empty_since.items()}

    def run(self, *, dry_run: bool = False) -> Report:
        with self._pass:
            return self._run(dry_run=dry_run)

    def _run(self, *, dry_run: bool) -> Report:
        now = self._clock()
        listed_at = time.monotonic()
        mark = self._sandboxes.commitments.mark()
        observed = self.observe()
        self._listed = observed.containers
        actions, empty_since = plan_pass(observed, now, self._config())
        report = Report(dry_run=dry_run, at=now, instance_id=observed.instance_id, plan=actions)
        if dry_run:
            return report
        self._empty_since = empty_since
        outcomes = [self._carry_out(action) for action in actions]
        self._sync_egress(observed, listed_at)
        # What admission counts, in line with the listing (core.commitments).
        self._sandboxes.sync_commitments(observed.containers, mark)
        self._sandboxes.sweep_staging()
        if actions:
            log.info("reaper: %d actions, %d ok", len(actions), _count_ok(outcomes))
        return report.model_copy(update={"outcomes": outcomes})

    def _sync_egress(self, observed: Observed, listed_at: float) -> None:
        try:
            self._sandboxes.sync_egress(observed.containers, listed_at)
        except Exception:  # the pass's actions are done and audited; the next pass retries
            log.exception("reaper: could not bring the egress rules in line")

    def _carry_out(self, action: Action) -> Outcome:
        usage: dict[str, object] | None = None
        try:
            done, usage = self._apply(action)
            outcome = Outcome(action=action, result="ok" if done else "skipped")
        except _Deferred as exc:
            log.info("reaper: %s %s deferred: %s", action.kind, action.target, exc)
            outcome = Outcome(action=action, result="deferred", message=str(exc))
        except SliceboxError as exc:
            log.warning("reaper: %s %s failed: %s", action.kind, action.target, exc.message)
            outcome = Outcome(action=action, result=exc.code, message=exc.message)
        except Exception as exc:
            log.exception("reaper: %s %s failed", action.kind, action.target)
            outcome = Outcome(action=action, result="internal", message=str(exc))
        self.instruments.reaped(action.rule.value, outcome.result)
        self._auditor.record(
            AuditRecord(
                event=AuditEvent.REAPER_ACTION,
                result=outcome.result,
                sandbox_id=action.sandbox_id,
                root_task_id=action.root_task_id,
                user=action.user,
                project=action.project,
                rule=action.rule.value,
                usage=usage,
                detail=f"{action.kind.value} {action.target}: {action.reason}"[:500],
            )
        )
        return outcome

    def _apply(self, action: Action) -> tuple[bool, dict[str, object] | None]:
        if not action.sandbox_id or action.kind in (Kind.ADOPT, Kind.STOP_SLICE):
            return self._act(action)
        # Checked when acting, not only when planning: a create, exec or destroy that began
        # after the plan was made keeps its sandbox; the next pass looks again.
        with self._sandboxes.claim(action.sandbox_id) as free:
            if not free:
                raise _Deferred(f"{action.sandbox_id} has an operation in flight; next pass")
            return self._act(action)

    def _act(self, action: Action) -> tuple[bool, dict[str, object] | None]:
        if action.kind is Kind.DESTROY:
            return self._destroy(action)
        steps: dict[Kind, Callable[[Action], bool]] = {
            Kind.REMOVE_CONTAINER: lambda a: self._sandboxes.remove_container(a.container_id),
            Kind.ADOPT: self._adopt,
            Kind.ARM_DEADLINE: self._arm,
            Kind.STOP_TIMER: self._stop_timer,
            Kind.REMOVE_FILES: lambda a: self._remove_files(a.sandbox_id),
            Kind.STOP_SLICE: lambda a: self._sandboxes.stop_slice_if_idle(a.target),
            Kind.REMOVE_VOLUME: lambda a: self._backend.remove_volume(a.target),
            Kind.REMOVE_IMAGE: self._remove_image,
        }
        return steps[action.kind](action), None

    def _remove_files(self, sandbox_id: str) -> bool:
        """A gone sandbox's state directory (its credentials), taken back and removed."""
        removed = CredentialStore(self._config().state_dir).remove(sandbox_id)
        if not removed and (self._config().state_dir / sandbox_id).exists():
            raise HostError(f"the files of {sandbox_id} could not be removed; see the log")
        return removed

    def _remove_image(self, action: Action) -> bool:
        """A released snapshot image, unless a container still runs it (skipped: the engine
        keeps it for the next pass)."""
        if self._images is None:
            return False
        return self._images.remove_image(action.target) is Removal.REMOVED

    def _adopt(self, action: Action) -> bool:
        self._adopted.add(action.sandbox_id)
        return True

    def _arm(self, action: Action) -> bool:
        try:
            sandbox = self._sandboxes.get(action.sandbox_id)
        except NotFound:  # destroyed since the plan was made: nothing left to arm
            log.info("reaper: %s is gone since the plan; no deadline to arm", action.sandbox_id)
            return False
        self._sandboxes.arm_deadline(sandbox)
        return True

    def _stop_timer(self, action: Action) -> bool:
        deadlines = self._sandboxes.deadlines
        if deadlines is None or action.deadline is None:
            return False
        deadlines.stop(
            [Timer(unit=action.target, sandbox_id=action.sandbox_id, at=action.deadline)]
        )
        return True

    def _destroy(self, action: Action) -> tuple[bool, dict[str, object] | None]:
        try:
            sandbox = self._sandboxes.get(action.sandbox_id)
        except SliceboxError:
            return False, None
        if sandbox.lineage.pool and not self._pool_may_go(sandbox, action.rule):
            return False, None
        gone, usage = self._sandboxes.destroy_sandbox(sandbox, self._final_usage or _no_usage)
        self._adopted.discard(sandbox.id)
        return gone, usage

    def _pool_may_go(self, sandbox: Sandbox, rule: Rule) -> bool:
        """Looked at again under the claim, as it is now: an idle member goes once the pool has
        let go of it (an acquire taking it now defers it); one acquired since the plan is no
        longer the pool rules' (the others, an expiry, still apply)."""
        if sandbox.lease is not None:
            return rule not in (Rule.POOL_SURPLUS, Rule.POOL_IDLE)
        if self._pool is not None and not self._pool.withdraw(sandbox.id):
            raise _Deferred(f"{sandbox.id} is being acquired from its pool; next pass")
        return True


def _no_usage(sandbox: Sandbox) -> None:
    return None


class _Deferred(Exception):
    """An action left for the next pass: its sandbox has an operation in flight."""


def _children(directory: Path) -> list[Path]:
    try:
        return [entry for entry in directory.iterdir() if entry.is_dir()]
    except FileNotFoundError:
        return []


def _count_ok(outcomes: list[Outcome]) -> int:
    return sum(1 for outcome in outcomes if outcome.result == "ok")
