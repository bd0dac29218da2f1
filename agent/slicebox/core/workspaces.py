"""A sandbox's workspace and what comes with it: its workspace volume (made for it, or an
existing one of its user's), its git credentials, and a git workspace's clone.

A workspace volume is named for its user and labelled with its lineage (``VolumeLineage``): a
volume slicebox did not make, or another user's, is never given to a sandbox. It goes with its
root task's last sandbox unless it is kept.
"""

from __future__ import annotations

import logging

from slicebox.backends.base import WORKSPACE, SandboxBackend, VolumeInfo
from slicebox.core.credentials import MOUNTED_AT, CredentialStore
from slicebox.core.gitclone import clone
from slicebox.core.sandbox import Sandbox
from slicebox.model.config import Config
from slicebox.model.errors import Forbidden, PolicyViolation
from slicebox.model.labels import Lineage, VolumeLineage, decode_volume, selector
from slicebox.model.spec import Mount, MountKind, SandboxSpec, WorkspaceKind

log = logging.getLogger(__name__)


def check_volume_mounts(backend: SandboxBackend, spec: SandboxSpec) -> None:
    """A volume in ``mounts`` is one of the caller's own workspace volumes, never another
    user's, nor one slicebox did not make, nor a missing one (Docker would make it)."""
    for mount in spec.mounts:
        if mount.kind is MountKind.VOLUME:
            found = backend.volume(mount.source)
            if found is None:
                raise PolicyViolation(
                    f"volume {mount.source!r} does not exist; give a workspace of kind "
                    "volume to have slicebox make one",
                    code="mount_source_missing",
                )
            check_owner(found, spec.user)


def check_owner(volume: VolumeInfo, user: str) -> None:
    lineage = decode_volume(volume.labels)
    if lineage is None:
        raise PolicyViolation(
            f"volume {volume.name!r} was not made by slicebox; choose another name",
            code="volume_foreign",
        )
    if lineage.user != user:
        raise Forbidden(
            f"volume {volume.name!r} is another user's workspace; use a name of your own",
            code="volume_not_owned",
        )


def ensure_volume(
    backend: SandboxBackend, spec: SandboxSpec, lineage: Lineage
) -> VolumeInfo | None:
    """The workspace volume: an existing one of the caller's (a kept or named one), or a
    new one with the sandbox's lineage; the new one is returned (None otherwise), for
    the start to give to the sandbox's uid and a failed create to remove."""
    name = lineage.workspace_volume
    workspace = spec.workspace
    if not name or workspace is None:
        return None
    found = backend.volume(name)
    if found is not None:
        check_owner(found, spec.user)
        return None
    labels = VolumeLineage(
        user=spec.user,
        project=spec.project,
        root_task_id=lineage.root_task_id,
        sandbox_id=lineage.sandbox_id,
        keep=workspace.keep,
        created_at=lineage.created_at,
    ).to_labels()
    return backend.create_volume(name, labels)


def drop_volume(backend: SandboxBackend, volume: VolumeInfo | None) -> None:
    if volume is not None:
        backend.remove_volume(volume.name)


def credential_store(config: Config) -> CredentialStore:
    share = config.credentials.user_share_bytes()
    return CredentialStore(config.reaper.state_dir, share)


def write_credentials(config: Config, spec: SandboxSpec, sandbox_id: str) -> None:
    git = spec.credentials.git if spec.credentials else None
    if git is not None:
        credential_store(config).write(sandbox_id, git, spec.user)


async def clone_workspace(
    backend: SandboxBackend, config: Config, container_id: str, spec: SandboxSpec
) -> None:
    """A git workspace's clone, in the running sandbox (core.gitclone)."""
    workspace = spec.workspace
    if workspace is None or workspace.kind is not WorkspaceKind.GIT:
        return
    git = spec.credentials.git if spec.credentials else None
    secrets = (git.token.get_secret_value(),) if git else ()
    timeout = config.git_clone_timeout_seconds
    await clone(backend, container_id, workspace, timeout=timeout, secrets=secrets)
    log.info("cloned %s into %s", workspace.url, container_id[:12])


def release_volume(backend: SandboxBackend, sandbox: Sandbox) -> None:
    """Remove the sandbox's workspace volume with its root task's last sandbox, unless it
    is kept. One that stays (a sibling's destroy raced this one) is the reaper's
    (``volume_orphaned``)."""
    name = sandbox.lineage.workspace_volume
    volume = backend.volume(name) if name else None
    lineage = decode_volume(volume.labels) if volume else None
    if lineage is None or lineage.keep:
        return
    if backend.find(selector(root_task_id=lineage.root_task_id)):
        return
    if backend.remove_volume(name):
        log.info("removed workspace volume %s with its root task", name)


def volume_name(spec: SandboxSpec, sandbox_id: str) -> str:
    """A volume workspace's Docker name: the user's prefix keeps users' names apart (a name
    holds no '-', so none reads as another user's)."""
    workspace = spec.workspace
    if workspace is None or workspace.kind is WorkspaceKind.HOST:
        return ""
    name = workspace.name or sandbox_id.replace("-", "_")  # no '-': see spec.VolumeName
    return f"slicebox-{spec.user}-{name}"


def volume_mount(spec: SandboxSpec, lineage: Lineage) -> tuple[Mount, ...]:
    if not lineage.workspace_volume:
        return ()
    read_only = spec.workspace is not None and spec.workspace.read_only
    return (
        Mount(
            kind=MountKind.VOLUME,
            source=lineage.workspace_volume,
            target=WORKSPACE,
            read_only=read_only,
        ),
    )


def credentials_mount(config: Config, lineage: Lineage) -> tuple[Mount, ...]:
    if not lineage.credentials:
        return ()
    directory = credential_store(config).directory(lineage.sandbox_id)
    return (Mount(source=str(directory), target=MOUNTED_AT, read_only=True),)
