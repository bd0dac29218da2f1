"""The MCP server: the SDK's low-level ``Server`` (1.x) with slicebox's tools and resources, on
stdio, for one session; ``main`` is ``python -m slicebox.mcp``.

The low-level server rather than the SDK's high-level one: each tool's schema is its arguments'
model (the agent's own fields), not a Python signature's, and every refusal answers an
``isError`` result that keeps slicebox's stable code and message. A session's end (stdin
closed, SIGTERM, SIGINT) cancels the calls in flight, whose connections to the agent close, so
the agent kills their commands and audits them ``abandoned``; then the sandboxes it made and
did not keep are destroyed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import stat
import sys
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import anyio
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import McpError
from pydantic import AnyUrl

from slicebox import __version__
from slicebox.mcp import inputs
from slicebox.mcp.calls import Progress
from slicebox.mcp.options import parser
from slicebox.mcp.outputs import Json, error, error_text
from slicebox.mcp.session import Session, Settings
from slicebox.mcp.tools import TOOLS
from slicebox.model.errors import InvalidRequest, NotFound, SliceboxError

log = logging.getLogger(__name__)

TREE_URI = "slicebox://tree"
USAGE_TEMPLATE = "slicebox://sandboxes/{sandbox_id}/usage"
JSON_MEDIA = "application/json"
INSTRUCTIONS = (
    "Sandboxes on this host through slicebox: create one (sandbox_create), run commands in it "
    "(sandbox_exec), move files (file_read, file_write, tree_upload, tree_download), destroy "
    "it; or run one command in a fresh sandbox (run). Errors carry a stable code."
)


def build(session: Session) -> Server[Any, Any]:
    server: Server[Any, Any] = Server("slicebox", version=__version__, instructions=INSTRUCTIONS)

    async def list_tools() -> list[types.Tool]:
        return [spec.tool() for spec in TOOLS.values()]

    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        try:
            answer = await _called(server, session, name, arguments)
        except SliceboxError as exc:
            return refused(exc)
        text = types.TextContent(type="text", text=json.dumps(answer))
        return types.CallToolResult(content=[text], structuredContent=answer)

    async def read_resource(uri: AnyUrl) -> Iterable[ReadResourceContents]:
        try:
            answer = await _read(session, str(uri))
        except SliceboxError as exc:
            raise McpError(types.ErrorData(code=types.INVALID_PARAMS, **_said(exc))) from exc
        return [ReadResourceContents(json.dumps(answer), JSON_MEDIA)]

    # The SDK's decorators are untyped: registered here, once.
    server.list_tools()(list_tools)  # type: ignore[no-untyped-call]
    server.call_tool(validate_input=False)(call_tool)
    server.list_resources()(_resources)  # type: ignore[no-untyped-call]
    server.list_resource_templates()(_templates)  # type: ignore[no-untyped-call]
    server.read_resource()(read_resource)  # type: ignore[no-untyped-call]
    return server


def refused(exc: SliceboxError) -> types.CallToolResult:
    """An error as MCP answers a tool's: ``isError``, its code and message in both forms."""
    text = types.TextContent(type="text", text=error_text(exc))
    return types.CallToolResult(content=[text], structuredContent=error(exc), isError=True)


def _said(exc: SliceboxError) -> dict[str, Any]:
    return {"message": error_text(exc), "data": error(exc)}


async def _called(
    server: Server[Any, Any], session: Session, name: str, arguments: dict[str, Any]
) -> Json:
    spec = TOOLS.get(name)
    if spec is None:
        raise InvalidRequest(f"there is no tool {name!r}; tools/list names them")
    args = inputs.parse(spec.args, arguments)
    if spec.streams:
        return await spec.call(session, args, _progress(server))
    return await spec.call(session, args)


def _progress(server: Server[Any, Any]) -> Progress | None:
    """Progress for this request when its caller asked for it (a progressToken), else None."""
    context = server.request_context
    token = context.meta.progressToken if context.meta is not None else None
    if token is None:
        return None

    async def send(done: float, message: str) -> None:
        await context.session.send_progress_notification(
            token, done, None, message, related_request_id=str(context.request_id)
        )

    return Progress(send)


# --- resources -------------------------------------------------------------------------------


async def _resources() -> list[types.Resource]:
    return [
        types.Resource(
            uri=AnyUrl(TREE_URI),
            name="level-tree",
            title="The level tree",
            description="Every level you may see: memory, CPU, pids, OOM kills (as level_tree)",
            mimeType=JSON_MEDIA,
        )
    ]


async def _templates() -> list[types.ResourceTemplate]:
    return [
        types.ResourceTemplate(
            uriTemplate=USAGE_TEMPLATE,
            name="sandbox-usage",
            title="A sandbox's resource usage",
            description="ResourceUsage from cgroup v2 (as sandbox_usage)",
            mimeType=JSON_MEDIA,
        )
    ]


async def _read(session: Session, uri: str) -> Json:
    if uri == TREE_URI:
        return await _answer(session.client.level_tree())
    prefix, suffix = "slicebox://sandboxes/", "/usage"
    sandbox_id = uri.removeprefix(prefix).removesuffix(suffix)
    if uri.startswith(prefix) and uri.endswith(suffix) and sandbox_id and "/" not in sandbox_id:
        return await _answer(session.client.usage(sandbox_id))
    raise NotFound(f"no resource {uri}; resources/list and resources/templates/list name them")


async def _answer(pending: Any) -> Json:
    found: Json = (await pending).model_dump(mode="json")
    return found


# --- stdio and the process -------------------------------------------------------------------


class _Lines:
    """Stdin's lines read on the event loop, so a session's end can cancel the read (the SDK's
    own reader waits in a thread that nothing interrupts). Duck-types ``anyio.AsyncFile``."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        line = await self._reader.readline()
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


async def _stdin(limit: int) -> _Lines | None:
    """Stdin on the loop when it is a pipe or a socket (what an MCP client gives); None (the
    SDK's own reader) otherwise: epoll refuses a regular file and /dev/null."""
    mode = os.fstat(sys.stdin.fileno()).st_mode
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return None
    reader = asyncio.StreamReader(limit=limit)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return _Lines(reader)


@contextlib.contextmanager
def _stopped_by_signals(scope: anyio.CancelScope) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(number, scope.cancel)
    try:
        yield
    finally:
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(number)


async def serve(settings: Settings) -> None:
    """One MCP session on stdin and stdout, until stdin closes or a signal ends it."""
    session = Session.open(settings)
    server = build(session)
    # A line holds one request: a tool call's base64 is 4/3 of what it moves, and some JSON.
    lines = await _stdin(limit=settings.max_transfer * 2 + 1024 * 1024)
    try:
        with anyio.CancelScope() as scope, _stopped_by_signals(scope):
            async with stdio_server(stdin=lines) as (read, write):  # type: ignore[arg-type]
                await server.run(read, write, server.create_initialization_options())
    finally:
        with anyio.CancelScope(shield=True):
            await session.close()


@contextlib.asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[Server[Any, Any]]:
    """A server and its session for a transport of the caller's (the tests' memory streams);
    the session's sandboxes are destroyed on exit, as at the end of ``serve``."""
    session = Session.open(settings)
    try:
        yield build(session)
    finally:
        with anyio.CancelScope(shield=True):
            await session.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="slicebox mcp: %(message)s"
    )
    try:
        options = parser().parse_args(argv)
        settings = Settings(options.socket, options.project, options.ttl, options.max_transfer)
    except (SliceboxError, ValueError) as exc:
        print(f"slicebox mcp: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(settings))
    return 0
