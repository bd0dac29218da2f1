"""Snapshots of a sandbox's filesystem, and forks that start from one.

A snapshot (``POST /v1/sandboxes/{id}/snapshots``) is taken with the sandbox frozen
(:meth:`Pausing.frozen_for`, resumed after): the container's root filesystem, exported by the
engine, and its ``/workspace`` (a tmpfs or a volume the engine's export cannot see, read from
the frozen sandbox's own mount namespace) go in one stream to one engine import
(:mod:`slicebox.core.snaptar`, :mod:`slicebox.backends.dockersnap`). The image's configuration
is the base image's command, env and working directory and the snapshot's labels, never the
container's: what a create was given in ``env``, and its credentials (a mount, which no export
holds), never reach a snapshot. No set-id bit, device node or file capability goes in either.

Snapshots are their owner's: listed, forked and deleted only by the user they were taken for
(another user's answers ``not_found``, as a sandbox does), at most ``[snapshots] max_count``
and ``max_bytes`` each (``snapshot_quota`` says what they hold). An image is a user's snapshot
only through the agent's own reference (:func:`slicebox.model.snapshots.attribute`), never
through the labels a pulled image may carry. A snapshot deleted while a fork runs its image is
retired (:meth:`Snapshots._remove`): gone from its owner's list, its name free, its bytes still
counted against their ``max_bytes`` until the reaper removes the image once nothing runs it
(``core.reaping``, ``snapshot_released``). Native, wasm and remote sandboxes are refused
(``backend_unsupported``), and so is a sandbox whose ``/workspace`` is a host directory
(``snapshot_workspace``). A nested sandbox forks only a snapshot of its own subtree
(``core.nesting.reaches_snapshot``); any other answers ``not_found`` as a missing one does.

A fork (``"from_snapshot": name`` in a create) is an ordinary create of the snapshot's image
(admission, ceilings, egress as any) whose ``/workspace`` is that image's own rather than a
tmpfs (:attr:`SandboxRequest.workspace_in_image`): the engine's copy-on-write gives each fork
its own copy of it, as of the rest of its root filesystem, and nothing is copied at its create.
A fork given a ``workspace`` or a mount at ``/workspace`` is refused (``snapshot_workspace``):
either would hide the snapshot's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, BinaryIO, Protocol

from slicebox.backends.base import Removal, SnapshotEngine, mounts_workspace
from slicebox.core.blocking import Blocking
from slicebox.core.execaudit import audited, subject
from slicebox.core.files import Files
from slicebox.core.nesting import reaches_snapshot
from slicebox.core.pausing import LookUp, Pausing, docker_only
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.snaptar import Pipe, producing, write_snapshot
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.api import CreateSandbox, SandboxView
from slicebox.model.audit import AuditEvent
from slicebox.model.errors import (
    AdmissionRefused,
    InvalidRequest,
    NotFound,
    SliceboxError,
)
from slicebox.model.labels import stamp
from slicebox.model.limits import human_bytes
from slicebox.model.snapshots import (
    LABEL,
    LABEL_BASE,
    LABEL_CREATED,
    LABEL_LINE,
    LABEL_NAME,
    LABEL_ORIGIN,
    LABEL_PROJECT,
    LABEL_ROOT_TASK,
    LABEL_USER,
    HeldSnapshot,
    SnapshotDeleted,
    SnapshotView,
    attribute,
    retired_image,
    snapshot_image,
)

log = logging.getLogger(__name__)


class Lifecycle(Protocol):
    """What a fork asks of the Service: its create."""

    async def create(
        self, who: Identity, request: CreateSandbox, blocking: Blocking
    ) -> SandboxView: ...


def quota_error(what: str) -> AdmissionRefused:
    return AdmissionRefused(
        f"{what}; delete snapshots you no longer need (slicebox snapshots rm NAME) or ask an "
        "operator to raise [snapshots] max_count / max_bytes",
        code="snapshot_quota",
    )


def _over_room(user: str, held: str, room: int) -> AdmissionRefused:
    """``held``: what of the user's bytes retired images hold (:func:`held_by_forks`)."""
    return quota_error(
        f"this snapshot grew past the {human_bytes(room)} left of {user}'s snapshots' max_bytes "
        f"(a sparse file counts whole) and was not made{held}"
    )


def workspace_refusal(what: str) -> InvalidRequest:
    return InvalidRequest(
        f"{what}: its /workspace is a host directory; use a sandbox with its own /workspace",
        code="snapshot_workspace",
    )


def fork_workspace_refusal(name: str) -> InvalidRequest:
    return InvalidRequest(
        f"a fork of snapshot {name} starts with the snapshot's /workspace: leave out "
        "`workspace` and any mount at /workspace",
        code="snapshot_workspace",
    )


def no_snapshot(name: str) -> NotFound:
    """The answer for a snapshot the caller has not, or may not reach: the same either way."""
    return NotFound(f"no snapshot {name}; list snapshots to see the names")


def views_of(found: list[HeldSnapshot]) -> list[SnapshotView]:
    """The snapshots among ``found`` as their owners see them; a retired image is none, and
    one whose labels make no view is left out (logged), never an error for the whole list."""
    views = []
    for held in (h for h in found if not h.retired):
        view = held.view()
        if view is None:
            log.warning("snapshot image %s has malformed labels; left out", held.image_id)
        else:
            views.append(view)
    return sorted(views, key=lambda v: (v.user, v.created_at, v.name))


def held_by_forks(found: list[HeldSnapshot]) -> str:
    """What of ``found``'s bytes retired images hold, said in a quota's refusal."""
    retired = sum(h.size_bytes for h in found if h.retired)
    if not retired:
        return ""
    return (
        f"; {human_bytes(retired)} of that is deleted snapshots' images that forks still run, "
        "freed once they end"
    )


def changes_of(base: Mapping[str, Any], labels: Mapping[str, str]) -> list[str]:
    """The import's Dockerfile instructions: the base image's start-up, the labels."""
    found: list[str] = []
    for env in base.get("Env") or []:
        found.append(f"ENV {json.dumps(env.split('=', 1)[0])}={json.dumps(env.split('=', 1)[1])}")
    for key in ("Cmd", "Entrypoint"):
        if base.get(key):
            found.append(f"{key.upper()} {json.dumps(list(base[key]))}")
    if base.get("WorkingDir"):
        found.append(f"WORKDIR {base['WorkingDir']}")
    found += [f"LABEL {json.dumps(key)}={json.dumps(value)}" for key, value in labels.items()]
    return found


class Snapshots:
    def __init__(
        self,
        pausing: Pausing,
        files: Files,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        workspace_of: Callable[[int], str] = lambda pid: f"/proc/{pid}/root/workspace",
    ) -> None:
        """``files``: the Service's transfers, whose look-up, audit and sandboxes these share;
        ``workspace_of``: where the host sees the
        /workspace of the sandbox whose init has that pid (its mount namespace's)."""
        self._workspace_of = workspace_of
        self.pausing = pausing
        self._pausing = pausing
        self._engine: SnapshotEngine = pausing.engine
        self._files = files
        self._auditor: Auditor = files.auditor
        self._sandboxes: SandboxManager = files.sandboxes
        self._looked_up: LookUp = files.looked_up
        self._clock = clock
        self._locks: dict[str, asyncio.Lock] = {}  # one snapshot at a time per user

    # --- snapshots ------------------------------------------------------------------------

    async def take(
        self, who: Identity, sandbox_id: str, name: str, blocking: Blocking
    ) -> SnapshotView:
        sandbox = await self._looked_up(who, sandbox_id, blocking)
        event = AuditEvent.SNAPSHOT_TAKEN
        async with audited(self._auditor, event, who, blocking, **subject(sandbox)) as record:
            record["detail"] = f"snapshot {name}"
            docker_only(sandbox, "snapshotted")
            async with self._locks.setdefault(sandbox.user, asyncio.Lock()):
                view = await asyncio.shield(
                    asyncio.to_thread(self._take, sandbox, name)  # minutes at worst: own thread
                )
            record["detail"] = f"snapshot {name}: {human_bytes(view.size_bytes)}"
        return view

    async def listed(
        self, who: Identity, user: str | None, blocking: Blocking
    ) -> list[SnapshotView]:
        """The caller's own snapshots; an admin's, every user's (or ``user``'s)."""
        owner = who.acting_user(user) if not who.is_admin or user is not None else None
        return views_of(await blocking(functools.partial(self._held, owner)))

    async def delete(
        self, who: Identity, name: str, user: str | None, blocking: Blocking
    ) -> SnapshotDeleted:
        owner = who.acting_user(user)
        event = AuditEvent.SNAPSHOT_DELETED
        async with audited(self._auditor, event, who, blocking, user=owner) as record:
            record["detail"] = f"snapshot {name}"
            held = await blocking(functools.partial(self._owned, owner, name))
            removal = await blocking(functools.partial(self._remove, held))
            if removal is Removal.KEPT:
                record["detail"] = f"snapshot {name}: retired, its image kept for its forks"
        return SnapshotDeleted(name=name, deleted=removal is not Removal.GONE)

    # --- forks ----------------------------------------------------------------------------

    async def fork(
        self,
        who: Identity,
        request: CreateSandbox,
        blocking: Blocking,
        service: Lifecycle,
    ) -> SandboxView:
        """A create from the caller's snapshot (its image, its /workspace as it is there)."""
        name = request.from_snapshot or ""
        if request.workspace is not None or mounts_workspace(request.mounts):
            raise fork_workspace_refusal(name)
        # The caller's own, or not_found: never a pull of a name the engine does not have.
        held = await blocking(functools.partial(self._owned, who.acting_user(request.user), name))
        if not reaches_snapshot(who, held.line):
            raise no_snapshot(name)
        return await service.create(who, request, blocking)

    # --- the work, on a thread of its own ---------------------------------------------------

    def _take(self, sandbox: Sandbox, name: str) -> SnapshotView:
        image = snapshot_image(sandbox.user, name)
        held = self._held(sandbox.user)
        room = self._check_room(sandbox.user, name, held)
        attrs = self._engine.container(sandbox.container_id)
        if any(
            m.get("Destination") == "/workspace" and m.get("Type") == "bind"
            for m in attrs.get("Mounts") or []
        ):
            raise workspace_refusal(f"sandbox {sandbox.id} cannot be snapshotted")
        base = str(attrs["Config"].get("Image") or "")
        config = self._engine.image_config(str(attrs["Image"]))
        with self._pausing.frozen_for(sandbox):
            pid = int(self._engine.container(sandbox.container_id)["State"]["Pid"])
            workspace = self._workspace_of(pid)
            labels = self._labels(sandbox, name, base)
            too_many = functools.partial(_over_room, sandbox.user, held_by_forks(held))
            pipe = Pipe(room, too_many)
            self._import(sandbox.container_id, image, changes_of(config, labels), workspace, pipe)
        made = self._live(sandbox.user, name)
        view = made.view() if made is not None else None
        if made is None or view is None:
            raise SliceboxError(f"the engine has no snapshot {name} after its import; retry")
        self._check_size(sandbox.user, image, held, made)
        return view

    def _import(
        self, container: str, image: str, changes: list[str], workspace: str, pipe: Pipe
    ) -> None:
        export = functools.partial(self._engine.export, container)

        def rewrite(stream: BinaryIO, pipe: Pipe) -> None:
            write_snapshot(stream, workspace, pipe)

        pipe, producer = producing(f"snapshot-{container[:12]}", export, rewrite, pipe)
        try:
            self._engine.import_image(image, changes, pipe)
        finally:
            pipe.abandon()
            producer.join()

    def _labels(self, sandbox: Sandbox, name: str, base: str) -> dict[str, str]:
        return {
            LABEL: "true",
            LABEL_NAME: name,
            LABEL_USER: sandbox.user,
            LABEL_PROJECT: sandbox.project,
            LABEL_ORIGIN: sandbox.id,
            LABEL_ROOT_TASK: sandbox.lineage.root_task_id,
            LABEL_LINE: ",".join((*sandbox.lineage.ancestor_ids, sandbox.id)),
            LABEL_BASE: base,
            LABEL_CREATED: stamp(self._clock()),
        }

    def _check_room(self, user: str, name: str, held: list[HeldSnapshot]) -> int:
        """The bytes ``user``'s next snapshot may take, or a refusal. ``held``: the user's
        snapshots and retired images, whose bytes count until the engine has freed them."""
        bounds = self._sandboxes.config.snapshots
        live = [h for h in held if not h.retired]
        if any(h.name == name for h in live):
            raise AdmissionRefused(
                f"you have a snapshot named {name} already; choose another name or delete it",
                code="snapshot_exists",
            )
        used = sum(h.size_bytes for h in held)
        if len(live) >= bounds.max_count:
            raise quota_error(f"{user} holds {len(live)} snapshots, the most allowed")
        if used >= bounds.max_bytes_value:
            raise quota_error(
                f"{user}'s snapshots take {human_bytes(used)}, the most allowed is "
                f"{human_bytes(bounds.max_bytes_value)}{held_by_forks(held)}"
            )
        return bounds.max_bytes_value - used

    def _check_size(
        self, user: str, image: str, held: list[HeldSnapshot], made: HeldSnapshot
    ) -> None:
        """A snapshot that took the user past ``max_bytes`` is deleted again, and refused."""
        limit = self._sandboxes.config.snapshots.max_bytes_value
        used = sum(h.size_bytes for h in held) + made.size_bytes
        if used > limit:
            self._engine.remove_image(image)
            raise quota_error(
                f"this snapshot ({human_bytes(made.size_bytes)}) would take {user}'s snapshots "
                f"to {human_bytes(used)}, over the {human_bytes(limit)} allowed"
                f"{held_by_forks(held)}"
            )

    def _remove(self, held: HeldSnapshot) -> Removal:
        """The snapshot's image removed; one a fork still runs (which the engine keeps) is
        retired: given the agent's retired reference, then its snapshot's taken away. It is no
        snapshot any more (its name is free), but its bytes stay its owner's, counted, until
        the reaper removes it once nothing runs it (``snapshot_released``)."""
        removal = self._engine.remove_image(held.reference)
        if removal is not Removal.KEPT:
            return removal
        self._engine.tag_image(held.image_id, retired_image(held.user, held.name, held.image_id))
        self._engine.remove_image(held.reference)  # one of two references now: an untag
        return Removal.KEPT

    def _held(self, user: str | None, name: str | None = None) -> list[HeldSnapshot]:
        """``user``'s (every user's: None) snapshot images, attributed by the agent's own
        references: the labels only narrow the engine's list."""
        wanted = {LABEL: "true"}
        wanted |= {LABEL_USER: user} if user is not None else {}
        wanted |= {LABEL_NAME: name} if name is not None else {}
        found = [attribute(entry) for entry in self._engine.images(wanted)]
        return [h for h in found if h is not None and user in (None, h.user)]

    def _live(self, user: str, name: str) -> HeldSnapshot | None:
        return next((h for h in self._held(user, name) if not h.retired), None)

    def _owned(self, user: str, name: str) -> HeldSnapshot:
        found = self._live(user, name)
        if found is None:
            raise no_snapshot(name)
        return found
