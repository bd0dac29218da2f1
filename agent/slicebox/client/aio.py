"""The asyncio Python client: ``Client``'s methods as coroutines, over keep-alive connections
to the agent's unix socket (:mod:`slicebox.web.client`).

    async with AsyncClient() as agent:           # on exit, destroys what it created
        box = await agent.create(CreateSandbox(project="web"))
        async with aclosing(agent.exec_stream(box.id, ExecRequest(argv=("make",)))) as events:
            async for event in events:
                ...                              # StreamChunk..., then the ExecResult

An exec stream closed early (``aclose()``, or leaving ``aclosing``) closes its connection, and
the agent then kills the command. Without ``async with``, call ``aclose()`` when done.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable, Mapping
from types import TracebackType
from typing import Self, TypeVar

from pydantic import BaseModel

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
from slicebox.model.paths import agent_socket
from slicebox.model.reaper import Report
from slicebox.model.snapshots import PauseState, SnapshotDeleted, SnapshotView
from slicebox.model.usage import LevelNode, ResourceUsage
from slicebox.web.client import ClientResponse, HttpClient
from slicebox.web.message import BodyCutOff, ProtocolError

T = TypeVar("T", bound=BaseModel)

# An agent fires its tool calls in parallel and a running exec holds its connection until it
# ends: up to this many may be open at once (a unix socket's connection costs little); with 16,
# fifty parallel execs kept a list waiting for one (tests/unit/test_concurrency.py).
OPEN_CONNECTIONS = 100


class AsyncClient:
    def __init__(self, path: str | None = None, timeout: float = 300.0) -> None:
        """``path``: the agent's socket; left out, ``$SLICEBOX_SOCKET``'s (a nested sandbox's
        own), else ``/run/slicebox/slicebox.sock``."""
        self.path = path or agent_socket()
        self.timeout = timeout
        self._created = wire.Created()
        self._pool: HttpClient | None = None

    # --- the routes ---------------------------------------------------------------------------

    async def health(self) -> Health:
        return await self._call(wire.health())

    async def create(self, spec: CreateSandbox) -> SandboxView:
        view = await self._call(wire.create(spec))
        self._created.add(view.id)
        return view

    async def create_stream(
        self, spec: CreateSandbox, on_progress: wire.OnProgress | None = None
    ) -> SandboxView:
        """``Client.create_stream``: ``create``, its progress told to ``on_progress``."""
        call = wire.create_stream(spec)
        decoder = wire.EventDecoder(f"{call.method} {call.target}", on_progress)
        async with contextlib.aclosing(self._stream(call, decoder)) as got:
            async for _ in got:
                pass
        assert decoder.created is not None  # the decoder's end raises on a stream cut short
        self._created.add(decoder.created.id)
        return decoder.created

    async def list_sandboxes(self) -> list[SandboxView]:
        return (await self._call(wire.list_sandboxes())).root

    async def get(self, sandbox_id: str) -> SandboxView:
        return await self._call(wire.get(sandbox_id))

    async def destroy(self, sandbox_id: str) -> Destroyed:
        gone = await self._call(wire.destroy(sandbox_id))
        self._created.discard(sandbox_id)
        return gone

    async def destroy_task(self, root_task_id: str) -> list[Destroyed]:
        gone = (await self._call(wire.destroy_task(root_task_id))).root
        self._created.discard(*(each.id for each in gone))
        return gone

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        return await self._call(wire.exec_(sandbox_id, request))

    async def exec_stream(
        self, sandbox_id: str, request: ExecRequest
    ) -> AsyncGenerator[ExecEvent, None]:
        """Output chunks as the command produces them, then its ``ExecResult``."""
        async with contextlib.aclosing(self._stream(wire.exec_stream(sandbox_id, request))) as got:
            async for event in got:
                assert not isinstance(event, RunResult)  # an exec's stream ends with its result
                yield event

    async def run_stream(
        self, request: RunRequest, on_progress: wire.OnProgress | None = None
    ) -> AsyncGenerator[StreamChunk | RunResult, None]:
        """``Client.run_stream``: a one-shot's output chunks, then its ``RunResult``."""
        call = wire.run_stream(request)
        decoder = wire.EventDecoder(f"{call.method} {call.target}", on_progress)
        async with contextlib.aclosing(self._stream(call, decoder)) as got:
            async for event in got:
                assert not isinstance(event, ExecResult)  # a run's stream ends with a RunResult
                yield event

    async def usage(self, sandbox_id: str) -> ResourceUsage:
        return (await self._call(wire.usage(sandbox_id))).usage

    async def level_tree(self) -> LevelNode:
        return await self._call(wire.level_tree())

    async def extend(self, sandbox_id: str, request: Extend) -> SandboxView:
        return await self._call(wire.extend(sandbox_id, request))

    async def pause(self, sandbox_id: str) -> PauseState:
        return await self._call(snapshotwire.pause(sandbox_id))

    async def resume(self, sandbox_id: str) -> PauseState:
        return await self._call(snapshotwire.resume(sandbox_id))

    async def snapshot(self, sandbox_id: str, name: str) -> SnapshotView:
        return await self._call(snapshotwire.snapshot(sandbox_id, name))

    async def snapshots(self) -> list[SnapshotView]:
        return (await self._call(snapshotwire.snapshots())).root

    async def delete_snapshot(self, name: str) -> SnapshotDeleted:
        return await self._call(snapshotwire.delete_snapshot(name))

    async def run(self, request: RunRequest) -> RunResult:
        return await self._call(wire.run(request))

    async def capacity(self, query: CapacityQuery) -> Capacity:
        """``Client.capacity``: what is left at each level and how many of a shape fit."""
        return await self._call(wire.capacity(query))

    async def reap(self, request: ReapRequest | None = None) -> Report:
        return await self._call(wire.reap(request or ReapRequest()))

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        return await self._call(wire.file_stat(sandbox_id, FilesQuery(path=path)))

    async def upload(
        self,
        sandbox_id: str,
        path: str,
        data: AsyncIterable[bytes] | Iterable[bytes],
        file_format: FileFormat = FileFormat.TAR,
    ) -> Transferred:
        """``Client.upload``: ``data`` sent as it comes, never whole."""
        call = wire.files(sandbox_id, FilesQuery(path=path, format=file_format))
        # The body waits for the agent's go: an upload it refuses (too large, no such sandbox)
        # is answered before a byte is read, and that answer is heard, not a reset connection.
        headers = {"Content-Type": wire.MEDIA[file_format], "Expect": "100-continue"}
        async with self._failures(call):
            response = await self._send(call, body=data, headers=headers)
            return wire.answer(call, response.status, await response.read())

    async def download(
        self, sandbox_id: str, path: str, file_format: FileFormat = FileFormat.TAR
    ) -> AsyncGenerator[bytes, None]:
        """``Client.download``: pieces as they arrive; a stream cut off is an error."""
        query = FilesQuery(path=path, format=file_format)
        call = wire.files(sandbox_id, query)
        async with self._failures(call):
            response = await self._send(call, method="GET")  # the files route's other way
            if response.status >= 400:
                raise wire.error_from(response.status, await response.read())
            cap = wire.max_bytes(response.headers.get(wire.MAX_BYTES_HEADER))
            received = 0
            try:
                async for piece in response.iter_any():
                    received += len(piece)
                    yield piece
            except (BodyCutOff, ProtocolError) as exc:
                raise wire.cut_off(query, received, cap) from exc
            finally:
                response.close()  # not back to the pool: a stream left early must end

    # --- clean-up -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            failures: list[SliceboxError] = []
            for sandbox_id in self._created.take():
                try:
                    await self.destroy(sandbox_id)
                except SliceboxError as error:
                    failures.append(error)
            if failures and exc is None:
                raise failures[0]  # an error already on its way out says more; it is not masked
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    # --- transport ----------------------------------------------------------------------------

    def _http(self) -> HttpClient:
        if self._pool is None:
            self._pool = HttpClient(self._connect, limit=OPEN_CONNECTIONS)
        return self._pool

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            async with asyncio.timeout(self.timeout):
                return await asyncio.open_unix_connection(self.path)
        except OSError as exc:  # TimeoutError included
            raise _Unreachable(exc.strerror or str(exc) or exc.__class__.__name__) from exc

    async def _send(
        self,
        call: wire.Call[T],
        body: AsyncIterable[bytes] | Iterable[bytes] | bytes | None = None,
        headers: Mapping[str, str] | None = None,
        method: str | None = None,
    ) -> ClientResponse:
        if body is None and call.body:
            body, headers = call.body, wire.JSON_HEADERS
        wait = max(self.timeout, call.min_timeout)
        return await self._http().request(
            method or call.method, call.target, body=body, headers=headers, read_timeout=wait
        )

    @contextlib.asynccontextmanager
    async def _failures(self, call: wire.Call[T]) -> AsyncIterator[None]:
        """The transport's failures as the clients' errors: no agent there, or no answer."""
        try:
            yield
        except _Unreachable as exc:
            raise wire.unreachable(self.path, exc.reason) from exc
        except (OSError, ProtocolError) as exc:  # TimeoutError is an OSError
            raise wire.no_answer(self.path, max(self.timeout, call.min_timeout), exc) from exc

    async def _call(self, call: wire.Call[T]) -> T:
        async with self._failures(call):
            response = await self._send(call)
            return wire.answer(call, response.status, await response.read())

    async def _stream(
        self, call: wire.Call[T], decoder: wire.EventDecoder | None = None
    ) -> AsyncGenerator[ExecEvent | RunResult, None]:
        decoder = decoder or wire.EventDecoder(f"{call.method} {call.target}")
        async with self._failures(call):
            response = await self._send(call)
            if response.status >= 400:
                raise wire.error_from(response.status, await response.read())
            try:
                async for data in response.iter_any():
                    for event in decoder.feed(data):
                        yield event
                decoder.end()
            finally:
                if not decoder.finished:
                    response.close()  # not back to the pool: the agent must see us gone


class _Unreachable(Exception):
    """No connection to the agent's socket could be made (it is not there, or refuses us)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
