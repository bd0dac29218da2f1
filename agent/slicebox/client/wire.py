"""What both Python clients share: the agent's routes as data, and answers as models or errors.

``Client`` (http.client) and ``AsyncClient`` (asyncio) only move bytes over the unix socket;
everything about the API itself — paths, bodies, decoding, the error classes, the exec stream's
lines — lives here, so the two cannot drift apart. Like the clients, this imports nothing of
slicebox but ``slicebox.model``.

Errors: the envelope's stable ``code`` picks the class of ``slicebox.model.errors`` that declares
that code; a code no class declares falls back on the HTTP status, so a newer agent's codes still
arrive as the right branch of the tree (``.code`` keeps the exact code).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Generic, NamedTuple, TypeVar
from urllib.parse import quote, urlencode

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from slicebox.model import errors
from slicebox.model.api import (
    CreateSandbox,
    Destroyed,
    DestroyedList,
    ErrorBody,
    Extend,
    Health,
    ReapRequest,
    RunRequest,
    RunResult,
    SandboxList,
    SandboxView,
    UsageAnswer,
)
from slicebox.model.base import Model
from slicebox.model.capacity import Capacity, CapacityQuery
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult, StreamChunk
from slicebox.model.files import FilesQuery, FileStat, Transferred
from slicebox.model.pool import PoolList
from slicebox.model.progress import ProgressEvent, ProgressLine
from slicebox.model.reaper import Report
from slicebox.model.spec import SEND_SECRETS
from slicebox.model.usage import LevelNode

API_PREFIX = "/v1"
# An exec answers after its own timeout; the client waits that long plus this much more
# (the kill, the OOM verdict, a slow host) before it calls the agent silent.
EXEC_GRACE = 60.0
JSON_HEADERS = {"Content-Type": "application/json"}
MAX_BYTES_HEADER = "X-Slicebox-Files-Max-Bytes"  # a download's head: the agent's cap
MEDIA = {"tar": "application/x-tar", "file": "application/octet-stream"}

T = TypeVar("T", bound=BaseModel)
PULL_GRACE = 3600.0  # seconds a streamed create's read may wait (a pull that went silent)
ErrorClass = type[errors.SliceboxError]


class Call(NamedTuple, Generic[T]):
    """One request to the agent and the model its success answer is."""

    method: str
    path: str
    answer: type[T]
    body: bytes | None = None
    min_timeout: float = 0.0  # the client waits at least this long for an answer

    @property
    def target(self) -> str:
        return API_PREFIX + self.path


def _id(value: str) -> str:
    return quote(value, safe="")  # an id is one path segment, whatever it contains


def _body(model: BaseModel) -> bytes:
    """The request as sent: with its secrets (a git token), which every other dump masks."""
    return model.model_dump_json(exclude_unset=True, context=SEND_SECRETS).encode()


def _exec_fields(request: ExecRequest) -> dict[str, object]:
    return request.model_dump(mode="json", exclude_unset=True)


def _exec_body(request: ExecRequest) -> bytes:
    return TypeAdapter(dict[str, object]).dump_json(_exec_fields(request))


def _run_body(request: RunRequest) -> bytes:
    sandbox = request.sandbox.model_dump(mode="json", exclude_unset=True, context=SEND_SECRETS)
    fields: dict[str, object] = {"sandbox": sandbox, "exec": _exec_fields(request.exec)}
    return TypeAdapter(dict[str, object]).dump_json(fields)


def health() -> Call[Health]:
    return Call("GET", "/health", Health)


def create(spec: CreateSandbox) -> Call[SandboxView]:
    return Call("POST", "/sandboxes", SandboxView, _body(spec))


def create_stream(spec: CreateSandbox) -> Call[SandboxView]:
    """The streamed create: progress lines, then the sandbox (see ``EventDecoder``). Its
    reads wait as long as a pull may take (the agent's ``pull_timeout_seconds``)."""
    return Call("POST", "/sandboxes/stream", SandboxView, _body(spec), PULL_GRACE)


def list_sandboxes() -> Call[SandboxList]:
    return Call("GET", "/sandboxes", SandboxList)


def get(sandbox_id: str) -> Call[SandboxView]:
    return Call("GET", f"/sandboxes/{_id(sandbox_id)}", SandboxView)


def destroy(sandbox_id: str) -> Call[Destroyed]:
    return Call("DELETE", f"/sandboxes/{_id(sandbox_id)}", Destroyed)


def exec_(sandbox_id: str, request: ExecRequest) -> Call[ExecResult]:
    path = f"/sandboxes/{_id(sandbox_id)}/exec"
    return Call("POST", path, ExecResult, _exec_body(request), request.timeout + EXEC_GRACE)


def exec_stream(sandbox_id: str, request: ExecRequest) -> Call[ExecResult]:
    """The streaming exec: NDJSON chunks, then the ``ExecResult`` (see ``EventDecoder``)."""
    path = f"/sandboxes/{_id(sandbox_id)}/exec/stream"
    return Call("POST", path, ExecResult, _exec_body(request), request.timeout + EXEC_GRACE)


def usage(sandbox_id: str) -> Call[UsageAnswer]:
    return Call("GET", f"/sandboxes/{_id(sandbox_id)}/usage", UsageAnswer)


def level_tree() -> Call[LevelNode]:
    return Call("GET", "/usage/tree", LevelNode)


def extend(sandbox_id: str, request: Extend) -> Call[SandboxView]:
    return Call("POST", f"/sandboxes/{_id(sandbox_id)}/deadline", SandboxView, _body(request))


def destroy_task(root_task_id: str) -> Call[DestroyedList]:
    return Call("DELETE", f"/tasks/{_id(root_task_id)}", DestroyedList)


def run(request: RunRequest) -> Call[RunResult]:
    grace = request.exec.timeout + EXEC_GRACE
    return Call("POST", "/run", RunResult, _run_body(request), grace)


def run_stream(request: RunRequest) -> Call[RunResult]:
    """The streaming one-shot: NDJSON chunks, then the ``RunResult`` (see ``EventDecoder``)."""
    grace = request.exec.timeout + EXEC_GRACE
    return Call("POST", "/run/stream", RunResult, _run_body(request), grace)


def pools() -> Call[PoolList]:
    return Call("GET", "/pool", PoolList)


def capacity(query: CapacityQuery) -> Call[Capacity]:
    """What is left at each level and how many sandboxes of the query's shape fit; the
    query's fields in its query string, those left out not sent."""
    fields = urlencode(query.model_dump(mode="json", exclude_none=True))
    return Call("GET", f"/capacity?{fields}" if fields else "/capacity", Capacity)


def reap(request: ReapRequest) -> Call[Report]:
    return Call("POST", "/reaper", Report, _body(request))


def files(sandbox_id: str, query: FilesQuery, route: str = "files") -> Call[Transferred]:
    """A files route, ``path`` and ``format`` in its query string. Its body (an upload's) and
    its answer (a download's) are streams the clients move themselves; an upload answers
    ``Transferred``."""
    fields = urlencode(query.model_dump(mode="json"))
    return Call("PUT", f"/sandboxes/{_id(sandbox_id)}/{route}?{fields}", Transferred)


def file_stat(sandbox_id: str, query: FilesQuery) -> Call[FileStat]:
    return Call("GET", files(sandbox_id, query, "files/stat").path, FileStat)


def cut_off(query: FilesQuery, received: int, cap: int | None) -> errors.SliceboxError:
    """A download whose stream ended short: at the agent's cap exactly, that was the cap."""
    if cap is not None and received >= cap:
        return errors.TooLarge(
            f"{query.path} is larger than the agent's files_max_bytes ({cap} bytes): the "
            "download was stopped there; fetch less at a time (a subdirectory), or ask an "
            "operator to raise files_max_bytes",
        )
    return errors.InvalidRequest(
        f"the download of {query.path} was cut off after {received} bytes: tar or cat in the "
        "sandbox failed midway (a file it could not read?); the agent's journal says why "
        "(journalctl SLICEBOX_EVENT=file_transfer)",
        code="file_transfer_failed",
    )


def max_bytes(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


# --- answers --------------------------------------------------------------------------------


def answer(call: Call[T], status: int, raw: bytes) -> T:
    """The success model of ``call``, or the error the envelope names, raised."""
    if status >= 400:
        raise error_from(status, raw)
    try:
        return call.answer.model_validate_json(raw)
    except ValidationError as exc:
        raise bad_answer(f"{call.method} {call.target}", exc) from exc


def error_from(status: int, raw: bytes) -> errors.SliceboxError:
    try:
        body = ErrorBody.model_validate_json(raw)
    except ValidationError:
        text = raw[:200].decode(errors="replace")
        body = ErrorBody(code="http_error", message=f"the agent answered HTTP {status}: {text}")
    return error_of(body, status)


def error_of(body: ErrorBody, status: int) -> errors.SliceboxError:
    return error_class(body.code, status)(body.message, code=body.code, field=body.field)


def error_class(code: str, status: int) -> ErrorClass:
    """The class that declares ``code``; else the one branch that owns ``status``."""
    by_code = {kind.code: kind for kind in _tree(errors.SliceboxError)}
    if code in by_code:
        return by_code[code]
    owners = [kind for kind in errors.SliceboxError.__subclasses__() if kind.http_status == status]
    if len(owners) == 1:
        return owners[0]
    # Several branches share 409 and 500: only the root is sure. A 4xx no branch owns (413,
    # 405) is still the caller's request that cannot be taken as it is.
    return errors.InvalidRequest if not owners and 400 <= status < 500 else errors.SliceboxError


def _tree(root: ErrorClass) -> Iterator[ErrorClass]:
    yield root
    for child in root.__subclasses__():
        yield from _tree(child)


def bad_answer(what: str, exc: Exception) -> errors.Unavailable:
    return errors.Unavailable(
        f"the agent's answer to {what} is not what this client reads ({exc.__class__.__name__}); "
        "are the slicebox client and agent the same version?",
        code="agent_bad_answer",
    )


def unreachable(path: str, reason: str) -> errors.Unavailable:
    return errors.Unavailable(
        f"cannot connect to the agent at {path} ({reason}); is slicebox.socket active "
        "(systemctl status slicebox.socket) and are you in group slicebox?",
        code="agent_unreachable",
    )


def no_answer(path: str, timeout: float, exc: BaseException) -> errors.Unavailable:
    return errors.Unavailable(
        f"the agent at {path} did not answer ({exc.__class__.__name__}) within {timeout:.0f}s; "
        "check `systemctl status slicebox` and its journal",
        code="agent_no_answer",
    )


# --- the exec stream ------------------------------------------------------------------------


class _ResultLine(Model):
    model_config = ConfigDict(extra="forbid")

    result: ExecResult


class _RunLine(Model):
    model_config = ConfigDict(extra="forbid")

    run: RunResult


class _ErrorLine(Model):
    model_config = ConfigDict(extra="forbid")

    error: ErrorBody


class _CreatedLine(Model):
    model_config = ConfigDict(extra="forbid")

    created: SandboxView


_Line = StreamChunk | _ResultLine | _RunLine | _ErrorLine | ProgressLine | _CreatedLine
_LINE: TypeAdapter[_Line] = TypeAdapter(_Line)

OnProgress = Callable[[ProgressEvent], None]


class EventDecoder:
    """Bytes of the NDJSON exec stream, in pieces of any size, to chunks and the result (an
    exec's ``ExecResult``, a streamed run's ``RunResult``).

    A line can be megabytes (the result repeats the kept output), so the buffer is scanned
    only once per byte rather than re-joined per piece.
    """

    def __init__(self, what: str, on_progress: OnProgress | None = None) -> None:
        self.what = what
        self.finished = False
        self.created: SandboxView | None = None  # a streamed create's sandbox, at its end
        self._on_progress = on_progress
        self._buffer = bytearray()
        self._scanned = 0

    def feed(self, data: bytes) -> list[ExecEvent | RunResult]:
        self._buffer += data
        events: list[ExecEvent | RunResult] = []
        while (end := self._buffer.find(b"\n", self._scanned)) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            self._scanned = 0
            if line.strip() and (event := self._event(line)) is not None:
                events.append(event)
        self._scanned = len(self._buffer)
        return events

    def end(self) -> None:
        """At the end of the answer: a stream cut before its result is an agent gone silent."""
        if not self.finished:
            raise errors.Unavailable(
                f"the agent's answer to {self.what} ended before the command's result; "
                "check `systemctl status slicebox` and its journal",
                code="agent_no_answer",
            )

    def _event(self, line: bytes) -> ExecEvent | RunResult | None:
        """The line's event; None for progress (to ``on_progress``) and a create's end."""
        try:
            item = _LINE.validate_json(line)
        except ValidationError as exc:
            raise bad_answer(self.what, exc) from exc
        if isinstance(item, _ErrorLine):
            raise error_of(item.error, 500)
        if isinstance(item, _ResultLine):
            self.finished = True
            return item.result
        if isinstance(item, _RunLine):
            self.finished = True
            return item.run
        if isinstance(item, ProgressLine):
            if self._on_progress is not None:
                self._on_progress(item.progress)
            return None
        if isinstance(item, _CreatedLine):
            self.finished, self.created = True, item.created
            return None
        return item


# --- what a client created ------------------------------------------------------------------


class Created:
    """The sandboxes a client created and has not destroyed: its context manager's clean-up."""

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._lock = threading.Lock()  # a sync client may be shared by threads

    def add(self, sandbox_id: str) -> None:
        with self._lock:
            self._ids.append(sandbox_id)

    def discard(self, *sandbox_ids: str) -> None:
        with self._lock:
            self._ids = [known for known in self._ids if known not in sandbox_ids]

    def take(self) -> list[str]:
        """Newest first, so children made after their parents go first."""
        with self._lock:
            taken, self._ids = self._ids[::-1], []
        return taken
