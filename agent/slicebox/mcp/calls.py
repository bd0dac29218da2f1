"""One coroutine per tool: its parsed arguments to the agent's request through the session's
client, and the answer to JSON (:mod:`slicebox.mcp.outputs`). An exec or a run given a
``Progress`` streams and reports its output as it comes; without one it is the plain request."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

import anyio

from slicebox.client.wire import OnProgress
from slicebox.mcp import inputs, outputs
from slicebox.mcp.outputs import Json
from slicebox.mcp.session import Session
from slicebox.model.api import Extend, RunResult
from slicebox.model.errors import NotFound, TooLarge
from slicebox.model.exec import ExecRequest, ExecResult, StreamChunk
from slicebox.model.files import FileFormat
from slicebox.model.progress import Phase, ProgressEvent

Send = Callable[[float, str], Awaitable[None]]
T = TypeVar("T")
PROGRESS_EVERY = 0.1  # seconds: at most one progress notification a period
MESSAGE_CHARS = 400  # of the latest output, in a progress notification's message


class Progress:
    """Output as it comes, as MCP progress: the bytes so far (which only grow) and the tail of
    the latest output, at most one notification a period, however fast the command prints."""

    def __init__(self, send: Send, clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._clock = clock
        self._last: float | None = None
        self.received = 0
        self._steps = 0  # notifications of the create's progress, before any output
        self._said: tuple[Phase, bool] | None = None

    def step(self, event: ProgressEvent) -> tuple[float, str] | None:
        """A pull's, clone's or start's progress as a notification, at most one a period
        but always at a phase's start and end: its value (a count, below the output's), its
        message; None when it waits."""
        finished = event.total is not None and event.done == event.total
        now = self._clock()
        fresh = self._said != (event.phase, finished)
        if not fresh and self._last is not None and now - self._last < PROGRESS_EVERY:
            return None
        self._last, self._said = now, (event.phase, finished)
        self._steps += 1
        return float(self._steps), event.describe()

    @property
    def send(self) -> Send:
        return self._send

    async def chunk(self, chunk: StreamChunk) -> None:
        if not chunk.data:
            return
        self.received += len(chunk.data)
        now = self._clock()
        if self._last is None or now - self._last >= PROGRESS_EVERY:
            self._last = now
            text = chunk.data.decode(errors="replace")[-MESSAGE_CHARS:]
            await self._send(self._steps + self.received, f"{chunk.stream.value}: {text}")


# --- sandboxes -------------------------------------------------------------------------------


async def create(session: Session, args: inputs.CreateArgs, progress: Progress | None) -> Json:
    settings = session.settings
    request = inputs.create_request(args, settings.project, settings.ttl)
    if progress is None:
        view = await session.client.create(request)
    else:
        view = await _reported(progress, lambda on: session.client.create_stream(request, on))
    session.add(view.id, args.keep)
    return {**outputs.model(view), "kept_after_session": args.keep}


async def list_sandboxes(session: Session, args: inputs.NoArgs) -> Json:
    views = await session.client.list_sandboxes()
    return {"sandboxes": [outputs.model(view) for view in views]}


async def get(session: Session, args: inputs.SandboxRef) -> Json:
    return outputs.model(await session.client.get(args.sandbox_id))


async def destroy(session: Session, args: inputs.SandboxRef) -> Json:
    gone = await session.client.destroy(args.sandbox_id)
    session.forget(args.sandbox_id)
    return outputs.model(gone)


async def extend(session: Session, args: inputs.ExtendArgs) -> Json:
    request = Extend(ttl_seconds=args.ttl_seconds)
    return outputs.model(await session.client.extend(args.sandbox_id, request))


async def usage(session: Session, args: inputs.SandboxRef) -> Json:
    return outputs.model(await session.client.usage(args.sandbox_id))


async def tree(session: Session, args: inputs.NoArgs) -> Json:
    return outputs.model(await session.client.level_tree())


# --- commands --------------------------------------------------------------------------------


async def exec_(session: Session, args: inputs.ExecInArgs, progress: Progress | None) -> Json:
    request = inputs.exec_request(args)
    if progress is None:
        return outputs.exec_result(await session.client.exec(args.sandbox_id, request))
    events = session.client.exec_stream(args.sandbox_id, request)
    result = await _streamed(events, progress)
    assert isinstance(result, ExecResult)  # an exec's stream ends with its result
    return outputs.exec_result(result)


async def run(session: Session, args: inputs.RunArgs, progress: Progress | None) -> Json:
    settings = session.settings
    request = inputs.run_request(args, settings.project, settings.ttl)
    if progress is None:
        return outputs.run_result(await session.client.run(request))
    result = await _reported(
        progress, lambda on: _streamed(session.client.run_stream(request, on), progress)
    )
    assert isinstance(result, RunResult)  # a run's stream ends with its RunResult
    return outputs.run_result(result)


async def _reported(progress: Progress, call: Callable[[OnProgress], Awaitable[T]]) -> T:
    """``call`` given a sink for the create's progress, each sent as a notification (in
    order: each is started as it comes, and ends with the call)."""

    async def send(done: float, message: str) -> None:
        await progress.send(done, message)

    async with anyio.create_task_group() as sending:

        def on(event: ProgressEvent) -> None:
            said = progress.step(event)
            if said is not None:
                sending.start_soon(send, *said)

        answered = [await call(on)]
    return answered[0]  # a task group may swallow an exception, for mypy: not this one


async def _streamed(
    events: AsyncGenerator[StreamChunk | ExecResult | RunResult, None], progress: Progress
) -> ExecResult | RunResult:
    """Report each chunk; the result. Left early (cancelled), the stream's connection closes,
    and the agent kills the command and audits it ``abandoned``."""
    async with aclosing(events) as stream:
        async for event in stream:
            if not isinstance(event, StreamChunk):
                return event
            await progress.chunk(event)
    raise AssertionError("the stream ends with its result")  # EventDecoder guarantees it


# --- files -----------------------------------------------------------------------------------


async def read_file(session: Session, args: inputs.ReadArgs) -> Json:
    limit = min(args.max_bytes, session.settings.max_transfer)
    data, more = await _fetched(session, args.sandbox_id, args.path, FileFormat.FILE, limit)
    return outputs.file_read(args.path, data, more)


async def write_file(session: Session, args: inputs.WriteArgs) -> Json:
    data = inputs.content_of(args)
    _bounded(session, len(data), args.path)
    client = session.client
    return outputs.model(await client.upload(args.sandbox_id, args.path, [data], FileFormat.FILE))


async def list_dir(session: Session, args: inputs.ListArgs) -> Json:
    argv = ("sh", "-c", outputs.LIST_SCRIPT, "sh", args.path)
    request = ExecRequest(argv=argv, cwd="/", output_cap=inputs.LIST_CAP)
    result = await session.client.exec(args.sandbox_id, request)
    if result.exit_code != 0:
        said = result.stderr.decode(errors="replace").strip()
        raise NotFound(
            f"{args.path} is not a directory the sandbox can list ({said or 'no reason given'})",
            code="file_not_found",
        )
    return outputs.listing(args.path, result)


async def upload(session: Session, args: inputs.UploadArgs) -> Json:
    data = inputs.decoded(args.tar_base64, "tar_base64")
    _bounded(session, len(data), args.path)
    return outputs.model(await session.client.upload(args.sandbox_id, args.path, [data]))


async def download(session: Session, args: inputs.PathArgs) -> Json:
    limit = session.settings.max_transfer
    data, more = await _fetched(session, args.sandbox_id, args.path, FileFormat.TAR, limit)
    if more:
        _bounded(session, limit + 1, args.path)
    return {"path": args.path, "tar_base64": outputs.base64_of(data), "bytes": len(data)}


async def _fetched(
    session: Session, sandbox_id: str, path: str, form: FileFormat, limit: int
) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes of a download, and whether there was more (then it is closed)."""
    kept = bytearray()
    async with aclosing(session.client.download(sandbox_id, path, form)) as pieces:
        async for piece in pieces:
            kept += piece
            if len(kept) > limit:
                return bytes(kept[:limit]), True
    return bytes(kept), False


def _bounded(session: Session, size: int, path: str) -> None:
    cap = session.settings.max_transfer
    if size > cap:
        raise TooLarge(
            f"{path}: more than {cap} bytes, what one MCP tool call moves (slicebox mcp "
            "--max-transfer); move less at a time (a subdirectory), or use slicebox cp",
        )
