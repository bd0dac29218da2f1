"""Making a sandbox: admit it, place it in the slice tree, start it, and undo what it made
when any step fails.

Everything that can be refused without making anything is decided first: admission's pure
pass (core.admission), then what the host answers (the volumes it names, its binds pinned,
its image and wasm plugin found). Then the create is in flight (core.operations) while it
ensures its slices, places its egress, makes its workspace volume and credentials, starts its
container and checks what only the running sandbox tells. A failure at any of those removes
what it made (container, egress rules, credentials, new volume, new slices) before it answers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from pathlib import Path

from slicebox.backends.base import SandboxBackend, SandboxInfo, SandboxRequest, VolumeInfo
from slicebox.core.admission import decide
from slicebox.core.binds import (
    caller_ids,
    check_started,
    pin_binds,
    to_staging,
    user_ids,
    wasm_plugin,
)
from slicebox.core.blocking import Blocking, settle
from slicebox.core.commitments import REMOTE, Commitments
from slicebox.core.credentials import GIT_ENV
from slicebox.core.deadlines import Deadlines
from slicebox.core.egress import EgressGuard, Placement
from slicebox.core.headroom import ratios_of
from slicebox.core.innerdirs import drop_inner_directory, handed_socket, inner_directory
from slicebox.core.launch import LAUNCHER, WAITER_COMMAND, exec_line
from slicebox.core.nesting import ancestors_of, check_opt_in
from slicebox.core.operations import Operations
from slicebox.core.policy import Admitted, capability_name
from slicebox.core.progress import report
from slicebox.core.pulls import PullFor, Pulls
from slicebox.core.recent import Recent
from slicebox.core.refusals import NO_IMAGE
from slicebox.core.sandbox import Sandbox
from slicebox.core.slices import SliceManager
from slicebox.core.workspaces import (
    check_volume_mounts,
    clone_workspace,
    credential_store,
    credentials_mount,
    drop_volume,
    ensure_volume,
    volume_mount,
    volume_name,
    write_credentials,
)
from slicebox.host.beneath import BindGuard
from slicebox.host.identity import Identity
from slicebox.model.config import Config
from slicebox.model.egress import NetworkSpec
from slicebox.model.errors import (
    ImageUnavailable,
    InvalidRequest,
    NotFound,
    SandboxNotRunning,
    Unavailable,
)
from slicebox.model.labels import Lineage
from slicebox.model.names import scope_name
from slicebox.model.paths import NESTED_ROOT
from slicebox.model.progress import Phase, ProgressEvent
from slicebox.model.pulls import credential_for
from slicebox.model.shares import SharesConfig
from slicebox.model.spec import Backend, SandboxSpec

log = logging.getLogger(__name__)

# A sandbox without a command of its own stays up for execs, as the seeds' pool containers do.
KEEP_ALIVE = ("sleep", "infinity")
# Images a create of this agent found present, the most recently used kept: a create with one
# of them does not ask the backend about the image first (see ``Creator._start``).
KNOWN_IMAGES = 64


class Creator:
    """Makes sandboxes for the manager (core.sandboxes), which holds the configuration in
    force and passes it to each create."""

    def __init__(
        self,
        backend: SandboxBackend,
        slices: SliceManager,
        binds: BindGuard,
        operations: Operations,
        commitments: Commitments,
        *,
        host_memory: int,
        instance_id: str,
        clock: Callable[[], datetime],
        new_id: Callable[[], str],
        lookup: Callable[[str, Blocking], Awaitable[Sandbox]],
        deadlines: Deadlines | None,
        egress: EgressGuard | None,
        nested_root: Path = NESTED_ROOT,
        shares: Callable[[], SharesConfig] = SharesConfig,
    ) -> None:
        self._nested_root = nested_root  # where nested sandboxes' socket directories are
        self._backend = backend
        self._slices = slices
        self._binds = binds
        self._operations = operations
        self._commitments = commitments
        self._host_memory = host_memory
        self._instance_id = instance_id
        self._clock = clock
        self._new_id = new_id
        self._lookup = lookup  # a parent sandbox by id, for a child's ancestry
        self._deadlines = deadlines
        self._egress = egress
        self._images: Recent[str, None] = Recent(KNOWN_IMAGES)  # the images known present
        self._pulls = Pulls(shares=shares)  # one pull per image at a time, in [shares] (core.pulls)

    async def create(
        self,
        spec: SandboxSpec,
        config: Config,
        blocking: Blocking,
        *,
        one_shot: bool,
        owner: tuple[int, int] | None,
        pool_key: str,
        caller: Identity | None = None,
    ) -> SandboxInfo:
        """The started container of a new sandbox (``SandboxManager.create``). Each step that
        asks the host or the backend runs through ``blocking``; what undoes a failed create
        runs to its end even when the caller is cancelled meanwhile; ``caller``'s share of
        pulls in flight holds the pull it starts (None: the agent's own, a pool's refill)."""
        backend = self._backend
        kind = await blocking(lambda: self._resolve(spec, config, pool_key=pool_key))
        ids = await blocking(lambda: caller_ids(spec, owner))
        decided = decide(spec, kind, config, self._host_memory, ids, pool_key=pool_key)
        spec = decided.admitted.spec
        await blocking(lambda: check_volume_mounts(backend, spec))
        admitted, pinned = await blocking(
            lambda: pin_binds(self._binds, config, decided.admitted, ids)
        )
        parent = await self._lookup(spec.parent_id, blocking) if spec.parent_id else None
        lineage = self._lineage(admitted, config, parent, one_shot=one_shot, pool_key=pool_key)
        sandbox_id = lineage.sandbox_id
        # Admission's count (core.commitments): the limits reserved, checked against what each
        # level holds, held while it lives; a remote sandbox takes nothing of this host's.
        with self._commitments.held(
            sandbox_id,
            admitted,
            ratios_of(config.admission),
            counted=kind not in REMOTE,
        ):
            plugin = await blocking(
                lambda: wasm_plugin(backend, config, admitted, owner, decided.plugin_hosts)
            )
            known, by = await self._prepared(admitted, config, blocking, caller)
            staging = bool(pinned) and spec.backend is Backend.DOCKER
            made: list[str] = []
            fresh: VolumeInfo | None = None
            placed: Placement | None = None
            info: SandboxInfo | None = None
            with self._operations.creating(lineage, hold=one_shot or bool(pool_key)):
                try:
                    made = await blocking(lambda: self._ensure_slices(admitted, sandbox_id))
                    placed = await blocking(lambda: self._place_egress(admitted.spec, sandbox_id))
                    lineage = _placed(lineage, placed)
                    fresh = await blocking(lambda: ensure_volume(backend, admitted.spec, lineage))
                    await blocking(lambda: self._handed(config, admitted.spec, lineage))
                    stage = functools.partial(to_staging, self._binds, admitted, pinned, sandbox_id)
                    staged = await blocking(stage) if staging else admitted
                    request = _request(staged, lineage, config, placed, self._nested_root)
                    if plugin is not None:
                        request = request.model_copy(update={"wasm": plugin})
                    if staging and spec.command is not None:  # its command waits for the check
                        request = request.model_copy(
                            update={"command": WAITER_COMMAND, "open_stdin": True}
                        )
                    info = await self._start(request, config, blocking, image_known=known, by=by)
                    started = info
                    await blocking(
                        lambda: check_started(
                            backend,
                            self._binds,
                            config,
                            started.id,
                            spec=admitted.spec,
                            pinned=pinned,
                            fresh=fresh,
                            lineage=lineage,
                        )
                    )
                    await clone_workspace(backend, config, info.id, admitted.spec)
                    if staging and spec.command is not None:
                        await backend.release(info.id, exec_line(spec.command))
                    expires_at = lineage.expires_at
                    await blocking(
                        lambda: arm(
                            self._deadlines, backend, sandbox_id, started.id, expires_at, new=True
                        )
                    )
                except BaseException:
                    undo = functools.partial(
                        self._roll_back,
                        config,
                        sandbox_id,
                        info=info,
                        placed=placed,
                        fresh=fresh,
                        made=made,
                    )
                    await settle(blocking, undo)
                    raise
                finally:
                    if staging:  # the running sandbox has its own mounts by now
                        await settle(blocking, lambda: self._binds.unstage(sandbox_id))
        # At debug: the service's sandbox_created audit record tells it in the journal.
        log.debug(
            "created %s (%s) in %s", sandbox_id, info.id[:12], admitted.placement.names.project
        )
        return info

    async def _prepared(
        self, admitted: Admitted, config: Config, blocking: Blocking, caller: Identity | None
    ) -> tuple[bool, PullFor]:
        """Whether the image was known present, and for whom its pulls run (``core.pulls``): one
        not known is pulled now; one that cannot be had is refused before anything exists. A
        native sandbox runs the host's programs: it has no image to look for."""
        grant = credential_for(config.registry_credentials, admitted.spec.user, admitted.image)
        by = PullFor(grant, caller)
        known = admitted.spec.backend in NO_IMAGE or admitted.image in self._images
        if not known:
            timeout = config.pull_timeout_seconds
            await self._pulls.prepare(self._backend, admitted.image, timeout, blocking, by)
        return known, by

    def _roll_back(
        self,
        config: Config,
        sandbox_id: str,
        *,
        info: SandboxInfo | None,
        placed: Placement | None,
        fresh: VolumeInfo | None,
        made: list[str],
    ) -> None:
        """Remove what a failed create made: its container, egress rules, credentials, new
        volume and new slices."""
        if info is not None:
            remove_container(self._backend, self._slices, info.id)
        self._release_egress(placed, sandbox_id)
        credential_store(config).remove(sandbox_id)
        drop_inner_directory(self._nested_root, sandbox_id)
        drop_volume(self._backend, fresh)
        self._undo(made, sandbox_id)

    def _resolve(self, spec: SandboxSpec, config: Config, *, pool_key: str) -> Backend:
        """The backend that runs ``spec``: the one it names, or native in Docker's place when
        Docker is unavailable and the configuration allows the fallback (never for a pool
        member); refused ``backend_unavailable`` when none can run it. A nested sandbox
        (``spec.nested``) is checked against ``[nested]`` and that backend here."""
        fallback = config.allow_native_fallback and not pool_key
        kind = self._backend.resolve(spec.backend, fallback=fallback)
        if spec.nested is not None:
            check_opt_in(spec, config, kind, has_account=user_ids(spec.user) is not None)
        return kind

    def _handed(self, config: Config, spec: SandboxSpec, lineage: Lineage) -> None:
        """What the sandbox is handed beside its image: its credentials, and a nested one's
        socket directory (``server.inner`` binds the socket in it once it runs)."""
        write_credentials(config, spec, lineage.sandbox_id)
        if lineage.nested:
            inner_directory(self._nested_root, lineage.sandbox_id)

    def _lineage(
        self,
        admitted: Admitted,
        config: Config,
        parent: Sandbox | None,
        *,
        one_shot: bool,
        pool_key: str,
    ) -> Lineage:
        spec, limits, now = admitted.spec, admitted.limits, self._clock()
        sandbox_id = self._new_id()
        task_id = spec.task_id or sandbox_id
        root, depth = ancestry(spec, task_id, parent)
        # A pool member has no deadline until its acquire arms its lease's.
        ttl = None if pool_key else spec.ttl_seconds or config.default_ttl_seconds
        nested = spec.nested
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
            nested=nested is not None,
            nested_max_children=nested.max_children if nested else 0,
            nested_max_depth=nested.max_depth if nested else 0,
            ancestors=ancestors_of(parent),
            from_snapshot=spec.from_snapshot or "",
        )

    async def _start(
        self,
        request: SandboxRequest,
        config: Config,
        blocking: Blocking,
        *,
        image_known: bool,
        by: PullFor,
    ) -> SandboxInfo:
        """Create and start the container. An image a create found present before is not
        checked first (one backend call fewer per create): should it be gone since, the create
        says so (``ImageUnavailable``, leaving nothing), and the image is prepared (pulled) and
        the create tried once more."""
        backend = self._backend
        report(ProgressEvent(phase=Phase.STARTING, subject=request.image))
        try:
            info = await blocking(lambda: backend.create(request))
        except ImageUnavailable:
            self._images.pop(request.image)
            if not image_known:
                raise
            log.info("image %s is gone since its last create; preparing it again", request.image)
            timeout = config.pull_timeout_seconds
            await self._pulls.prepare(backend, request.image, timeout, blocking, by)
            info = await blocking(lambda: backend.create(request))
        self._images.put(request.image, None)
        return info

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
            self._operations.stop_slice_if_idle(
                unit, self._slices.remove_if_empty, creating=sandbox_id
            )

    def _place_egress(self, spec: SandboxSpec, sandbox_id: str) -> Placement | None:
        if not isinstance(spec.network, NetworkSpec):
            return None
        if spec.backend is Backend.WASM:  # its hosts are its runtime's (backends.wasm)
            if self._egress is not None:
                self._egress.check_hosts(spec.network)
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


def ancestry(spec: SandboxSpec, task_id: str, parent: Sandbox | None) -> tuple[str, int]:
    """(root task id, depth): a child inherits its parent's root task (``parent``: the
    sandbox its ``parent_id`` names, looked up by the caller)."""
    if spec.parent_id is None or parent is None:
        return spec.root_task_id or task_id, 0
    if parent.user != spec.user:
        raise NotFound(f"no sandbox {spec.parent_id}; list sandboxes to see the ids")
    root = parent.lineage.root_task_id
    if spec.root_task_id not in (None, root):
        raise InvalidRequest(
            f"root_task_id {spec.root_task_id!r} differs from the parent's {root!r}; "
            "leave root_task_id out for a child sandbox"
        )
    return root, parent.lineage.depth + 1


def arm(
    deadlines: Deadlines | None,
    backend: SandboxBackend,
    sandbox_id: str,
    container_id: str,
    at: datetime | None,
    *,
    new: bool = False,
) -> None:
    """Arm the deadline ``at``, if any; ``new``: of a sandbox this call is creating. A
    remote sandbox has no unit here to bind a timer to: its label's deadline is the
    reaper's to enforce (due at once, as any deadline no timer holds)."""
    if deadlines is None or at is None or not backend.has_host(container_id):
        return
    try:
        if new:
            deadlines.arm_new(sandbox_id, container_id, at)
        else:
            deadlines.arm(sandbox_id, container_id, at)
    except SandboxNotRunning:
        # Its command ended already (or was killed): the reaper removes it, deadline or none.
        log.info("%s has stopped already; no deadline timer armed", sandbox_id)


def remove_container(backend: SandboxBackend, slices: SliceManager, container_id: str) -> bool:
    """Remove a container whatever its labels say, and wait for its scope to stop."""
    gone = backend.remove(container_id)
    slices.wait_stopped(scope_name(container_id))
    return gone


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
    nested_root: Path = NESTED_ROOT,
) -> SandboxRequest:
    spec = admitted.spec
    inner, inner_env = handed_socket(lineage, nested_root)
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
        env={**spec.env, **(GIT_ENV if lineage.credentials else {}), **inner_env},
        user=spec.run_as,
        workdir=spec.workdir,
        mounts=spec.mounts
        + volume_mount(spec, lineage)
        + credentials_mount(config, lineage)
        + inner,
        cap_add=tuple(capability_name(cap) for cap in spec.cap_add),
        backend=spec.backend,
        allow_jit=config.native_allow_jit,
        workspace_in_image=spec.from_snapshot is not None,
    )
