"""The Python client for the agent's unix-socket API (standard library only; asyncio: see
``aio``).

One method per route, taking and returning the agent's own pydantic models. Errors arrive as the
agent's exception tree (``slicebox.model.errors``), chosen by the envelope's stable code, so a
script can catch ``NotFound`` or read ``.code``; a socket that is not there or an agent that does
not answer is ``Unavailable`` (``agent_unreachable`` / ``agent_no_answer``).

    with Client() as agent:                      # on exit, destroys what it created
        box = agent.create(CreateSandbox(project="web"))
        for event in agent.exec_stream(box.id, ExecRequest(argv=("make",))):
            ...                                  # StreamChunk..., then the ExecResult
        with open("out.tar", "wb") as out:       # files stream both ways, never whole
            for piece in agent.download(box.id, "/workspace/out"):
                out.write(piece)

Each call opens its own connection, so one client may be shared by threads. Closing an exec
stream early (``close()``, or leaving a ``with closing(...)`` block) closes its connection, and
the agent then kills the command.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Generator, Iterable, Iterator
from types import TracebackType
from typing import Any, BinaryIO, Self, TypeVar

from pydantic import BaseModel, TypeAdapter

from slicebox.client import snapshotwire, wire
from slicebox.model.api import (
    CreateSandbox,
    Destroyed,
    Extend,
    Health,
    ReapRequest,
    RunRequest,
    RunResult,
    SandboxView,
)
from slicebox.model.capacity import Capacity, CapacityQuery
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult, StreamChunk
from slicebox.model.files import FileFormat, FilesQuery, FileStat, Transferred
from slicebox.model.paths import AGENT_SOCKET, agent_socket
from slicebox.model.pool import PoolList
from slicebox.model.reaper import Report
from slicebox.model.snapshots import PauseState, SnapshotDeleted, SnapshotView
from slicebox.model.usage import LevelNode, ResourceUsage

DEFAULT_SOCKET = AGENT_SOCKET
READ_SIZE = 64 * 1024
T = TypeVar("T", bound=BaseModel)
_SILENT = (TimeoutError, ConnectionError, http.client.HTTPException)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError as exc:
            sock.close()
            raise wire.unreachable(self._path, exc.strerror or str(exc)) from exc
        self.sock = sock


class Client:
    def __init__(self, path: str | None = None, timeout: float = 300.0) -> None:
        """``path``: the agent's socket; left out, ``$SLICEBOX_SOCKET``'s (a nested sandbox's
        own), else ``/run/slicebox/slicebox.sock``."""
        self.path = path or agent_socket()
        self.timeout = timeout
        self._created = wire.Created()

    # --- the routes ---------------------------------------------------------------------------

    def health(self) -> Health:
        return self._call(wire.health())

    def create(self, spec: CreateSandbox) -> SandboxView:
        view = self._call(wire.create(spec))
        self._created.add(view.id)
        return view

    def create_stream(
        self, spec: CreateSandbox, on_progress: wire.OnProgress | None = None
    ) -> SandboxView:
        """``create``, its progress (an image's pull, a clone, the start) told to
        ``on_progress`` as it comes."""
        call = wire.create_stream(spec)
        decoder = wire.EventDecoder(f"{call.method} {call.target}", on_progress)
        for _ in self._stream(call, decoder):
            pass
        assert decoder.created is not None  # the decoder's end raises on a stream cut short
        self._created.add(decoder.created.id)
        return decoder.created

    def list_sandboxes(self) -> list[SandboxView]:
        return self._call(wire.list_sandboxes()).root

    def get(self, sandbox_id: str) -> SandboxView:
        return self._call(wire.get(sandbox_id))

    def destroy(self, sandbox_id: str) -> Destroyed:
        gone = self._call(wire.destroy(sandbox_id))
        self._created.discard(sandbox_id)
        return gone

    def destroy_task(self, root_task_id: str) -> list[Destroyed]:
        gone = self._call(wire.destroy_task(root_task_id)).root
        self._created.discard(*(each.id for each in gone))
        return gone

    def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        return self._call(wire.exec_(sandbox_id, request))

    def exec_stream(
        self, sandbox_id: str, request: ExecRequest
    ) -> Generator[ExecEvent, None, None]:
        """Output chunks as the command produces them, then its ``ExecResult``."""
        for event in self._stream(wire.exec_stream(sandbox_id, request)):
            assert not isinstance(event, RunResult)  # an exec's stream ends with an ExecResult
            yield event

    def usage(self, sandbox_id: str) -> ResourceUsage:
        return self._call(wire.usage(sandbox_id)).usage

    def level_tree(self) -> LevelNode:
        return self._call(wire.level_tree())

    def extend(self, sandbox_id: str, request: Extend) -> SandboxView:
        return self._call(wire.extend(sandbox_id, request))

    def pause(self, sandbox_id: str) -> PauseState:
        return self._call(snapshotwire.pause(sandbox_id))

    def resume(self, sandbox_id: str) -> PauseState:
        return self._call(snapshotwire.resume(sandbox_id))

    def snapshot(self, sandbox_id: str, name: str) -> SnapshotView:
        return self._call(snapshotwire.snapshot(sandbox_id, name))

    def snapshots(self) -> list[SnapshotView]:
        return self._call(snapshotwire.snapshots()).root

    def delete_snapshot(self, name: str) -> SnapshotDeleted:
        return self._call(snapshotwire.delete_snapshot(name))

    def run(self, request: RunRequest) -> RunResult:
        return self._call(wire.run(request))

    def run_stream(
        self, request: RunRequest, on_progress: wire.OnProgress | None = None
    ) -> Generator[StreamChunk | RunResult, None, None]:
        """A one-shot run's output chunks as the command produces them, then its ``RunResult``;
        closing it early kills the command, and its sandbox is removed all the same. A pull
        or a clone before the command is told to ``on_progress``."""
        call = wire.run_stream(request)
        decoder = wire.EventDecoder(f"{call.method} {call.target}", on_progress)
        for event in self._stream(call, decoder):
            assert not isinstance(event, ExecResult)  # a run's stream ends with a RunResult
            yield event

    def pools(self) -> PoolList:
        """The warm pools: key, ready and busy members, hit rate, refill time."""
        return self._call(wire.pools())

    def capacity(self, query: CapacityQuery) -> Capacity:
        """What each level (host, user, project) has left under its ceilings, and how many
        sandboxes of the query's shape a create admits now: ``CapacityQuery(project="web",
        memory="512MB")``, or ``pool=`` a pool key's fingerprint."""
        return self._call(wire.capacity(query))

    def reap(self, request: ReapRequest | None = None) -> Report:
        return self._call(wire.reap(request or ReapRequest()))

    def stat(self, sandbox_id: str, path: str) -> FileStat:
        """What is at ``path`` in the sandbox: a directory, a file, or something else."""
        return self._call(wire.file_stat(sandbox_id, FilesQuery(path=path)))

    def upload(
        self,
        sandbox_id: str,
        path: str,
        data: Iterable[bytes] | BinaryIO,
        file_format: FileFormat = FileFormat.TAR,
    ) -> Transferred:
        """Send ``data`` as it is read (never whole): a tar stream extracted into the directory
        ``path`` (made when missing), or with ``FileFormat.FILE`` one file's bytes written to
        ``path``. Over the agent's ``files_max_bytes`` it is ``TooLarge``."""
        call = wire.files(sandbox_id, FilesQuery(path=path, format=file_format))
        headers = {"Content-Type": wire.MEDIA[file_format]}
        conn = _UnixConnection(self.path, self.timeout)
        try:
            response = _send(conn, "PUT", call.target, _pieces(data), headers)
            return wire.answer(call, response.status, response.read())
        except _SILENT as exc:
            raise wire.no_answer(self.path, self.timeout, exc) from exc
        finally:
            conn.close()

    def download(
        self, sandbox_id: str, path: str, file_format: FileFormat = FileFormat.TAR
    ) -> Generator[bytes, None, None]:
        """``path`` as the sandbox's tar (or, ``FileFormat.FILE``, cat) writes it, in pieces as
        they arrive. A stream the agent cuts off is an error (``TooLarge`` at its cap), never a
        short tar; closing the generator early closes the connection, and the agent stops."""
        query = FilesQuery(path=path, format=file_format)
        conn = _UnixConnection(self.path, self.timeout)
        response: http.client.HTTPResponse | None = None
        try:
            response = _send(conn, "GET", wire.files(sandbox_id, query).target, None)
            if response.status >= 400:
                raise wire.error_from(response.status, response.read())
            yield from _body_of(response, query)
        except _SILENT as exc:
            raise wire.no_answer(self.path, self.timeout, exc) from exc
        finally:
            if response is not None:
                response.close()
            conn.close()

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Untyped JSON for what has no method (``/openapi.json``, a newer agent's routes)."""
        payload = None if body is None else TypeAdapter(Any).dump_json(body)
        status, raw = self._exchange(method, wire.API_PREFIX + path, payload, self.timeout)
        if status >= 400:
            raise wire.error_from(status, raw)
        return TypeAdapter(Any).validate_json(raw) if raw else None

    # --- clean-up -----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        failures: list[SliceboxError] = []
        for sandbox_id in self._created.take():
            try:
                self.destroy(sandbox_id)
            except SliceboxError as error:
                failures.append(error)
        if failures and exc is None:
            raise failures[0]  # an error already on its way out says more; it is not masked

    # --- transport ----------------------------------------------------------------------------

    def _call(self, call: wire.Call[T]) -> T:
        timeout = max(self.timeout, call.min_timeout)
        return wire.answer(call, *self._exchange(call.method, call.target, call.body, timeout))

    def _exchange(
        self, method: str, target: str, body: bytes | None, timeout: float
    ) -> tuple[int, bytes]:
        conn = _UnixConnection(self.path, timeout)
        try:
            response = _send(conn, method, target, body)
            return response.status, response.read()
        except _SILENT as exc:
            raise wire.no_answer(self.path, timeout, exc) from exc
        finally:
            conn.close()

    def _stream(
        self, call: wire.Call[T], decoder: wire.EventDecoder | None = None
    ) -> Generator[ExecEvent | RunResult, None, None]:
        timeout = max(self.timeout, call.min_timeout)
        conn = _UnixConnection(self.path, timeout)
        decoder = decoder or wire.EventDecoder(f"{call.method} {call.target}")
        response: http.client.HTTPResponse | None = None
        try:
            response = _send(conn, call.method, call.target, call.body)
            if response.status >= 400:
                raise wire.error_from(response.status, response.read())
            while not decoder.finished and (data := response.read1(READ_SIZE)):
                yield from decoder.feed(data)
            decoder.end()
        except _SILENT as exc:
            raise wire.no_answer(self.path, timeout, exc) from exc
        finally:
            if response is not None:
                response.close()  # http.client hands a closing socket over to the response
            conn.close()


def _send(
    conn: _UnixConnection,
    method: str,
    target: str,
    body: bytes | Iterable[bytes] | None,
    headers: dict[str, str] | None = None,
) -> http.client.HTTPResponse:
    # The agent may refuse a body before reading it all (too large): its answer says why.
    if headers is None:
        headers = wire.JSON_HEADERS if body else {}
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        conn.request(method, target, body=body, headers=headers)  # an iterable goes chunked
    return conn.getresponse()


def _pieces(data: Iterable[bytes] | BinaryIO) -> Iterator[bytes]:
    """A file read in large pieces (not by lines, as iterating it would), or the pieces."""
    read = getattr(data, "read", None)
    if read is None:
        yield from data
        return
    while piece := read(READ_SIZE):
        yield piece


def _body_of(response: http.client.HTTPResponse, query: FilesQuery) -> Iterator[bytes]:
    cap = wire.max_bytes(response.getheader(wire.MAX_BYTES_HEADER))
    received = 0
    try:
        while piece := response.read1(READ_SIZE):
            received += len(piece)
            yield piece
    except (http.client.IncompleteRead, ConnectionError) as exc:
        raise wire.cut_off(query, received, cap) from exc
