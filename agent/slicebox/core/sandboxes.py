"""The sandbox lifecycle: create in the slice tree with security defaults, inspect, list,
destroy idempotently, cascade-destroy a task tree deepest first.

Everything a sandbox is lives in its container's immutable labels (see :mod:`slicebox.model.labels`)
and in systemd; in memory there is only what is in progress (core.operations), when a destroy
last left each slice, and which images creates found present (core.creation). A create that
fails after it made something (a container, a slice) removes what it made before the error
reaches the caller. A destroy leaves the user and project slices in place: the next sandbox of
the project (one-shot runs come and go) finds them ready, and the reaper stops them once they
have been empty for ``reaper.empty_slice_grace_seconds``.

``SandboxManager`` is what the rest of the agent calls; the rooms behind it are the sandbox
value (core.sandbox), creating one (core.creation), what is in progress (core.operations),
per-backend refusals (core.refusals), who it runs as and its host binds (core.binds), and its
workspace (core.workspaces).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

from slicebox.backends.base import SandboxBackend, SandboxInfo
from slicebox.core.admission import admitted
from slicebox.core.binds import caller_ids
from slicebox.core.blocking import Blocking, from_thread
from slicebox.core.commitments import REMOTE, Commitments, Listed
from slicebox.core.creation import (
    KEEP_ALIVE,
    Creator,
    ancestry,
    arm,
    remove_container,
)
from slicebox.core.deadlines import Deadlines, Timer, latest
from slicebox.core.egress import EgressGuard, Labelled
from slicebox.core.innerdirs import drop_inner_directory
from slicebox.core.operations import Operations
from slicebox.core.policy import Admitted, check_ttl
from slicebox.core.recent import Recent
from slicebox.core.sandbox import CONTAINER_NAME, KNOWN_SANDBOXES, Sandbox, new_sandbox_id
from slicebox.core.sandbox import found as _found
from slicebox.core.slices import SliceManager
from slicebox.core.workspaces import credential_store, release_volume
from slicebox.host.beneath import BindGuard, KernelBindGuard
from slicebox.host.identity import Identity
from slicebox.model.config import Config
from slicebox.model.errors import HostError, InvalidRequest, NotFound, SliceboxError
from slicebox.model.labels import EGRESS_ADDRESS, decode, selector
from slicebox.model.names import scope_name, slice_names
from slicebox.model.paths import NESTED_ROOT
from slicebox.model.pool import Lease
from slicebox.model.spec import Backend, SandboxSpec

# Re-exported: the callers that make sandboxes name these with the manager.
__all__ = ["KEEP_ALIVE", "Sandbox", "SandboxManager"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# Lineage an acquired pool member's lease gives, not its labels: found by filtering, not by
# Docker's label filter.
LEASED = frozenset({"root_task_id", "task_id", "parent_id"})


class SandboxManager:
    def __init__(
        self,
        backend: SandboxBackend,
        slices: SliceManager,
        *,
        config: Config,
        host_memory: int,
        instance_id: str,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        new_id: Callable[[], str] = new_sandbox_id,
        deadlines: Deadlines | None = None,
        binds: BindGuard | None = None,
        egress: EgressGuard | None = None,
        nested_root: Path = NESTED_ROOT,
    ) -> None:
        self._egress = egress
        self._nested_root = nested_root
        self._backend = backend
        self._binds: BindGuard = binds or KernelBindGuard()
        self._slices = slices
        self._config = config
        self._host_memory = host_memory
        self._instance_id = instance_id
        self._clock = clock
        self._deadlines = deadlines
        self._operations = Operations()
        self._commitments = Commitments()
        self._creator = Creator(
            backend,
            slices,
            self._binds,
            self._operations,
            self._commitments,
            host_memory=host_memory,
            instance_id=instance_id,
            clock=clock,
            new_id=new_id,
            lookup=self.found,
            deadlines=deadlines,
            egress=egress,
            nested_root=nested_root,
            shares=lambda: self._config.shares,
        )
        # Sandbox id -> the sandbox as this agent made or last looked it up (KNOWN_SANDBOXES):
        # what a destroy needs of it (its container, user, project, lineage) is its labels',
        # which never change, so a destroy of a known sandbox makes no look-up (an inspect).
        # One removed behind the agent's back (its timer's expiry, a `docker rm`) stays known
        # until a destroy finds it gone, as the second of two destroys at once does. No pool
        # member: its lease is systemd's.
        self._known: Recent[str, Sandbox] = Recent(KNOWN_SANDBOXES)

    @property
    def instance_id(self) -> str:
        return self._instance_id

    @property
    def config(self) -> Config:
        """The configuration in force (``reconfigure`` replaces it on reload)."""
        return self._config

    @property
    def deadlines(self) -> Deadlines | None:
        return self._deadlines

    @property
    def host_memory(self) -> int:
        """The host's MemTotal, the base of percentage ceilings."""
        return self._host_memory

    @property
    def commitments(self) -> Commitments:
        """What this host's sandboxes are provisioned (core.commitments): admission's count."""
        return self._commitments

    @property
    def operations(self) -> Operations:
        """What is in progress on the sandboxes (core.operations)."""
        return self._operations

    def in_flight(self) -> dict[str, tuple[str, str]]:
        """Sandbox id -> (user, project) of every create still in progress."""
        return self._operations.in_flight()

    def vacated(self) -> dict[str, datetime]:
        """Slice unit -> when a destroy last took a sandbox out of it."""
        return self._operations.vacated()

    def operation(self, sandbox_id: str) -> AbstractContextManager[None]:
        """Mark an operation on the sandbox while it runs (an exec, a destroy, an extend): the
        reaper leaves the sandbox alone until it ends."""
        return self._operations.operation(sandbox_id)

    def busy(self) -> frozenset[str]:
        """The sandboxes an operation holds now."""
        return self._operations.busy()

    def begin_operation(self, sandbox_id: str) -> None:
        """``operation`` in two calls, for async callers; never blocks on I/O."""
        self._operations.begin(sandbox_id)

    def end_operation(self, sandbox_id: str) -> None:
        self._operations.end(sandbox_id)

    def claim(self, sandbox_id: str) -> AbstractContextManager[bool]:
        """The reaper's claim, taken when it acts (not when it plans): True, and held as an
        operation until the block ends, when nothing else is in flight on the sandbox; False
        when a create or any other operation is."""
        return self._operations.claim(sandbox_id)

    def reconfigure(self, config: Config) -> None:
        """Use ``config`` from now on (``systemctl reload``); running sandboxes keep theirs."""
        self._config = config

    async def create(
        self,
        spec: SandboxSpec,
        blocking: Blocking,
        *,
        one_shot: bool = False,
        owner: tuple[int, int] | None = None,
        pool_key: str = "",
        caller: Identity | None = None,
    ) -> Sandbox:
        """Admit, place and start a sandbox; on any failure nothing is left behind.

        ``one_shot``: for a one-shot run. The sandbox is labelled so, and it is returned with
        an operation held on it, taken as it stops being in flight (no reaper pass finds it
        free in between); the caller ends it (``end_operation``) once it has removed it.
        The reaper removes a one-shot sandbox that no operation holds (``run_ended``).
        ``owner``: the (uid, gid) of the user the sandbox is for, as the kernel told the agent
        (the caller's own); left out, it is looked up by name. A host workspace runs as it.
        ``pool_key``: a warm pool's member of that key (core.pool), labelled so, with no
        deadline until it is acquired, and returned held as a one-shot's is. ``caller``: whose
        share of pulls in flight a pull this create starts takes (None: the agent's own). Each
        step that blocks runs through ``blocking``."""
        info = await self._creator.create(
            spec,
            self._config,
            blocking,
            one_shot=one_shot,
            owner=owner,
            pool_key=pool_key,
            caller=caller,
        )
        return self._remember(Sandbox.from_info(info))

    def admitted(self, spec: SandboxSpec, owner: tuple[int, int] | None = None) -> Admitted:
        """The spec through policy and admission, with who it runs as decided: what a create
        makes, and what a warm pool's key is read from (core.poolkeys.key_of)."""
        ids = caller_ids(spec, owner)
        return admitted(spec, self._config, self._host_memory, ids)

    def lease(self, member: Sandbox, spec: SandboxSpec, *, one_shot: bool) -> Sandbox:
        """Hand an idle pool member to ``spec``'s task: the lineage a create would give it,
        armed as the lease on its first deadline timer (one systemd call; ``docs/pool.md``).
        The caller holds an operation on the member and has checked the deadline exists."""
        deadlines, ttl = self._deadlines, spec.ttl_seconds or self._config.default_ttl_seconds
        if deadlines is None or ttl is None:
            raise InvalidRequest("a pool member is leased only with a deadline in systemd")
        task_id = spec.task_id or member.id
        parent = self.get(spec.parent_id) if spec.parent_id else None
        root, depth = ancestry(spec, task_id, parent)
        lease = Lease(
            task_id=task_id,
            root_task_id=root,
            parent_id=spec.parent_id or "",
            depth=depth,
            oneshot=one_shot,
        )
        at = (self._clock() + timedelta(seconds=ttl)).replace(microsecond=0)
        unit = deadlines.arm_new(member.id, member.container_id, at, lease)
        return member.leased(Timer(unit=unit, sandbox_id=member.id, at=at, lease=lease))

    def with_lease(self, sandbox: Sandbox) -> Sandbox:
        """A pool member with the lease systemd holds for it (one call); others as they are."""
        if not sandbox.lineage.pool or self._deadlines is None:
            return sandbox
        timers = sorted(self._deadlines.leased(sandbox.id), key=lambda t: t.at)
        return sandbox.leased(timers[-1]) if timers else sandbox

    def sweep_staging(self) -> list[str]:
        """Remove the staging points no create in flight holds (a killed agent's); their ids.
        Listed before the creates in flight are read: one that starts staging after the list
        is not in it."""
        staged = self._binds.staged()
        flying = set(self._operations.in_flight())
        orphans = [sandbox_id for sandbox_id in staged if sandbox_id not in flying]
        for sandbox_id in orphans:
            log.info("removing the staging points of %s (no create holds them)", sandbox_id)
            self._binds.unstage(sandbox_id, wait=True)
        return orphans

    def get(self, sandbox_id: str, *, current_deadline: bool = False) -> Sandbox:
        """The sandbox; with ``current_deadline`` its ``expires_at`` is the one systemd holds
        now (one more systemd call), otherwise the one its labels were created with.

        Its container is named after it, so it is looked up by name, which costs the same
        however many containers there are (a list filtered by label goes through them all);
        its labels still decide whether it is that sandbox."""
        sandbox = from_thread(lambda _: self.look_up(sandbox_id))
        if sandbox.lineage.pool or current_deadline:
            return self.with_deadline(sandbox)
        return sandbox

    def with_deadline(self, sandbox: Sandbox) -> Sandbox:
        """The sandbox with the deadline systemd holds for it now (one call): a pool member's
        lease (its lineage and deadline are the lease's), anyone else's timer."""
        if sandbox.lineage.pool:
            return self.with_lease(sandbox)
        held = self._deadlines.current_of(sandbox.id) if self._deadlines is not None else None
        return sandbox.model_copy(update={"expires_at": held}) if held else sandbox

    async def look_up(self, sandbox_id: str) -> Sandbox:
        """The sandbox, looked up on the running event loop, with the deadline its labels
        give (``get`` adds what systemd holds). A pool member comes without its lease, which
        is systemd's: the caller reads it (``with_lease``)."""
        named = CONTAINER_NAME.fullmatch(sandbox_id)
        info = await self._backend.inspect(sandbox_id) if named else None
        return self._remember(_found(info, sandbox_id))

    async def found(self, sandbox_id: str, blocking: Blocking) -> Sandbox:
        """``look_up``, with a pool member's lease read through ``blocking`` (a systemd
        call): its lineage as its task sees it."""
        sandbox = await self.look_up(sandbox_id)
        if sandbox.lineage.pool:
            sandbox = await blocking(functools.partial(self.with_lease, sandbox))
        return sandbox

    def known(self, sandbox_id: str) -> Sandbox | None:
        """The sandbox as this agent made or last looked it up, if it did: its lineage is
        current (labels never change), its state may not be, and it may be gone since."""
        return self._known.get(sandbox_id)

    def _remember(self, sandbox: Sandbox) -> Sandbox:
        if not sandbox.lineage.pool:
            self._known.put(sandbox.id, sandbox)
        return sandbox

    def find(self, **labels: str) -> list[Sandbox]:
        """Sandboxes whose lineage matches, e.g. ``find(user='alice', root_task_id='t1')``: by
        Docker's label filter, but for the task ids, which an acquired pool member's lease
        holds (its labels say its own id), and which are compared once the leases are read."""
        fixed = {key: value for key, value in labels.items() if key not in LEASED}
        found = [Sandbox.from_info(info) for info in self._backend.find(selector(**fixed))]
        wanted = {key: value for key, value in labels.items() if key in LEASED}
        return [
            sandbox
            for sandbox in self._with_deadlines(found)
            if all(getattr(sandbox.lineage, key) == value for key, value in wanted.items())
        ]

    def extend(self, sandbox_id: str, ttl_seconds: int) -> Sandbox:
        """Move the sandbox's deadline to ``ttl_seconds`` from now (sooner or later), at most
        the configured maximum away."""
        check_ttl(ttl_seconds, self._config)
        if self._deadlines is None:
            raise InvalidRequest("this agent enforces no deadlines; extending needs systemd")
        sandbox = self.get(sandbox_id)
        if sandbox.backend == Backend.DAYTONA:
            raise InvalidRequest(
                "a remote (daytona) sandbox's deadline is its label's, which the reaper "
                "enforces and cannot change; make a new sandbox with the ttl you need",
                code="backend_unsupported",
            )
        at = self._clock() + timedelta(seconds=ttl_seconds)
        with self.operation(sandbox.id):
            self._deadlines.arm(sandbox.id, sandbox.container_id, at, sandbox.lease)
        log.info("deadline of %s is now %s", sandbox_id, at.isoformat())
        return sandbox.model_copy(update={"expires_at": at.replace(microsecond=0)})

    def arm_deadline(self, sandbox: Sandbox) -> None:
        """Arm the deadline the labels give (start-up reconciliation of a missing timer)."""
        arm(self._deadlines, self._backend, sandbox.id, sandbox.container_id, sandbox.expires_at)

    def destroy(self, sandbox_id: str) -> Sandbox | None:
        """Remove a sandbox; None when there was none (destroying twice is fine)."""
        try:
            sandbox = self.get(sandbox_id)
        except NotFound:
            return None
        self.destroy_sandbox(sandbox, _nothing)
        return sandbox

    def destroy_sandbox(
        self, sandbox: Sandbox, last_look: Callable[[Sandbox], T]
    ) -> tuple[bool, T]:
        """Destroy a sandbox already looked up, and what ``last_look`` read just before it went
        (its final usage). True when this call removed it; False when it was gone already or
        another removal holds it (a second destroy, the reaper's), which is no error.

        Its deadline timers need no call: each is bound to the container's scope, and systemd
        stops them as the scope stops (a pool member's lease, which its timer holds, goes
        with its container, never before it). The slices stay (see the module)."""
        with self.operation(sandbox.id):
            seen = last_look(sandbox)
            gone = self._backend.remove(sandbox.container_id)
            self._commitments.release(sandbox.id)  # gone now, by this call or another's
            # The container's scope only, not Podman's monitor beside it: after an exec that
            # stays for Podman's exit_command_delay, and the emptied slice is the reaper's.
            self._slices.wait_stopped(scope_name(sandbox.container_id))
            if sandbox.lineage.egress_address and self._egress is not None:
                self._egress.release(sandbox.id)  # gone now, by this call or another's
        self._vacate(sandbox)
        self._known.pop(sandbox.id)
        if gone:
            self.forget(sandbox)
        # At debug: the sandbox_destroyed (or reaper_action) audit record tells it.
        log.debug("destroyed %s" if gone else "%s was gone or going already", sandbox.id)
        return gone, seen

    def forget(self, sandbox: Sandbox) -> None:
        """What goes with a removed sandbox beside its container: its credentials, a nested
        one's socket directory, and its workspace volume with its root task's last sandbox."""
        credential_store(self._config).remove(sandbox.id)
        if sandbox.lineage.nested:
            drop_inner_directory(self._nested_root, sandbox.id)
        release_volume(self._backend, sandbox)

    def sync_egress(self, containers: list[SandboxInfo], observed_at: float) -> None:
        """The egress rules and resolver map in line with a listing (the reaper's pass)."""
        if self._egress is None:
            return
        found = []
        for info in containers:
            if not info.labels.get(EGRESS_ADDRESS):
                continue
            try:
                lineage = decode(info.labels)
            except HostError:
                continue
            found.append(
                Labelled(
                    lineage.sandbox_id,
                    lineage.user,
                    lineage.project,
                    lineage.egress_address,
                    lineage.egress,
                )
            )
        self._egress.sync(found, observed_at, self._operations.engaged())

    def sync_commitments(self, containers: list[SandboxInfo], mark: int) -> None:
        """What admission counts in line with a listing that began at ``mark`` (the reaper's
        pass): sandboxes removed behind the agent's back go, those it did not make come in."""
        listed = []
        for info in containers:
            try:
                sandbox = Sandbox.from_info(info)
                names = slice_names(sandbox.user, sandbox.project)
            except SliceboxError:
                continue
            if sandbox.backend not in REMOTE:
                listed.append(Listed(sandbox.id, names, sandbox.limits))
        self._commitments.sync(listed, mark)

    def remove_container(self, container_id: str) -> bool:
        """Remove a container whatever its labels say (the reaper's last resort)."""
        return remove_container(self._backend, self._slices, container_id)

    def stop_slice_if_idle(self, unit: str, *, creating: str | None = None) -> bool:
        """Stop a user or project slice that holds nothing and that no create (other than
        ``creating``, the one undoing itself) is placing into."""
        return self._operations.stop_slice_if_idle(
            unit, self._slices.remove_if_empty, creating=creating
        )

    def destroy_tree(self, root_task_id: str) -> list[Sandbox]:
        """Destroy every sandbox of a root task, children before parents (deepest first)."""
        found = self.find(root_task_id=root_task_id)
        members = sorted(found, key=lambda s: -s.lineage.depth)
        for member in members:
            self.destroy_sandbox(member, _nothing)
        return members

    def _vacate(self, sandbox: Sandbox) -> None:
        self._operations.vacate(sandbox.slices(), self._clock())

    def _with_deadlines(self, sandboxes: list[Sandbox]) -> list[Sandbox]:
        """The deadlines systemd holds now override the labels' (they may be extended), and
        pool members' leases their labels' lineage (one listing either way)."""
        if self._deadlines is None or not sandboxes:
            return sandboxes
        pooled = any(s.lineage.pool for s in sandboxes)
        timers = sorted(
            self._deadlines.leased() if pooled else self._deadlines.timers(), key=lambda t: t.at
        )
        current, leases = latest(timers), {t.sandbox_id: t for t in timers if t.lease}
        return [
            s.leased(leases[s.id])
            if s.lineage.pool and s.id in leases
            else s.model_copy(update={"expires_at": current[s.id]})
            if s.id in current
            else s
            for s in sandboxes
        ]


def _nothing(sandbox: Sandbox) -> None:
    """A last look that reads nothing."""
