"""The request to create a sandbox, as a later HTTP API takes it: strict, unknown fields refused.

Limits are accepted as written (``'256MB'``, ``0.5``, ``100``) and parsed by the policy, so an
unparsable value like ``'lots'`` gets the stable ``invalid_limit`` code naming the field; schema
errors get their field's code too (:mod:`slicebox.model.validation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slicebox.model.validation import refusal

Id = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]


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
