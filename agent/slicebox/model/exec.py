"""What an exec is on the wire: the request, its output chunks and its result.

``ExecRequest`` is parsed once, at the edge; every schema error names the field and carries
that field's own stable code (``invalid_command``, ``invalid_timeout``, ...). Output bytes travel
as base64 in JSON.
"""

import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, field_validator

from slicebox.model.base import Model
from slicebox.model.validation import refusal

DEFAULT_TIMEOUT = 30.0
DEFAULT_OUTPUT_CAP = 50_000
MAX_OUTPUT_CAP = 16 * 1024 * 1024
MAX_TIMEOUT = 24 * 3600.0
TIMEOUT_EXIT_CODE = 124


class OutputStream(StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"


_BYTES_AS_BASE64 = ConfigDict(frozen=True, ser_json_bytes="base64", val_json_bytes="base64")


class ExecRequest(Model):
    """One command to run in a sandbox. ``argv`` is run without a shell unless ``shell``."""

    model_config = ConfigDict(**_BYTES_AS_BASE64, extra="forbid")

    shell: bool = False
    argv: tuple[str, ...]
    stdin: bytes = b""
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = "/workspace"
    timeout: float = DEFAULT_TIMEOUT
    output_cap: int = Field(default=DEFAULT_OUTPUT_CAP, ge=0, le=MAX_OUTPUT_CAP)

    @field_validator("argv", mode="before")
    @classmethod
    def _argv(cls, value: object, info: Any) -> object:
        shell = bool(info.data.get("shell"))
        if value in ("", [], ()):
            raise ValueError("argv is empty: give the program to run as its first item")
        if isinstance(value, str):
            if not shell:
                raise ValueError("a string command needs shell: true; or pass a list of arguments")
            value = ("sh", "-c", value)
        elif shell and not _shell_form(value):
            raise ValueError("shell: true takes the command as one string")
        return value

    @field_validator("argv")
    @classmethod
    def _argv_items(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or not value[0]:
            raise ValueError("argv is empty: give the program to run as its first item")
        if any("\0" in item for item in value):
            raise ValueError("argv items cannot contain NUL bytes")
        return value

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0 or value > MAX_TIMEOUT:
            raise ValueError(f"timeout must be more than 0 and at most {MAX_TIMEOUT:.0f} seconds")
        return value

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("cwd must be an absolute path")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not key or "=" in key or "\0" in key + val for key, val in value.items()):
            raise ValueError("env names must be non-empty without '='; no NUL bytes")
        return value

    @classmethod
    def parse(cls, data: Mapping[str, object]) -> "ExecRequest":
        """The edge: untrusted input to a request, or a SliceboxError naming the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise refusal(exc) from exc

    @classmethod
    def parse_json(cls, raw: str | bytes) -> "ExecRequest":
        """Like ``parse``, from JSON (``stdin`` base64-encoded)."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise refusal(exc) from exc


def _shell_form(value: object) -> bool:
    """``("sh", "-c", command)``: what a shell command becomes, accepted back as it is so that
    a request survives its own serialization."""
    return isinstance(value, list | tuple) and len(value) == 3 and list(value[:2]) == ["sh", "-c"]


class StreamChunk(Model):
    """A piece of output as it was produced, tagged with its stream."""

    model_config = _BYTES_AS_BASE64

    stream: OutputStream
    data: bytes


class ExecResult(Model):
    """The outcome of one exec. Output is the head of each stream, see the module docstring."""

    model_config = _BYTES_AS_BASE64

    stdout: bytes
    stderr: bytes
    exit_code: int
    timed_out: bool
    oom_killed: bool
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_dropped_bytes: int
    stderr_dropped_bytes: int
    duration: float


class ExecState(Model):
    """What Docker says about an exec: its host pid (0 before start), running, exit code."""

    model_config = ConfigDict(frozen=True)

    pid: int
    running: bool
    exit_code: int | None
    # What the backend knows of how it ended beyond its code: "timeout" or "oom" (a wasm
    # call's runtime stopped it), None otherwise.
    verdict: str | None = None


ExecEvent = StreamChunk | ExecResult
