"""Who a sandbox runs as, and what of the host it is given.

A host workspace or bind runs the sandbox as its owner, whose ids ``caller_ids`` reads for
admission (core.admission) to decide. Each bind source is opened by the kernel beneath the
caller's bind root (``pin_binds``, host.beneath); Docker gets a staging point of it that nobody
but root can change (host.staging), and once the sandbox runs each bind is checked to be what
was pinned, with its uid allowed (``check_started``). A wasm sandbox's plugin is read from the
caller's roots the same way (``wasm_plugin``).
"""

from __future__ import annotations

import logging
import pwd

from slicebox.backends.base import WORKSPACE, SandboxBackend, VolumeInfo
from slicebox.core.admission import unknown_user
from slicebox.core.policy import (
    Admitted,
    check_root,
    host_bound,
    runs_as_root,
)
from slicebox.core.refusals import NO_IMAGE
from slicebox.core.workspaces import credential_store
from slicebox.host.beneath import BindGuard, BindRoot, Pinned, bind_roots
from slicebox.host.plugins import read_plugin
from slicebox.model.config import Config
from slicebox.model.errors import HostError, InvalidRequest, PolicyViolation, Unavailable
from slicebox.model.labels import Lineage
from slicebox.model.spec import Backend, MountKind, SandboxSpec
from slicebox.model.wasm import WasmRun, max_pages_for

log = logging.getLogger(__name__)


def caller_ids(spec: SandboxSpec, owner: tuple[int, int] | None) -> tuple[int, int] | None:
    """The uid and primary gid admission needs (core.admission): ``owner``, the kernel's word
    for the caller's own; else, for a sandbox with a host directory, its user's from the user
    database (None when the host has no such user, which admission refuses)."""
    if owner is not None or not host_bound(spec):
        return owner
    return user_ids(spec.user)


def roots_of(config: Config, user: str, owner: tuple[int, int] | None) -> tuple[BindRoot, ...]:
    """``user``'s bind roots, each with who may own the directories on its path."""
    uid, _ = owner or owner_ids(user)
    return bind_roots(config.bind_roots, user, uid)


def owner_ids(user: str) -> tuple[int, int]:
    """``user``'s uid and primary gid from the user database (an admin acting for them)."""
    ids = user_ids(user)
    if ids is None:
        raise unknown_user(user)
    return ids


def user_ids(user: str) -> tuple[int, int] | None:
    """``user``'s uid and primary gid from the user database; None for a user it lacks."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def pin_binds(
    guard: BindGuard, config: Config, admitted: Admitted, owner: tuple[int, int] | None
) -> tuple[Admitted, tuple[Pinned, ...]]:
    """Each bind source opened by the kernel beneath the caller's root (host.beneath),
    and the spec's sources replaced by the paths that were opened."""
    spec = admitted.spec
    binds = [m for m in spec.mounts if m.kind is MountKind.BIND]
    if not binds:
        return admitted, ()
    roots = roots_of(config, spec.user, owner)
    try:
        pinned = tuple(guard.pin(m.source, m.target, roots) for m in binds)
    except PolicyViolation as exc:
        if exc.code == "bind_root_unsafe":  # the operator's to fix: say it where they look
            log.warning("refused a bind of %s: %s", spec.user, exc.message)
        raise
    sources = iter(p.source for p in pinned)
    mounts = tuple(
        m.model_copy(update={"source": next(sources)}) if m.kind is MountKind.BIND else m
        for m in spec.mounts
    )
    return admitted.model_copy(update={"spec": spec.model_copy(update={"mounts": mounts})}), pinned


def to_staging(
    guard: BindGuard, admitted: Admitted, pinned: tuple[Pinned, ...], sandbox_id: str
) -> Admitted:
    """``admitted`` with its bind sources replaced by their staging points: what Docker
    gets, a path nobody but root can change (host.staging)."""
    spec = admitted.spec
    points = iter(guard.stage(sandbox_id, pinned))
    mounts = tuple(
        m.model_copy(update={"source": next(points)}) if m.kind is MountKind.BIND else m
        for m in spec.mounts
    )
    return admitted.model_copy(update={"spec": spec.model_copy(update={"mounts": mounts})})


def check_started(
    backend: SandboxBackend,
    guard: BindGuard,
    config: Config,
    container_id: str,
    *,
    spec: SandboxSpec,
    pinned: tuple[Pinned, ...],
    fresh: VolumeInfo | None,
    lineage: Lineage,
) -> None:
    """What only the running sandbox tells: each bind is what was pinned
    (host.beneath.verify), its uid is not 0 unless allowed (a user name can map to 0 in
    the image's passwd), and a volume made for it and its credentials belong to that
    uid."""
    if spec.backend in NO_IMAGE:
        # Its own dynamic user, or the caller's with a host workspace: no volume and no
        # credentials to give; the workspace is what was pinned, seen by its anchor.
        if pinned:
            pid = backend.sandbox_pid(container_id)
            for bind in pinned:
                guard.verify(pid, bind)
        return
    ids = numeric_ids(spec.run_as)
    needs_pid = bool(pinned) or ids is None or fresh is not None
    pid = backend.sandbox_pid(container_id) if needs_pid else 0
    for bind in pinned:
        guard.verify(pid, bind)
    uid, gid = ids or guard.ids_of(pid)
    if uid == 0 and not runs_as_root(spec.run_as):
        check_root(spec.user, spec, config)
    if lineage.credentials:  # only once the uid is known to be allowed
        credential_store(config).give(lineage.sandbox_id, uid, gid)
    if fresh is not None and fresh.mountpoint:
        try:
            guard.own(pid, WORKSPACE, fresh.mountpoint, uid, gid)
        except OSError as exc:
            raise HostError(
                f"the new workspace volume {fresh.name} could not be given to uid {uid} "
                f"({exc.strerror}); is the agent on the Docker host, as root?"
            ) from exc


def wasm_plugin(
    backend: SandboxBackend,
    config: Config,
    admitted: Admitted,
    owner: tuple[int, int] | None,
    hosts: tuple[str, ...],
) -> WasmRun | None:
    """A wasm sandbox's plugin, held by the agent's store before anything is made: read
    from the caller's roots, or uploaded, or one the store holds; with its limits and its
    allowed ``hosts`` (core.admission)."""
    spec = admitted.spec
    if spec.backend is not Backend.WASM or spec.wasm is None:
        return None
    store = backend.wasm_plugins
    if store is None:
        raise Unavailable("the wasm backend is not enabled", code="backend_unavailable")
    wanted = spec.wasm
    if wanted.sha256 is not None:
        store.require(spec.user, wanted.sha256)
        sha = wanted.sha256
    elif wanted.module is not None:
        try:
            module = wanted.module_bytes()
        except ValueError as exc:
            raise InvalidRequest(str(exc), code="wasm_invalid", field="wasm.module") from exc
        sha = store.put(spec.user, module)
    else:
        assert wanted.path is not None
        uid, gid = owner or owner_ids(spec.user)
        roots = roots_of(config, spec.user, (uid, gid))
        sha = store.put(spec.user, read_plugin(wanted.path, roots, uid, {gid}))
    return WasmRun(
        sha256=sha,
        max_pages=max_pages_for(admitted.limits.memory_bytes),
        allowed_hosts=hosts,
    )


def numeric_ids(run_as: str | None) -> tuple[int, int] | None:
    """``uid:gid`` as numbers; None for a name, or a uid alone (its gid is the image's)."""
    uid, _, gid = (run_as or "").partition(":")
    if uid.isdigit() and gid.isdigit():
        return int(uid), int(gid)
    return None
