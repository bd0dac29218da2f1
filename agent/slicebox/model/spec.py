"""The request to create a sandbox, as a later HTTP API takes it: strict, unknown fields refused.

Limits are accepted as written (``'256MB'``, ``0.5``, ``100``) and parsed by the policy, so an
unparsable value like ``'lots'`` gets the stable ``invalid_limit`` code naming the field; schema
errors get their field's code too (:mod:`slicebox.model.validation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from slicebox.model.validation import refusal

Id = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
# A workspace volume's name as the caller gives it; Docker's own is prefixed with the user.
VolumeName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class Backend(StrEnum):
    DOCKER = "docker"


class MountKind(StrEnum):
    BIND = "bind"
    VOLUME = "volume"


class Mount(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: MountKind = MountKind.BIND
    source: str = Field(min_length=1)
    target: str = Field(pattern=r"^/")
    read_only: bool = False


class WorkspaceKind(StrEnum):
    HOST = "host"  # a directory under the caller's own bind roots
    VOLUME = "volume"  # a Docker volume slicebox makes for the caller, with lineage labels


class Workspace(BaseModel):
    """What the sandbox finds at ``/workspace``; without one it is a tmpfs that goes with it.

    ``host``: ``path`` is a directory under one of the caller's ``bind_roots``, resolved by
    the kernel (no symlink, ``..`` or mount crossing) and mounted as is; the sandbox runs as
    the caller's own uid:gid, so what it writes there is theirs.
    ``volume``: a volume made for this sandbox, labelled with its lineage and removed with
    its root task; ``name`` names it so that a later sandbox of the same user can mount it
    again, and ``keep`` keeps it after its root task is gone."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: WorkspaceKind
    path: str | None = Field(default=None, min_length=1)
    name: VolumeName | None = None
    keep: bool = False
    read_only: bool = False

    @model_validator(mode="after")
    def _fits_kind(self) -> Workspace:
        if self.kind is WorkspaceKind.HOST:
            if self.path is None:
                raise ValueError("a host workspace needs 'path', a directory under your roots")
            if self.name is not None or self.keep:
                raise ValueError("'name' and 'keep' are for a volume workspace; leave them out")
        elif self.path is not None:
            raise ValueError("'path' is for a host workspace; a volume workspace takes 'name'")
        return self


class SandboxSpec(BaseModel):
    """What a caller asks for. Everything left out gets the configured secure default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str
    project: str
    image: str | None = None
    command: tuple[str, ...] | None = None
    memory: int | str | None = None
    cpus: float | str | None = None
    pids: int | str | None = None
    network: str = "none"
    env: dict[str, str] = {}
    run_as: str | None = None
    workdir: str | None = None
    mounts: tuple[Mount, ...] = ()
    workspace: Workspace | None = None
    cap_add: tuple[str, ...] = ()
    privileged: bool = False
    pid_mode: str | None = None
    ipc_mode: str | None = None
    ttl_seconds: int | None = Field(default=None, gt=0)  # at most max_ttl_seconds: the policy
    task_id: Id | None = None
    root_task_id: Id | None = None
    parent_id: Id | None = None
    backend: Backend = Backend.DOCKER
    # No ``pool`` field until a warm pool acquires and releases members: a sandbox asked for
    # as a pool member was idle to the reaper and destroyed as surplus on its next pass.


def parse_spec(data: Mapping[str, object]) -> SandboxSpec:
    """A :class:`SandboxSpec` from untrusted data; errors name each offending field."""
    try:
        return SandboxSpec.model_validate(data)
    except ValidationError as exc:
        raise refusal(exc) from exc
