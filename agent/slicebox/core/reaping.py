"""The reaper's plan: what should not exist any more, found from Docker's labels and systemd alone.

:func:`plan` is pure: given what is observed (managed containers, running slices, deadline
timers, per-sandbox state directories, creates in progress) and the time, it returns the
actions, in the order they must run. :class:`Reaper` observes the real host, plans, and
carries the plan out one action at a time (a failed action is audited and the rest go on);
``dry_run`` stops after planning. The agent runs a pass at start-up, before it answers
anyone (that pass is the reconciliation: orphans adopted, missing deadlines re-armed,
leftovers of a crash removed), then every ``reaper.interval_seconds``.

The rules, each with its :class:`Rule` name in the plan and the audit:

- ``expired``: the deadline (the latest armed timer, else the label) has passed. A deadline a
  timer holds is first the timer's: at the deadline it runs ``sliceboxd expire``
  (:mod:`slicebox.core.expiry`), which audits and removes the sandbox whether or not the agent
  runs, so the reaper takes it only :data:`TIMER_GRACE` later (the expiry failed or hangs).
  Otherwise both would audit one expiry. A deadline only the label gives is due at once.
- ``parent_gone``: the parent sandbox is gone or goes in this pass (so a tree goes whole,
  children before parents: destroys run deepest first).
- ``orphan``: made by another agent run, with the ``reap`` orphan policy; with ``adopt``
  (default) it becomes this run's (``adopt``) and its deadline still holds.
- ``missing_lineage``: labelled managed, but the lineage labels are missing or malformed.
- ``exited`` / ``never_started``: the container exited (say, killed at its deadline while the
  agent was down) or was created and never started, and no create is in progress for it.
- ``run_ended``: a running sandbox made for a one-shot run that no operation holds. A run holds
  one on its sandbox from the end of the create until the removal it starts once its exec has
  ended is over, so this is one whose agent stopped before removing it, or whose removal
  failed: no one may exec in it any more.
- ``pool_surplus``: idle warm-pool members (no lease in systemd: ``core.pool``) beyond their
  pool's size (oldest first), or beyond ``reaper.pool_size`` for a key no ``[[pool]]``
  declares any more. An acquired member is a task's sandbox like any other: never trimmed.
- ``pool_idle``: an idle member nobody acquired for its pool's ``idle_timeout_seconds``
  (since it was made, or since a reuse handed it back); the refill makes a fresh one.
- ``deadline_missing``: a running sandbox with a TTL and no timer (the agent died between
  the start and the arming): the timer is armed from the label.
- ``stale_deadline``: a timer whose sandbox is gone.
- ``leftover_files``: a state directory whose sandbox is gone.
- ``volume_orphaned``: a workspace volume without ``keep`` whose root task has no sandbox left
  (its last destroy could not remove it: a sibling still ran, or the agent stopped), and for
  whose user no create is in progress (that create may be about to mount it again). A volume
  a container still mounts is skipped: Docker refuses to remove it.
- ``snapshot_released``: an image of a snapshot its owner deleted while a fork ran it (its
  retired reference, or an untagged one an agent before retired references left) that no
  listed container runs: removed, never by force (the engine keeps one a container started
  since still runs, and the next pass looks again). Until then its bytes count against its
  owner's ``[snapshots] max_bytes`` (core.snapshots).
- ``empty_slice``: a user or project slice no sandbox and no create in progress uses, and has
  not used for ``reaper.empty_slice_grace_seconds``. Destroying a sandbox leaves its slices
  alone, so a project whose sandboxes come and go (one-shot runs) keeps them instead of making
  and stopping them for every sandbox. Since when a slice is empty is the executor's memory
  (:attr:`Observed.empty_since`; an agent restart starts the grace again), and what
  :func:`plan_pass` hands back for the next pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import NamedTuple

from pydantic import ConfigDict

from slicebox.backends.base import SandboxInfo, SandboxState, VolumeInfo
from slicebox.core.deadlines import Timer, latest
from slicebox.core.sandbox import Sandbox
from slicebox.model.base import Model
from slicebox.model.config import OrphanPolicy, ReaperConfig
from slicebox.model.errors import SliceboxError
from slicebox.model.labels import PREFIX, decode_volume, stamp
from slicebox.model.names import parse_slice
from slicebox.model.reaper import Action, Kind, Rule
from slicebox.model.snapshots import Released
from slicebox.model.spec import Backend

log = logging.getLogger(__name__)


GONE = frozenset({SandboxState.EXITED, SandboxState.DEAD})
# How long past a timer's deadline its expiry command has the sandbox to itself: it starts
# within a second (AccuracyUSec) and takes a few, Docker's removal included.
TIMER_GRACE = timedelta(seconds=60)


class Observed(Model):
    """Everything a pass looks at, gathered before planning."""

    model_config = ConfigDict(frozen=True)

    instance_id: str
    containers: list[SandboxInfo] = []  # the backend's managed sandboxes, as listed
    slices: list[str] = []  # running user and project slices
    timers: list[Timer] = []
    state_dirs: list[str] = []  # sandbox ids that have a state directory
    volumes: list[VolumeInfo] = []  # workspace volumes (labelled slicebox.volume=true)
    released: list[Released] = []  # snapshot images no snapshot names any more
    in_flight: dict[str, tuple[str, str]] = {}  # creates in progress: id -> (user, project)
    busy: frozenset[str] = frozenset()  # sandboxes an operation holds (seen after in_flight)
    adopted: frozenset[str] = frozenset()
    # Slice unit -> since when it is known to be empty; a slice not here is empty from now.
    empty_since: dict[str, datetime] = {}
    # Warm pools: key fingerprint -> (size, idle timeout in seconds); idle members back from
    # a reuse -> since when (the others are idle since they were made).
    pools: dict[str, tuple[int, float]] = {}
    ready_since: dict[str, datetime] = {}


class Plan(NamedTuple):
    actions: list[Action]
    # Every slice nothing uses once the removals are done -> since when: the next pass's
    # ``Observed.empty_since``.
    empty_since: dict[str, datetime]


def plan(observed: Observed, now: datetime, policy: ReaperConfig) -> list[Action]:
    """The actions a pass takes, in order: removals deepest first, then the bookkeeping."""
    return plan_pass(observed, now, policy).actions


def plan_pass(observed: Observed, now: datetime, policy: ReaperConfig) -> Plan:
    """:func:`plan`, and since when each unused slice is empty (for the next pass)."""
    sandboxes, removals = _sandboxes(observed)
    deadlines = latest(observed.timers)
    doomed = _doomed(observed, sandboxes, deadlines, now, policy)
    ordered = sorted(doomed, key=lambda i: (-sandboxes[i][0].lineage.depth, i))
    removals += [_about(sandboxes[i][0], Kind.DESTROY, *doomed[i]) for i in ordered]
    alive = {i: s for i, (s, _) in sandboxes.items() if i not in doomed}
    empty = _empty_slices(observed, alive)
    since = {a.target: observed.empty_since.get(a.target, now) for a in empty}
    actions = [
        *removals,
        *_adoptions(observed, alive),
        *_missing_deadlines(sandboxes, alive, deadlines, now),
        *_stale_timers(observed, sandboxes),
        *_leftover_files(observed, alive),
        *_stale_volumes(observed, alive),
        *_released_snapshots(observed, alive),
        *_past_grace(empty, since, now, policy.empty_slice_grace_seconds),
    ]
    return Plan(actions, since)


def _sandboxes(
    observed: Observed,
) -> tuple[dict[str, tuple[Sandbox, str]], list[Action]]:
    """Readable sandboxes (id -> (sandbox, status)) and removals of unreadable containers."""
    sandboxes: dict[str, tuple[Sandbox, str]] = {}
    removals: list[Action] = []
    leases = {t.sandbox_id: t for t in sorted(observed.timers, key=lambda t: t.at) if t.lease}
    for info in observed.containers:
        if info.name in observed.in_flight:
            continue
        try:
            sandbox = Sandbox.from_info(info)
        except SliceboxError as exc:
            removals.append(
                Action(
                    kind=Kind.REMOVE_CONTAINER,
                    rule=Rule.MISSING_LINEAGE,
                    target=info.id,
                    container_id=info.id,
                    # whatever labels there are, for the audit; none of them is trusted
                    sandbox_id=info.labels.get(f"{PREFIX}sandbox_id", ""),
                    user=info.labels.get(f"{PREFIX}user", ""),
                    project=info.labels.get(f"{PREFIX}project", ""),
                    reason=f"container {info.name or info.id[:12]}: {exc.message}",
                )
            )
            continue
        if sandbox.lineage.pool and sandbox.id in leases:  # an acquired member's lineage
            sandbox = sandbox.leased(leases[sandbox.id])
        if sandbox.id not in observed.in_flight:
            sandboxes[sandbox.id] = (sandbox, info.state)
    return sandboxes, removals


def _doomed(
    observed: Observed,
    sandboxes: dict[str, tuple[Sandbox, str]],
    deadlines: dict[str, datetime],
    now: datetime,
    policy: ReaperConfig,
) -> dict[str, tuple[Rule, str]]:
    doomed: dict[str, tuple[Rule, str]] = {}
    for sandbox_id, (sandbox, status) in sandboxes.items():
        deadline = deadlines.get(sandbox_id, sandbox.expires_at)
        due = _due(deadline, held=sandbox_id in deadlines)
        foreign = sandbox.lineage.instance_id != observed.instance_id
        if status in GONE:
            doomed[sandbox_id] = (Rule.EXITED, f"its container is {status}; nothing runs in it")
        elif status == "created":
            doomed[sandbox_id] = (
                Rule.NEVER_STARTED,
                "its container was created but never started, and no create is in progress",
            )
        elif deadline is not None and due is not None and due <= now:
            doomed[sandbox_id] = (Rule.EXPIRED, f"its deadline {stamp(deadline)} has passed")
        elif sandbox.lineage.oneshot and status == "running" and sandbox_id not in observed.busy:
            doomed[sandbox_id] = (
                Rule.RUN_ENDED,
                "it was made for a one-shot run that no longer holds it (the run's removal "
                "failed, or its agent stopped before removing it)",
            )
        elif foreign and sandbox_id not in observed.adopted and policy.orphans is OrphanPolicy.REAP:
            doomed[sandbox_id] = (
                Rule.ORPHAN,
                f"it was made by agent run {sandbox.lineage.instance_id}, not this one, and the "
                "orphan policy is reap",
            )
    doomed |= _pool_surplus(observed, sandboxes, doomed, now, policy.pool_size)
    _doom_children(observed, sandboxes, doomed)
    return doomed


def _due(deadline: datetime | None, *, held: bool) -> datetime | None:
    """When the reaper takes an expired sandbox: a timer's deadline a grace later."""
    if deadline is None:
        return None
    return deadline + TIMER_GRACE if held else deadline


def _pool_surplus(
    observed: Observed,
    sandboxes: dict[str, tuple[Sandbox, str]],
    doomed: dict[str, tuple[Rule, str]],
    now: datetime,
    size: int,
) -> dict[str, tuple[Rule, str]]:
    """Idle pool members past their pool's idle timeout, then beyond its size (or ``size``
    for a key no pool declares); the newest are kept. Acquired members are never here."""
    kinds: dict[str, list[Sandbox]] = {}
    for sandbox_id, (sandbox, status) in sandboxes.items():
        if sandbox.pool_state == "idle" and status == "running" and sandbox_id not in doomed:
            kinds.setdefault(_pool_kind(sandbox), []).append(sandbox)
    surplus: dict[str, tuple[Rule, str]] = {}
    for key, members in kinds.items():
        keep, timeout = observed.pools.get(key, (size, None))
        members.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        stale = [m for m in members if _idle_too_long(observed, m, now, timeout)]
        for old in stale:
            surplus[old.id] = (
                Rule.POOL_IDLE,
                f"it is an idle pool member unused for {timeout:g} s",
            )
        for extra in [m for m in members if m not in stale][keep:]:
            surplus[extra.id] = (
                Rule.POOL_SURPLUS,
                f"it is an idle pool member beyond the {keep} its pool keeps",
            )
    return surplus


def _pool_kind(member: Sandbox) -> str:
    """Its key's fingerprint; a member an agent before the warm pool made has none, and is
    grouped by owner and limits, as that agent's reaper did."""
    limits = member.limits
    legacy = f"{member.user}/{member.project}/{limits.cpus}/{limits.memory_bytes}/{limits.pids}"
    return member.lineage.pool_key or legacy


def _idle_too_long(
    observed: Observed, member: Sandbox, now: datetime, timeout: float | None
) -> bool:
    since = observed.ready_since.get(member.id, member.created_at)
    return timeout is not None and now - since >= timedelta(seconds=timeout)


def _doom_children(
    observed: Observed,
    sandboxes: dict[str, tuple[Sandbox, str]],
    doomed: dict[str, tuple[Rule, str]],
) -> None:
    """A sandbox whose parent is gone, or goes now, goes too (the whole subtree)."""
    changed = True
    while changed:
        changed = False
        for sandbox_id, (sandbox, _) in sandboxes.items():
            parent = sandbox.lineage.parent_id
            if sandbox_id in doomed or not parent or parent in observed.in_flight:
                continue
            if parent not in sandboxes or parent in doomed:
                why = "is gone" if parent not in sandboxes else "is being destroyed"
                doomed[sandbox_id] = (Rule.PARENT_GONE, f"its parent {parent} {why}")
                changed = True


def _adoptions(observed: Observed, alive: dict[str, Sandbox]) -> Iterable[Action]:
    for sandbox_id, sandbox in sorted(alive.items()):
        run = sandbox.lineage.instance_id
        if run != observed.instance_id and sandbox_id not in observed.adopted:
            reason = f"it was made by agent run {run}; this run adopts it and keeps its deadline"
            yield _about(sandbox, Kind.ADOPT, Rule.ADOPT, reason)


def _missing_deadlines(
    sandboxes: dict[str, tuple[Sandbox, str]],
    alive: dict[str, Sandbox],
    deadlines: dict[str, datetime],
    now: datetime,
) -> Iterable[Action]:
    for sandbox_id, sandbox in sorted(alive.items()):
        at = sandbox.expires_at
        if (
            sandboxes[sandbox_id][1] == "running"
            and at
            and at > now
            and sandbox_id not in deadlines
            # A remote sandbox has no unit here to bind one to: its label's deadline holds.
            and sandbox.backend != Backend.DAYTONA
        ):
            reason = f"its deadline {stamp(at)} has no timer armed"
            action = _about(sandbox, Kind.ARM_DEADLINE, Rule.DEADLINE_MISSING, reason)
            yield action.model_copy(update={"deadline": at})


def _stale_timers(observed: Observed, sandboxes: dict[str, tuple[Sandbox, str]]) -> list[Action]:
    """Timers of sandboxes with no container at all: systemd stops a timer with the scope it
    is bound to, so these are an earlier agent's, which bound none."""
    return [
        Action(
            kind=Kind.STOP_TIMER,
            rule=Rule.STALE_DEADLINE,
            target=timer.unit,
            sandbox_id=timer.sandbox_id,
            deadline=timer.at,
            reason=f"its sandbox {timer.sandbox_id} is gone",
        )
        for timer in sorted(observed.timers, key=lambda t: t.unit)
        if timer.sandbox_id not in sandboxes and timer.sandbox_id not in observed.in_flight
    ]


def _leftover_files(observed: Observed, alive: dict[str, Sandbox]) -> list[Action]:
    return [
        Action(
            kind=Kind.REMOVE_FILES,
            rule=Rule.LEFTOVER_FILES,
            target=sandbox_id,
            sandbox_id=sandbox_id,
            reason=f"its sandbox {sandbox_id} is gone; nothing needs these files",
        )
        for sandbox_id in sorted(observed.state_dirs)
        if sandbox_id not in alive and sandbox_id not in observed.in_flight
    ]


def _stale_volumes(observed: Observed, alive: dict[str, Sandbox]) -> list[Action]:
    tasks = {sandbox.lineage.root_task_id for sandbox in alive.values()}
    creating = {user for user, _ in observed.in_flight.values()}
    actions = []
    for volume in sorted(observed.volumes, key=lambda v: v.name):
        lineage = decode_volume(volume.labels)
        if lineage is None or lineage.keep or lineage.user in creating:
            continue
        if lineage.root_task_id not in tasks:
            actions.append(
                Action(
                    kind=Kind.REMOVE_VOLUME,
                    rule=Rule.VOLUME_ORPHANED,
                    target=volume.name,
                    user=lineage.user,
                    project=lineage.project,
                    root_task_id=lineage.root_task_id,
                    reason=f"its root task {lineage.root_task_id} has no sandbox left and it "
                    "is not kept",
                )
            )
    return actions


def _released_snapshots(observed: Observed, alive: dict[str, Sandbox]) -> list[Action]:
    """Released snapshot images no listed container runs: removed, the engine refusing any a
    container started since still runs. A container whose backend does not say its image
    keeps every released image of its fork's snapshot name (it may run any of them)."""
    running = {c.image_id for c in observed.containers if c.image_id}
    unknown = {c.id for c in observed.containers if not c.image_id}
    forks = {
        (s.user, s.lineage.from_snapshot)
        for s in alive.values()
        if s.lineage.from_snapshot and s.container_id in unknown
    }
    return [
        Action(
            kind=Kind.REMOVE_IMAGE,
            rule=Rule.SNAPSHOT_RELEASED,
            target=image.target,
            user=image.user,
            reason=f"it was snapshot {image.name or '?'} of {image.user or '?'}, deleted while a "
            "fork ran it, and no sandbox runs it any more",
        )
        for image in sorted(observed.released, key=lambda i: i.target)
        if image.image_id not in running and (image.user, image.name) not in forks
    ]


def _empty_slices(observed: Observed, alive: dict[str, Sandbox]) -> list[Action]:
    """User and project slices nothing uses once the removals are done; projects first."""
    used = {(s.user, s.project) for s in alive.values()} | set(observed.in_flight.values())
    users = {user for user, _ in used}
    projects, user_level = [], []
    for unit in sorted(observed.slices):
        try:
            user, project = parse_slice(unit)
        except SliceboxError:
            continue  # not a name slicebox makes: not ours to stop
        if project is None and user not in users:
            user_level.append(_slice_action(unit, user, "", f"no sandbox of user {user} is left"))
        elif project is not None and (user, project) not in used:
            reason = f"no sandbox of {user}/{project} is left"
            projects.append(_slice_action(unit, user, project, reason))
    return projects + user_level


def _past_grace(
    empty: list[Action], since: dict[str, datetime], now: datetime, grace: float
) -> list[Action]:
    """The stops of the empty slices whose grace is over; with a grace, the reason says since
    when the slice is empty."""
    due = [a for a in empty if now - since[a.target] >= timedelta(seconds=grace)]
    if not grace:
        return due
    return [
        a.model_copy(update={"reason": f"{a.reason} since {stamp(since[a.target])}"}) for a in due
    ]


def _slice_action(unit: str, user: str, project: str, reason: str) -> Action:
    return Action(
        kind=Kind.STOP_SLICE,
        rule=Rule.EMPTY_SLICE,
        target=unit,
        user=user,
        project=project,
        reason=reason,
    )


def _about(sandbox: Sandbox, kind: Kind, rule: Rule, reason: str) -> Action:
    return Action(
        kind=kind,
        rule=rule,
        target=sandbox.id,
        reason=reason,
        sandbox_id=sandbox.id,
        container_id=sandbox.container_id,
        user=sandbox.user,
        project=sandbox.project,
        root_task_id=sandbox.lineage.root_task_id,
        depth=sandbox.lineage.depth,
    )


FinalUsage = Callable[[Sandbox], "dict[str, object] | None"]
