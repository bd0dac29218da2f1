"""The tools' arguments, as models made of the agent's own fields.

Each field that the agent's API has is taken from its model (``CreateSandbox``,
``ExecRequest``, ``Extend``, ``FilesQuery``) with its type and bounds, so a tool's JSON schema
says what the agent will accept; what MCP adds is said here: a ``sandbox_id``, text or base64
in place of bytes, ``egress`` as a plain list, ``keep``. Arguments are parsed once, here, and
then become the agent's own request models, whose errors name the field and carry its stable
code (``invalid_command``, ``invalid_limit``...), as the socket answers them.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, TypeVar

from pydantic import ConfigDict, Field, ValidationError

from slicebox.model.api import CreateSandbox, Extend, RunRequest
from slicebox.model.base import Model
from slicebox.model.errors import InvalidRequest
from slicebox.model.exec import ExecRequest
from slicebox.model.files import FilesQuery
from slicebox.model.spec import Backend, Id, Workspace
from slicebox.model.validation import refusal
from slicebox.model.wasm import WasmSpec

M = TypeVar("M", bound=Model)

READ_DEFAULT = 1024 * 1024  # bytes a file read returns unless it asks for more
LIST_CAP = 1024 * 1024  # bytes of a directory listing kept


def _of(model: type[Model], name: str) -> Any:
    """The agent's own field (type, default, bounds), to declare it again here."""
    return model.model_fields[name]


class _Input(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SandboxArgs(_Input):
    """What a sandbox is made of: the create request's fields an agent asks for."""

    project: str | None = Field(default=None, description="project slice (default: the server's)")
    image: str | None = _of(CreateSandbox, "image")
    memory: int | str | None = _of(CreateSandbox, "memory")
    cpus: float | str | None = _of(CreateSandbox, "cpus")
    pids: int | str | None = _of(CreateSandbox, "pids")
    network: str | None = Field(
        default=None, description='"none" (default) or a mode the host allows'
    )
    egress: tuple[str, ...] = Field(
        default=(),
        description="hosts it may reach (names, *.domain, CIDRs, :port), as the operator allows",
    )
    env: dict[str, str] = _of(CreateSandbox, "env")
    workspace: Workspace | None = _of(CreateSandbox, "workspace")
    ttl_seconds: int | None = _of(CreateSandbox, "ttl_seconds")
    backend: Backend = _of(CreateSandbox, "backend")
    wasm: WasmSpec | None = _of(CreateSandbox, "wasm")
    root_task_id: Id | None = _of(CreateSandbox, "root_task_id")
    parent_id: Id | None = _of(CreateSandbox, "parent_id")
    reuse: bool = _of(CreateSandbox, "reuse")


class CreateArgs(SandboxArgs):
    keep: bool = Field(
        default=False,
        description="keep it when this MCP session ends (its TTL still applies)",
    )


class SandboxRef(_Input):
    sandbox_id: str = Field(min_length=1, max_length=256, description="the sandbox's id")


class ExecArgs(_Input):
    """An exec's fields; output bytes come back as text, or base64 when not UTF-8."""

    shell: bool = Field(default=False, description="argv is one shell line, run by sh -c")
    argv: tuple[str, ...] | str = Field(
        description="the program and its arguments (no shell), or one line with shell: true"
    )
    stdin: str = Field(default="", description="text given on stdin")
    stdin_base64: str | None = Field(default=None, description="bytes given on stdin, base64")
    env: dict[str, str] = _of(ExecRequest, "env")
    cwd: str = _of(ExecRequest, "cwd")
    timeout: float = _of(ExecRequest, "timeout")
    output_cap: int = _of(ExecRequest, "output_cap")


class ExecInArgs(ExecArgs, SandboxRef):
    pass


class RunArgs(ExecArgs):
    sandbox: SandboxArgs = Field(
        default_factory=SandboxArgs, description="the one-shot sandbox (default: the defaults)"
    )


class PathArgs(SandboxRef):
    path: str = _of(FilesQuery, "path")


class ReadArgs(PathArgs):
    max_bytes: int = Field(
        default=READ_DEFAULT, gt=0, description="bytes returned at most; beyond, truncated"
    )


class WriteArgs(PathArgs):
    content: str | None = Field(default=None, description="the file's text (UTF-8)")
    content_base64: str | None = Field(default=None, description="the file's bytes, base64")


class ListArgs(SandboxRef):
    path: str = Field(default="/workspace", description="a directory in the sandbox")


class UploadArgs(PathArgs):
    tar_base64: str = Field(description="a tar archive, base64, extracted into path")


class ExtendArgs(SandboxRef):
    ttl_seconds: int = _of(Extend, "ttl_seconds")


class NoArgs(_Input):
    pass


# --- arguments to the agent's requests -------------------------------------------------------


def parse(model: type[M], arguments: dict[str, Any]) -> M:
    try:
        return model.model_validate(arguments)
    except ValidationError as exc:
        raise refusal(exc) from exc


def decoded(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{field} is not base64: {exc}", field=field) from exc


def create_request(args: SandboxArgs, project: str, ttl: int) -> CreateSandbox:
    """The agent's create request; a sandbox made here always has a deadline."""
    fields = args.model_dump(exclude_unset=True, exclude={"keep", "egress"}, mode="json")
    if args.egress:
        if args.network is not None:
            raise InvalidRequest("give egress or network, not both", field="network")
        fields["network"] = {"egress": {"allow": list(args.egress)}}
    fields.setdefault("project", project)
    if fields.get("ttl_seconds") is None:
        fields["ttl_seconds"] = ttl
    return parse(CreateSandbox, {k: v for k, v in fields.items() if v is not None})


def exec_request(args: ExecArgs) -> ExecRequest:
    stdin = args.stdin.encode()
    if args.stdin_base64 is not None:
        if args.stdin:
            raise InvalidRequest("give stdin or stdin_base64, not both", field="stdin")
        stdin = decoded(args.stdin_base64, "stdin_base64")
    fields = args.model_dump(
        include={"shell", "argv", "env", "cwd", "timeout", "output_cap"}, exclude_unset=True
    )
    return ExecRequest.parse({**fields, "stdin": stdin})


def run_request(args: RunArgs, project: str, ttl: int) -> RunRequest:
    return RunRequest(sandbox=create_request(args.sandbox, project, ttl), exec=exec_request(args))


def content_of(args: WriteArgs) -> bytes:
    if (args.content is None) == (args.content_base64 is None):
        raise InvalidRequest("give content (text) or content_base64 (bytes)", field="content")
    if args.content_base64 is not None:
        return decoded(args.content_base64, "content_base64")
    return (args.content or "").encode()
