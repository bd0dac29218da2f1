"""The agent's API as data: every request and answer body of ``/v1``, shared by the server,
the OpenAPI document and the Python client (which imports nothing but this layer)."""

from datetime import datetime

from pydantic import ConfigDict, Field, JsonValue, RootModel, model_validator

from slicebox.model.base import Model
from slicebox.model.codes import answered
from slicebox.model.exec import ExecRequest, ExecResult
from slicebox.model.limits import Limits
from slicebox.model.spec import SandboxSpec
from slicebox.model.usage import ResourceUsage

_CODES: list[JsonValue] = [*answered()]


class ErrorBody(Model):
    """Every error answer. ``code`` is one of the registry's (:mod:`slicebox.model.codes`); the
    schema lists them, validation does not, so a client reads codes a newer agent adds."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(json_schema_extra={"enum": _CODES})
    message: str
    field: str | None = None


class Health(Model):
    model_config = ConfigDict(extra="forbid")

    status: str
    version: str
    user: str
    admin: bool
    engine: str = ""  # the container engine the agent uses and how it found it


class CreateSandbox(SandboxSpec):
    """A create request: ``user`` defaults to the caller (only admins may name another)."""

    user: str | None = None  # type: ignore[assignment]


class SandboxView(Model):
    model_config = ConfigDict(frozen=True)

    id: str
    container_id: str
    user: str
    project: str
    backend: str
    created_at: datetime
    expires_at: datetime | None
    root_task_id: str
    task_id: str
    parent_id: str
    depth: int
    limits: Limits
    workspace_volume: str = ""  # the Docker volume at /workspace, when it is one
    # "idle": a warm-pool member nobody acquired (listed, never usable, charged to no task);
    # "acquired": a member serving this sandbox's task; "": created cold.
    pool: str = ""
    # What its network egress allows (its allow-list, normalised); empty: no egress.
    egress: tuple[str, ...] = ()


class Destroyed(Model):
    model_config = ConfigDict(frozen=True)

    id: str
    destroyed: bool
    usage: ResourceUsage | None = None


class Extend(Model):
    """A new deadline, ``ttl_seconds`` from now; the labels keep the original one. More than
    the agent's ``max_ttl_seconds`` (a setting, so not in this schema) is ``ttl_too_long``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttl_seconds: int = Field(gt=0)


class ReapRequest(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    dry_run: bool = False


class RunRequest(Model):
    """The seeds' one-shot ``execute(request, config)``: a sandbox made, used once, destroyed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sandbox: CreateSandbox
    exec: ExecRequest

    @model_validator(mode="after")
    def _no_fork(self) -> "RunRequest":
        if self.sandbox.from_snapshot is not None:  # its workspace is copied by a create only
            raise ValueError("a one-shot run does not start from a snapshot; create --from, exec")
        return self


class RunResult(Model):
    model_config = ConfigDict(frozen=True)

    sandbox_id: str
    result: ExecResult
    usage: ResourceUsage | None


class SandboxList(RootModel[list[SandboxView]]):
    model_config = ConfigDict(defer_build=True)  # as slicebox.model.base.Model


class DestroyedList(RootModel[list[Destroyed]]):
    model_config = ConfigDict(defer_build=True)  # as slicebox.model.base.Model


class UsageAnswer(Model):
    model_config = ConfigDict(frozen=True)

    usage: ResourceUsage
