"""The agent's core: every action a caller can take, with its authorization and its audit.

The HTTP layer (:mod:`slicebox.server.routes`) only parses and serializes; this module decides
who may do what and records it. A caller sees only its own user's sandboxes: another user's sandbox
answers exactly like one that does not exist (``not_found``). Each action writes one audit
record, refusals included, with the caller the kernel identified; an exec's record says how it
ended, abandoned included (:mod:`slicebox.core.execaudit`); a file transfer's, how much it
moved and how it ended (:mod:`slicebox.core.files`). Every exec reserves the memory its
output may take from one budget shared by all callers (:mod:`slicebox.core.budget`), each user
within its share; streams and transfers in flight are bound for all and per user too
(:mod:`slicebox.core.shares`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Callable
from datetime import UTC, datetime

from slicebox.core.blocking import Aside, Blocking
from slicebox.core.budget import OutputBudget
from slicebox.core.capacity import Capacities
from slicebox.core.children import Children
from slicebox.core.egress import EgressGuard
from slicebox.core.execaudit import audited, audited_exec, subject
from slicebox.core.execution import ExecEngine, result_of
from slicebox.core.files import Files
from slicebox.core.holdings import Holdings
from slicebox.core.instruments import NOWHERE, Instruments
from slicebox.core.launch import LAUNCHER, can_launch
from slicebox.core.nesting import InnerSockets, reaches
from slicebox.core.pool import WarmPool
from slicebox.core.reaper import Reaper
from slicebox.core.sandboxes import Sandbox, SandboxManager
from slicebox.core.shares import STREAMS, Reservation, Slots
from slicebox.core.snapshots import Snapshots
from slicebox.core.telemetry import TreeReader, UsageReader
from slicebox.core.views import Views, view_of
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.api import (
    CreateSandbox,
    Destroyed,
    Extend,
    ReapRequest,
    RunRequest,
    RunResult,
    SandboxView,
)
from slicebox.model.audit import AuditEvent
from slicebox.model.capacity import Capacity, CapacityQuery
from slicebox.model.config import DEFAULT_EXEC_OUTPUT_BUDGET
from slicebox.model.errors import (
    Forbidden,
    NotFound,
    SliceboxError,
)
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult, StreamChunk
from slicebox.model.pool import PoolList
from slicebox.model.reaper import Report
from slicebox.model.spec import SandboxSpec
from slicebox.model.usage import LevelNode, ResourceUsage

log = logging.getLogger(__name__)

# What a destroy reads of a sandbox just before removing it: its final usage.
LastLook = Callable[[Sandbox], ResourceUsage | None]


def _read(usage: ResourceUsage | None, sandbox: Sandbox) -> ResourceUsage | None:
    """A last look that was taken already (a run's, before it answered)."""
    return usage


class Service(Holdings):
    def __init__(
        self,
        sandboxes: SandboxManager,
        engine: ExecEngine,
        *,
        usage: UsageReader,
        tree: TreeReader,
        auditor: Auditor,
        pid_of: Callable[[Sandbox], int | None],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        reaper: Reaper | None = None,
        budget: OutputBudget | None = None,
        pool: WarmPool | None = None,
        egress: EgressGuard | None = None,
        instruments: Instruments = NOWHERE,
        inner: InnerSockets | None = None,
    ) -> None:
        self.instruments = instruments  # what it counts for GET /metrics (core.instruments)
        self._clock = clock
        self._egress = egress
        self._pool = pool
        self._reaper = reaper
        self._budget = budget or OutputBudget.fixed(DEFAULT_EXEC_OUTPUT_BUDGET)
        self._sandboxes = sandboxes
        self._engine = engine
        self._auditor = auditor
        self._views = Views(
            sandboxes, usage=usage, tree=tree, pid_of=pid_of, clock=clock, egress=egress
        )
        # Files in and out (core/files.py): the same look-up, operation mark and engine.
        self.files = Files(engine, auditor, sandboxes, self._looked_up)
        # Streamed execs and runs in flight, bound for all and per user (core/shares.py).
        self.streams = Slots(STREAMS, lambda: sandboxes.config.shares)
        self._capacities = Capacities(sandboxes, pool)  # what fits (core/capacity.py)
        self._children = Children(sandboxes, inner, clock)  # nested sandboxes' (core/nesting.py)
        self.snapshots: Snapshots | None = None  # pause, snapshots, forks (core/snapshots.py)

    # --- sandboxes -------------------------------------------------------------------------

    # Every call that blocks takes a ``Blocking`` (core.blocking), through which its Docker,
    # systemd and cgroupfs steps run. A create, a destroy and a deadline's change run to their
    # end even when their caller is cancelled meanwhile: what they make is never half made.

    async def create(
        self, who: Identity, request: CreateSandbox, blocking: Blocking
    ) -> SandboxView:
        return view_of(await asyncio.shield(self._create(who, request, blocking)))

    async def list_sandboxes(self, who: Identity, blocking: Blocking) -> list[SandboxView]:
        labels = {} if who.is_admin else {"user": who.user_name}
        found = await blocking(functools.partial(self._sandboxes.find, **labels))
        return [view_of(sandbox) for sandbox in found if reaches(who, sandbox)]

    async def get(self, who: Identity, sandbox_id: str, blocking: Blocking) -> SandboxView:
        """The sandbox with the deadline systemd holds for it now. Another user's is refused
        before systemd is asked anything about it; a pool member's user is its lease's, read
        first."""
        sandbox = await self._sandboxes.look_up(sandbox_id)
        if not sandbox.lineage.pool:
            self._visible_to(who, sandbox, sandbox_id)
        current = await blocking(functools.partial(self._sandboxes.with_deadline, sandbox))
        return view_of(self._visible_to(who, current, sandbox_id))

    async def destroy(self, who: Identity, sandbox_id: str, blocking: Blocking) -> Destroyed:
        """Idempotent: a sandbox already gone (or never the caller's) is ``destroyed: false``.
        Its look-up is made on the event loop (as an exec's is), the rest through
        ``blocking``. A sandbox the agent knows (it made it, or looked it up before) needs no
        look-up: what a destroy reads of it never changes; one gone since answers false, as the
        second of two destroys does."""
        try:
            known = self._sandboxes.known(sandbox_id)
            sandbox = (
                self._visible_to(who, known, sandbox_id)
                if known is not None
                else await self._looked_up(who, sandbox_id, blocking)
            )
        except NotFound:
            return Destroyed(id=sandbox_id, destroyed=False)
        return await asyncio.shield(self._destroy(who, sandbox, blocking))

    async def destroy_tree(
        self, who: Identity, root_task_id: str, blocking: Blocking
    ) -> list[Destroyed]:
        """Every sandbox of a root task the caller may see, children before parents."""
        found = await blocking(functools.partial(self._sandboxes.find, root_task_id=root_task_id))
        members = [
            s
            for s in found
            if who.may_see(s.user)
            and s.pool_state != "idle"  # the pool's, no task's
            and reaches(who, s)
        ]
        members.sort(key=lambda s: -s.lineage.depth)
        return [await asyncio.shield(self._destroy(who, s, blocking)) for s in members]

    async def extend(
        self, who: Identity, sandbox_id: str, request: Extend, blocking: Blocking
    ) -> SandboxView:
        sandbox = await self._looked_up(who, sandbox_id, blocking)
        await self._children.check_extend(who, sandbox, request.ttl_seconds, blocking)
        return await asyncio.shield(self._extend(who, sandbox, request.ttl_seconds, blocking))

    async def _extend(
        self, who: Identity, sandbox: Sandbox, ttl_seconds: int, blocking: Blocking
    ) -> SandboxView:
        event = AuditEvent.DEADLINE_CHANGED
        async with audited(self._auditor, event, who, blocking, **subject(sandbox)) as record:
            extend = functools.partial(self._sandboxes.extend, sandbox.id, ttl_seconds)
            extended = await blocking(extend)
            expires = extended.expires_at.isoformat() if extended.expires_at else "none"
            record["detail"] = f"expires_at {expires}"
            return view_of(extended)

    async def reap(self, who: Identity, request: ReapRequest, blocking: Blocking) -> Report:
        """One reaper pass now (admins only: it acts on every user's sandboxes)."""
        if not who.is_admin:
            raise Forbidden("only root and members of group slicebox-admin may run the reaper")
        if self._reaper is None:
            raise NotFound("this agent runs no reaper")
        return await blocking(functools.partial(self._reaper.run, dry_run=request.dry_run))

    def pools(self, who: Identity) -> PoolList:
        """The warm pools: every one for admins, the caller's own user's for everyone else."""
        found = self._pool.stats() if self._pool is not None else PoolList(pools=[], cold=0)
        if who.is_admin:
            return found
        own = [p for p in found.pools if p.key.user == who.user_name]
        return found.model_copy(update={"pools": own})

    def final_usage_wire(self, sandbox: Sandbox) -> dict[str, object] | None:
        """The final usage as the audit records it (for the reaper's destroys)."""
        usage = self._views.final_usage(sandbox)
        return usage.to_wire() if usage else None

    async def _create(
        self, who: Identity, request: CreateSandbox, blocking: Blocking, *, one_shot: bool = False
    ) -> Sandbox:
        """``create``; ``one_shot``: a run's, returned with an operation held on it (see
        ``SandboxManager.create``) that ``_finish_run`` ends."""
        made: Sandbox | None = None
        event = AuditEvent.SANDBOX_CREATED
        try:
            async with audited(
                self._auditor, event, who, blocking, project=request.project
            ) as record:
                place: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                if who.within:  # a nested sandbox's child (core.nesting), never a pool's
                    request, place = await self._children.child(who, request, blocking)
                user = who.acting_user(request.user)
                spec = SandboxSpec.model_validate({**request.model_dump(), "user": user})
                # The kernel's word for the caller's own ids; another user's are looked up.
                owner = who.owner if user == who.user_name else None
                if self._pool is not None and not who.within and spec.nested is None:
                    acquire = functools.partial(
                        self._pool.acquire, spec, owner=owner, one_shot=one_shot
                    )
                    made = await blocking(acquire)
                if made is not None:
                    record["detail"] = f"from warm pool {made.lineage.pool_key}"
                with place:
                    made = made or await self._sandboxes.create(
                        spec, blocking, one_shot=one_shot, owner=owner, caller=who
                    )
                record.update(subject(made))
                await self._children.opened(made, blocking)
                if made.lineage.credentials:  # that they were, never what they are
                    record["detail"] = f"credentials delivered: {made.lineage.credentials}"
        except BaseException:
            if made is not None and one_shot:  # made, but its record failed: no run follows
                self._sandboxes.end_operation(made.id)  # the reaper removes it (run_ended)
            raise
        return made

    async def _finish_run(
        self, who: Identity, sandbox: Sandbox, last_look: LastLook, blocking: Blocking
    ) -> None:
        """Destroy a run's sandbox, then end the operation its create left held. The run has
        answered, or answers whatever this does: a failure is logged and audited (its
        ``sandbox_destroyed`` record says the code), never raised, and the reaper removes the
        sandbox later (``run_ended``)."""
        try:
            await self._destroy(who, sandbox, blocking, last_look)
        except Exception:
            log.exception("could not remove %s after its run; the reaper will", sandbox.id)
        finally:
            self._sandboxes.end_operation(sandbox.id)

    async def _destroy(
        self, who: Identity, sandbox: Sandbox, blocking: Blocking, last_look: LastLook | None = None
    ) -> Destroyed:
        """``destroyed`` says whether this call removed it: of two destroys at once (or one and
        the reaper's), the other answers false. ``last_look`` gives the final usage (by default
        it is read from the cgroup just before the removal)."""
        for below in await self._children.subtree(sandbox, blocking):  # deepest first
            await self._destroy(who, below, blocking)
        event = AuditEvent.SANDBOX_DESTROYED
        async with audited(self._auditor, event, who, blocking, **subject(sandbox)) as record:
            look = last_look or self._views.final_usage
            pool = self._pool
            if pool is not None and pool.takes_back(sandbox):
                usage = await blocking(functools.partial(look, sandbox))
                if await blocking(functools.partial(pool.release, sandbox)):
                    record["usage"] = usage.to_wire() if usage else None
                    record["detail"] = "released: reset and back in its reuse pool"
                    return Destroyed(id=sandbox.id, destroyed=True, usage=usage)
                look = functools.partial(_read, usage)
            destroy = functools.partial(self._sandboxes.destroy_sandbox, sandbox, look)
            gone, usage = await blocking(destroy)
            await self._children.closed(sandbox)
            record["usage"] = usage.to_wire() if usage else None
            if not gone:
                record["detail"] = "gone already: another removal took it"
            return Destroyed(id=sandbox.id, destroyed=gone, usage=usage)

    # --- exec ------------------------------------------------------------------------------

    def exec_stream(
        self,
        who: Identity,
        sandbox_id: str,
        request: ExecRequest,
        held: Reservation | None,
        blocking: Blocking,
    ) -> AsyncGenerator[ExecEvent, None]:
        """An exec's kept output as it comes, then its result. ``held``: the caller's
        reservation for it (else one of the call's, released when the stream ends). The output
        is read on the event loop; every short blocking step (the sandbox's lease, the cgroup,
        the audit record) runs through ``blocking``. Closing it early (or cancelling its
        reader) kills the exec, then audits it ``abandoned``, then releases its reservation."""
        return self._exec_stream(who, sandbox_id, request, held, blocking)

    async def _exec_stream(
        self,
        who: Identity,
        sandbox_id: str,
        request: ExecRequest,
        held: Reservation | None,
        blocking: Blocking,
        *,
        known: Sandbox | None = None,
        launch: bool = False,
    ) -> AsyncGenerator[ExecEvent, None]:
        """``exec_stream``; ``known``: a sandbox this call's caller created, which is not looked
        up again; ``launch``: the command goes to the sandbox's waiter (``core.launch``: a
        one-shot run's fresh sandbox), not a Docker exec."""
        async with (
            self._holding(who, request.output_cap, held, blocking=blocking, sandbox_id=sandbox_id),
            audited_exec(self._auditor, who, sandbox_id, blocking, self.instruments) as tally,
        ):
            sandbox = known or await self._looked_up(who, sandbox_id, blocking)
            tally.found(sandbox)
            self._sandboxes.begin_operation(sandbox.id)
            try:
                start = self._engine.launch if launch else self._engine.stream
                events = start(sandbox.container_id, request, blocking, sandbox.running_scope())
                async with contextlib.aclosing(events):
                    async for event in events:
                        yield tally.saw(event)
            finally:
                self._sandboxes.end_operation(sandbox.id)

    async def exec(
        self,
        who: Identity,
        sandbox_id: str,
        request: ExecRequest,
        held: Reservation | None,
        blocking: Blocking,
    ) -> ExecResult:
        """Run to the end: ``exec_stream`` read to its end (so it is audited as run, not
        abandoned at its result)."""
        return await result_of(self._exec_stream(who, sandbox_id, request, held, blocking))

    async def run(
        self,
        who: Identity,
        request: RunRequest,
        held: Reservation | None,
        blocking: Blocking,
        aside: Aside | None = None,
    ) -> RunResult:
        """Create, exec, destroy; the sandbox is destroyed whatever the exec did. The output
        budget is reserved first: a busy agent refuses the run before creating anything. The
        create runs through ``blocking``, the command is handed to the sandbox's waiter
        (``core.launch``) or run as ``exec``. The command and the removal act on the sandbox
        the create returned: neither looks it up.

        Once the command has its result, the final usage is read and the run answers: the
        removal (Docker's, the scope's stop, which stops its deadline timer, the
        ``sandbox_destroyed`` record) goes on after the answer through ``aside`` when it takes
        it, else before the answer through ``blocking``. It holds the sandbox's operation until
        it is over (the reaper leaves the sandbox alone), it is handed over or run even when the
        caller is cancelled meanwhile, and a failed one is logged and audited for the reaper to
        finish."""
        ran: RunResult | None = None
        events = self._run_events(who, request, held, blocking, aside)
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, RunResult):
                    ran = event
        if ran is None:  # pragma: no cover - the run's events end with its result
            raise SliceboxError("the run ended without a result")
        return ran

    def run_stream(
        self,
        who: Identity,
        request: RunRequest,
        held: Reservation | None,
        blocking: Blocking,
        aside: Aside | None = None,
    ) -> AsyncGenerator[StreamChunk | RunResult, None]:
        """``run`` with the command's output as it comes: its kept chunks, then the
        ``RunResult`` (whose result keeps the same heads). Closing it early kills the command
        (audited ``abandoned``), and the sandbox is removed all the same."""
        return self._run_events(who, request, held, blocking, aside)

    async def _run_events(
        self,
        who: Identity,
        request: RunRequest,
        held: Reservation | None,
        blocking: Blocking,
        aside: Aside | None,
    ) -> AsyncGenerator[StreamChunk | RunResult, None]:
        output_cap = request.exec.output_cap
        async with self._holding(who, output_cap, held, blocking=blocking, action="run") as holding:
            create = self._create(who, request.sandbox, blocking, one_shot=True)
            sandbox = await asyncio.shield(create)
            last_look: LastLook = self._views.final_usage
            try:
                launch = sandbox.lineage.launcher == LAUNCHER and can_launch(request.exec)
                events = self._exec_stream(
                    who, sandbox.id, request.exec, holding, blocking, known=sandbox, launch=launch
                )
                result: ExecResult | None = None
                async with contextlib.aclosing(events):
                    async for event in events:
                        if isinstance(event, ExecResult):
                            result = event
                        else:
                            yield event
                if result is None:  # pragma: no cover - the engine always ends with its result
                    raise SliceboxError("the exec stream ended without a result")
                usage = await blocking(functools.partial(self._views.final_usage, sandbox))
                last_look = functools.partial(_read, usage)
            finally:
                removal = functools.partial(self._finish_run, who, sandbox, last_look)
                if aside is None or not aside(removal):
                    await asyncio.shield(removal(blocking))
        yield RunResult(sandbox_id=sandbox.id, result=result, usage=usage)

    # --- telemetry -------------------------------------------------------------------------

    async def usage(self, who: Identity, sandbox_id: str, blocking: Blocking) -> ResourceUsage:
        sandbox = await self._looked_up(who, sandbox_id, blocking)
        return await blocking(functools.partial(self._views.usage, sandbox))

    async def level_tree(self, who: Identity, blocking: Blocking) -> LevelNode:
        """The whole tree for admins; for everyone else, their own user level only."""
        tree = await blocking(self._views.tree)
        if who.is_admin:
            return tree
        own = [node for node in tree.children if node.name == who.user_name]
        if not own:
            raise NotFound(f"no sandboxes for user {who.user_name} yet; create one first")
        return own[0]

    async def capacity(self, who: Identity, query: CapacityQuery, blocking: Blocking) -> Capacity:
        """What each level has left and how many of a shape fit, as admission counts them."""
        return await self._capacities.answer(who, query, blocking)

    # --- authorization and audit -----------------------------------------------------------

    async def _looked_up(self, who: Identity, sandbox_id: str, blocking: Blocking) -> Sandbox:
        """The sandbox looked up on the running event loop, if the caller may see it; a pool
        member's lease is read through ``blocking`` (a systemd call)."""
        sandbox = await self._sandboxes.found(sandbox_id, blocking)
        return self._visible_to(who, sandbox, sandbox_id)

    @staticmethod
    def _visible_to(who: Identity, sandbox: Sandbox, sandbox_id: str) -> Sandbox:
        # An idle pool member is the pool's until an acquire leases it: no one may use it;
        # a nested sandbox's request reaches its descendants alone (core.nesting).
        hidden = sandbox.pool_state == "idle" or not reaches(who, sandbox)
        if not who.may_see(sandbox.user) or hidden:
            # The same answer as for a sandbox that does not exist: nothing leaks.
            raise NotFound(f"no sandbox {sandbox_id}; list sandboxes to see the ids")
        return sandbox
