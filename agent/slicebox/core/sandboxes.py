"""The sandbox lifecycle: create in the slice tree with security defaults, inspect, list,
destroy idempotently, cascade-destroy a task tree deepest first.

Everything a sandbox is lives in its container's immutable labels (see :mod:`slicebox.model.labels`)
and in systemd; in memory there is only what is in progress, when a destroy last left each
slice, and which images creates found present (a hint: Docker's create says when one is gone).
A create that fails after it made something (a container, a slice) removes what it made
before the error reaches the caller. A destroy leaves the user and project slices in place:
the next sandbox of the project (one-shot runs come and go) finds them ready, and the reaper
stops them once they have been empty for ``reaper.empty_slice_grace_seconds``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from slicebox.backends.base import (
    SandboxBackend,
    SandboxInfo,
    SandboxRequest,
    VolumeInfo,
)
from slicebox.core.binds import (
    check_started,
    pin_binds,
    staging_points,
    to_staging,
    wasm_plugin,
    who_runs,
)
from slicebox.core.credentials import GIT_ENV
from slicebox.core.deadlines import Deadlines, Timer, latest
from slicebox.core.egress import EgressGuard, Labelled, Placement
from slicebox.core.launch import LAUNCHER, WAITER_COMMAND, exec_line
from slicebox.core.operations import Operations
from slicebox.core.policy import (
    Admitted,
    admit,
    capability_name,
    check_ttl,
)
from slicebox.core.recent import Recent
from slicebox.core.refusals import NO_IMAGE, check_backend
from slicebox.core.sandbox import (
    CONTAINER_NAME,
    KNOWN_SANDBOXES,
    Sandbox,
    found,
    new_sandbox_id,
)
from slicebox.core.slices import SliceManager
from slicebox.core.workspaces import (
    check_volume_mounts,
    clone_workspace,
    credential_store,
    credentials_mount,
    drop_volume,
    ensure_volume,
    release_volume,
    volume_mount,
    volume_name,
    write_credentials,
)
from slicebox.host.beneath import BindGuard, KernelBindGuard
from slicebox.model.config import Config
from slicebox.model.egress import NetworkSpec
from slicebox.model.errors import (
    HostError,
    ImageUnavailable,
    InvalidRequest,
    NotFound,
    SandboxNotRunning,
    Unavailable,
)
from slicebox.model.labels import (
    EGRESS_ADDRESS,
    Lineage,
    decode,
    selector,
)
from slicebox.model.names import scope_name
from slicebox.model.pool import Lease
from slicebox.model.spec import Backend, SandboxSpec

# Sandbox is re-exported: its callers name it with the manager.
__all__ = ["KEEP_ALIVE", "Sandbox", "SandboxManager"]

log = logging.getLogger(__name__)


# A sandbox without a command of its own stays up for execs, as the seeds' pool containers do.
KEEP_ALIVE = ("sleep", "infinity")
# Images a create of this agent found present, the most recently used kept: a create with one
# of them does not ask the backend about the image first (see ``SandboxManager._start``).
KNOWN_IMAGES = 64
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
    ) -> None:
        self._egress = egress
        self._backend = backend
        self._binds: BindGuard = binds or KernelBindGuard()
        self._slices = slices
        self._config = config
        self._host_memory = host_memory
        self._instance_id = instance_id
        self._clock = clock
        self._new_id = new_id
        self._deadlines = deadlines
        self._operations = Operations()
        # The images known present (KNOWN_IMAGES).
        self._images: Recent[str, None] = Recent(KNOWN_IMAGES)
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

    def create(
        self,
        spec: SandboxSpec,
        *,
        one_shot: bool = False,
        owner: tuple[int, int] | None = None,
        pool_key: str = "",
    ) -> Sandbox:
        """Admit, place and start a sandbox; on any failure nothing is left behind.

        ``one_shot``: for a one-shot run. The sandbox is labelled so, and it is returned with
        an operation held on it, taken as it stops being in flight (no reaper pass finds it
        free in between); the caller ends it (``end_operation``) once it has removed it.
        The reaper removes a one-shot sandbox that no operation holds (``run_ended``).
        ``owner``: the (uid, gid) of the user the sandbox is for, as the kernel told the agent
        (the caller's own); left out, it is looked up by name. A host workspace runs as it.
        ``pool_key``: a warm pool's member of that key (core.pool), labelled so, with no
        deadline until it is acquired, and returned held as a one-shot's is."""
        spec = self._check_backend(spec, pool_key=pool_key)
        admitted = self.admitted(spec, owner)
        check_volume_mounts(self._backend, admitted.spec)
        admitted, pinned = pin_binds(self._binds, self._config, admitted, owner)
        lineage = self._lineage(admitted, one_shot=one_shot, pool_key=pool_key)
        # A native sandbox runs the host's programs: it has no image to look for.
        known = spec.backend in NO_IMAGE or self._image_known(admitted.image)
        plugin = wasm_plugin(self._backend, self._config, admitted, owner)
        if not known:  # an image that cannot be had is refused before anything exists
            self._backend.prepare(admitted.image)
        staging = bool(pinned) and spec.backend is Backend.DOCKER
        with (
            self._operations.creating(lineage, hold=one_shot or bool(pool_key)),
            staging_points(self._binds, lineage.sandbox_id, staging),
        ):
            made = self._ensure_slices(admitted, lineage.sandbox_id)
            fresh: VolumeInfo | None = None
            placed: Placement | None = None
            try:
                placed = self._place_egress(admitted.spec, lineage.sandbox_id)
                lineage = _placed(lineage, placed)
                fresh = ensure_volume(self._backend, admitted.spec, lineage)
                write_credentials(self._config, admitted.spec, lineage.sandbox_id)
                staged = (
                    to_staging(self._binds, admitted, pinned, lineage.sandbox_id)
                    if staging
                    else admitted
                )
                request = _request(staged, lineage, self._config, placed)
                if plugin is not None:
                    request = request.model_copy(update={"wasm": plugin})
                if staging and spec.command is not None:  # its command waits for the check
                    request = request.model_copy(
                        update={"command": WAITER_COMMAND, "open_stdin": True}
                    )
                info = self._start(request, image_known=known)
            except BaseException:
                self._release_egress(placed, lineage.sandbox_id)
                credential_store(self._config).remove(lineage.sandbox_id)
                drop_volume(self._backend, fresh)
                self._undo(made, lineage.sandbox_id)
                raise
            try:
                check_started(
                    self._backend,
                    self._binds,
                    self._config,
                    info.id,
                    spec=admitted.spec,
                    pinned=pinned,
                    fresh=fresh,
                    lineage=lineage,
                )
                clone_workspace(self._backend, self._config, info.id, admitted.spec)
                if staging and spec.command is not None:
                    self._backend.release(info.id, exec_line(spec.command))
                self._arm(lineage.sandbox_id, info.id, lineage.expires_at, new=True)
            except BaseException:
                self.remove_container(info.id)
                self._release_egress(placed, lineage.sandbox_id)
                credential_store(self._config).remove(lineage.sandbox_id)
                drop_volume(self._backend, fresh)
                self._undo(made, lineage.sandbox_id)
                raise
        # At debug: the service's sandbox_created audit record tells it in the journal.
        log.debug(
            "created %s (%s) in %s",
            lineage.sandbox_id,
            info.id[:12],
            admitted.placement.names.project,
        )
        return self._remember(Sandbox.from_info(info))

    def admitted(self, spec: SandboxSpec, owner: tuple[int, int] | None = None) -> Admitted:
        """The spec through policy and admission, with who it runs as decided: what a create
        makes, and what a warm pool's key is read from (core.poolkeys.key_of)."""
        return who_runs(admit(spec, self._config, self._host_memory), owner, self._config)

    def lease(self, member: Sandbox, spec: SandboxSpec, *, one_shot: bool) -> Sandbox:
        """Hand an idle pool member to ``spec``'s task: the lineage a create would give it,
        armed as the lease on its first deadline timer (one systemd call; ``docs/pool.md``).
        The caller holds an operation on the member and has checked the deadline exists."""
        deadlines, ttl = self._deadlines, spec.ttl_seconds or self._config.default_ttl_seconds
        if deadlines is None or ttl is None:
            raise InvalidRequest("a pool member is leased only with a deadline in systemd")
        task_id = spec.task_id or member.id
        root, depth = self._ancestry(spec, task_id)
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
        info = self._backend.inspect(sandbox_id) if CONTAINER_NAME.fullmatch(sandbox_id) else None
        sandbox = self._remember(found(info, sandbox_id))
        if sandbox.lineage.pool:  # its lineage and deadline are its lease's
            return self.with_lease(sandbox)
        if current_deadline and self._deadlines is not None:
            held = self._deadlines.current_of(sandbox.id)
            return sandbox.model_copy(update={"expires_at": held}) if held else sandbox
        return sandbox

    async def aget(self, sandbox_id: str) -> Sandbox:
        """``get`` on the running event loop (the deadline its labels give). A pool member
        comes without its lease, which is systemd's: the caller reads it (``with_lease``)."""
        named = CONTAINER_NAME.fullmatch(sandbox_id)
        info = await self._backend.inspect_async(sandbox_id) if named else None
        return self._remember(found(info, sandbox_id))

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
        self._arm(sandbox.id, sandbox.container_id, sandbox.expires_at)

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
        """What goes with a removed sandbox beside its container: its credentials, and its
        workspace volume with its root task's last sandbox."""
        credential_store(self._config).remove(sandbox.id)
        release_volume(self._backend, sandbox)

    def _place_egress(self, spec: SandboxSpec, sandbox_id: str) -> Placement | None:
        # A wasm plugin's hosts are its runtime's allowed_hosts (backends.wasm), not rules.
        if not isinstance(spec.network, NetworkSpec) or spec.backend is Backend.WASM:
            return None
        if self._egress is None:
            raise Unavailable(
                "network egress is not available on this agent; use network 'none'",
                code="egress_unavailable",
            )
        allow = spec.network.egress.allow
        return self._egress.place(sandbox_id, spec.user, spec.project, allow)

    def _release_egress(self, placed: Placement | None, sandbox_id: str) -> None:
        if placed is not None and self._egress is not None:
            self._egress.release(sandbox_id)

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

    def remove_container(self, container_id: str) -> bool:
        """Remove a container whatever its labels say (the reaper's last resort)."""
        gone = self._backend.remove(container_id)
        self._slices.wait_stopped(scope_name(container_id))
        return gone

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

    def _start(self, request: SandboxRequest, *, image_known: bool) -> SandboxInfo:
        """Create and start the container. An image a create found present before is not
        checked first (one backend call fewer per create): should it be gone since, the create
        says so (``ImageUnavailable``, leaving nothing), and the image is prepared (pulled) and
        the create tried once more."""
        try:
            info = self._backend.create(request)
        except ImageUnavailable:
            self._forget_image(request.image)
            if not image_known:
                raise
            log.info("image %s is gone since its last create; preparing it again", request.image)
            self._backend.prepare(request.image)
            info = self._backend.create(request)
        self._remember_image(request.image)
        return info

    def _image_known(self, image: str) -> bool:
        return image in self._images

    def _remember_image(self, image: str) -> None:
        self._images.put(image, None)

    def _forget_image(self, image: str) -> None:
        self._images.pop(image)

    def _vacate(self, sandbox: Sandbox) -> None:
        self._operations.vacate(sandbox.slices(), self._clock())

    def _arm(
        self, sandbox_id: str, container_id: str, at: datetime | None, *, new: bool = False
    ) -> None:
        """Arm the deadline ``at``, if any; ``new``: of a sandbox this call is creating. A
        remote sandbox has no unit here to bind a timer to: its label's deadline is the
        reaper's to enforce (due at once, as any deadline no timer holds)."""
        if self._deadlines is None or at is None or not self._backend.has_host(container_id):
            return
        try:
            if new:
                self._deadlines.arm_new(sandbox_id, container_id, at)
            else:
                self._deadlines.arm(sandbox_id, container_id, at)
        except SandboxNotRunning:
            # Its command ended already (or it was killed): the reaper removes it as exited,
            # deadline or none.
            log.info("%s has stopped already; no deadline timer armed", sandbox_id)

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

    def _lineage(self, admitted: Admitted, *, one_shot: bool, pool_key: str = "") -> Lineage:
        spec, limits, now = admitted.spec, admitted.limits, self._clock()
        sandbox_id = self._new_id()
        task_id = spec.task_id or sandbox_id
        root, depth = self._ancestry(spec, task_id)
        # A pool member has no deadline until its acquire arms its lease's.
        ttl = None if pool_key else spec.ttl_seconds or self._config.default_ttl_seconds
        return Lineage(
            sandbox_id=sandbox_id,
            instance_id=self._instance_id,
            root_task_id=root,
            task_id=task_id,
            parent_id=spec.parent_id or "",
            depth=depth,
            user=spec.user,
            project=spec.project,
            backend=spec.backend.value,
            created_at=now,
            expires_at=None if ttl is None else now + timedelta(seconds=ttl),
            provisioned_cpu=limits.cpus,
            provisioned_memory_bytes=limits.memory_bytes,
            provisioned_pids=limits.pids,
            oneshot=one_shot,
            pool=bool(pool_key),
            pool_key=pool_key,
            workspace_volume=volume_name(spec, sandbox_id),
            credentials="git" if spec.credentials and spec.credentials.git else "",
            launcher=LAUNCHER if _waits(spec, one_shot=one_shot, pool_key=pool_key) else "",
        )

    def _ancestry(self, spec: SandboxSpec, task_id: str) -> tuple[str, int]:
        """(root task id, depth): a child inherits its parent's root task."""
        if spec.parent_id is None:
            return spec.root_task_id or task_id, 0
        parent = self.get(spec.parent_id)
        if parent.user != spec.user:
            raise NotFound(f"no sandbox {spec.parent_id}; list sandboxes to see the ids")
        root = parent.lineage.root_task_id
        if spec.root_task_id not in (None, root):
            raise InvalidRequest(
                f"root_task_id {spec.root_task_id!r} differs from the parent's {root!r}; "
                "leave root_task_id out for a child sandbox"
            )
        return root, parent.lineage.depth + 1

    def _check_backend(self, spec: SandboxSpec, *, pool_key: str = "") -> SandboxSpec:
        """The spec with the backend that runs it: the one it names, or native in Docker's
        place when Docker is unavailable and the configuration allows the fallback (never
        for a pool member); refused ``backend_unavailable`` when none can run it, and
        ``backend_unsupported`` when the native backend cannot give what it asks."""
        fallback = self._config.allow_native_fallback and not pool_key
        kind = self._backend.resolve(spec.backend, fallback=fallback)
        return check_backend(spec, kind, pool_key=pool_key)

    def _ensure_slices(self, admitted: Admitted, sandbox_id: str) -> list[str]:
        """Ensure the three slices top down; the ones this call created."""
        placement, made = admitted.placement, list[str]()
        levels = (
            (placement.names.managed, placement.managed),
            (placement.names.user, placement.user),
            (placement.names.project, placement.project),
        )
        try:
            for unit, ceiling in levels:
                if self._slices.ensure(unit, ceiling) and unit != placement.names.managed:
                    made.append(unit)
        except BaseException:
            self._undo(made, sandbox_id)
            raise
        return made

    def _undo(self, made: list[str], sandbox_id: str) -> None:
        """Stop the slices a failed create made, deepest first (the managed one stays),
        unless another create is placing into them."""
        for unit in reversed(made):
            self.stop_slice_if_idle(unit, creating=sandbox_id)


def _nothing(sandbox: Sandbox) -> None:
    """A last look that reads nothing."""


def _waits(spec: SandboxSpec, *, one_shot: bool, pool_key: str) -> bool:
    """Whether the sandbox's main process is the waiter (``core.launch``): made for a one-shot
    run, or as a member of a pool that does not reuse its members (a member a create takes
    waits forever, as ``sleep infinity`` would); never with a command of the caller's, nor in
    a native sandbox (whose execs are units of their own: it has no waiter)."""
    if spec.backend is not Backend.DOCKER:
        return False
    return spec.command is None and (one_shot or (bool(pool_key) and not spec.reuse))


def _command(spec: SandboxSpec, lineage: Lineage) -> tuple[str, ...]:
    if spec.command is not None:
        return spec.command
    return WAITER_COMMAND if lineage.launcher else KEEP_ALIVE


def _placed(lineage: Lineage, placed: Placement | None) -> Lineage:
    if placed is None:
        return lineage
    return lineage.model_copy(
        update={"egress": placed.allow, "egress_address": str(placed.address)}
    )


def _request(
    admitted: Admitted,
    lineage: Lineage,
    config: Config,
    placed: Placement | None = None,
) -> SandboxRequest:
    spec = admitted.spec
    network = placed.network if placed else spec.network
    return SandboxRequest(
        name=lineage.sandbox_id,
        image=admitted.image,
        command=_command(spec, lineage),
        open_stdin=bool(lineage.launcher),
        labels=lineage.to_labels(),
        slice=admitted.placement.names.project,
        limits=admitted.limits,
        network=network if isinstance(network, str) else "none",
        address=str(placed.address) if placed else None,
        dns=(str(placed.dns),) if placed else (),
        env={**spec.env, **(GIT_ENV if lineage.credentials else {})},
        user=spec.run_as,
        workdir=spec.workdir,
        mounts=spec.mounts + volume_mount(spec, lineage) + credentials_mount(config, lineage),
        cap_add=tuple(capability_name(cap) for cap in spec.cap_add),
        backend=spec.backend,
        allow_jit=config.native_allow_jit,
    )
