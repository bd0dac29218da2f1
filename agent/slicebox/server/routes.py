"""The ``/v1`` routes: parse at the edge, call :class:`~slicebox.service.Service`, serialize.

Docker and systemd calls block, so each runs on a bounded pool of worker threads
(:mod:`slicebox.server.pools`): short steps on the calls pool, execs on the exec pool, so
long-running commands never make a list or a create wait. The event loop stays free to answer
other callers and to ping systemd's watchdog. Streaming exec answers newline-delimited JSON:
``{"stream": "stdout", "data": <base64>}`` chunks as output is produced, then one
``{"result": {...}}``. A bounded asyncio queue between the exec's thread and the socket keeps
memory flat whatever the command prints; a caller that goes away ends the exec (its processes
are killed).
An exec's share of the output budget is reserved before it starts and held until its answer is
sent (see :mod:`slicebox.core.budget`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from slicebox.core.service import Service
from slicebox.model.api import (
    CreateSandbox,
    Destroyed,
    DestroyedList,
    ErrorBody,
    Extend,
    ReapRequest,
    RunRequest,
    RunResult,
    SandboxList,
    SandboxView,
    UsageAnswer,
)
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecRequest, ExecResult, StreamChunk
from slicebox.model.reaper import Report
from slicebox.model.usage import LevelNode
from slicebox.server.api import (
    MAX_EXEC_BODY_BYTES,
    Route,
    base_routes,
    identity_of,
    json_ok,
    parse_body,
)
from slicebox.server.pools import pools_of, run_in

log = logging.getLogger(__name__)
T = TypeVar("T")
STREAM_QUEUE = 16
HANDOFF_POLL = 0.5  # how often a blocked producer looks whether its caller is gone
_DONE = object()


SERVICE = web.AppKey("slicebox.service", Service)


def _service(request: web.Request) -> Service:
    return request.app[SERVICE]


def _routes() -> list[Route]:
    """Every route of the agent: data; the app they are served by holds the Service."""

    async def create(request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, CreateSandbox)
        view = await _call(request, _service(request).create, identity_of(request), body)
        return json_ok(view, status=201)

    async def list_sandboxes(request: web.Request) -> web.StreamResponse:
        return json_ok(
            SandboxList(
                await _call(request, _service(request).list_sandboxes, identity_of(request))
            )
        )

    async def get(request: web.Request) -> web.StreamResponse:
        return json_ok(
            await _call(request, _service(request).get, identity_of(request), _id(request))
        )

    async def destroy(request: web.Request) -> web.StreamResponse:
        return json_ok(
            await _call(request, _service(request).destroy, identity_of(request), _id(request))
        )

    async def destroy_task(request: web.Request) -> web.StreamResponse:
        root = request.match_info["root_task_id"]
        return json_ok(
            DestroyedList(
                await _call(request, _service(request).destroy_tree, identity_of(request), root)
            )
        )

    async def exec_(request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, ExecRequest, MAX_EXEC_BODY_BYTES)
        service, who = _service(request), identity_of(request)
        with await _call(
            request, service.reserve, who, body.output_cap, "exec", _id(request)
        ) as held:
            result = await _exec(request, service.exec, who, _id(request), body, held)
            return await _sent(request, json_ok(result))

    async def exec_stream(request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, ExecRequest, MAX_EXEC_BODY_BYTES)
        service, who = _service(request), identity_of(request)
        with await _call(
            request, service.reserve, who, body.output_cap, "exec", _id(request)
        ) as held:
            return await _stream(request, service.exec_stream(who, _id(request), body, held))

    async def run(request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, RunRequest, MAX_EXEC_BODY_BYTES)
        service, who = _service(request), identity_of(request)
        with await _call(request, service.reserve, who, body.exec.output_cap, "run") as held:
            return await _sent(request, json_ok(await _exec(request, service.run, who, body, held)))

    async def usage(request: web.Request) -> web.StreamResponse:
        found = await _call(request, _service(request).usage, identity_of(request), _id(request))
        return json_ok(UsageAnswer(usage=found))

    async def tree(request: web.Request) -> web.StreamResponse:
        return json_ok(await _call(request, _service(request).level_tree, identity_of(request)))

    async def extend(request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, Extend)
        return json_ok(
            await _call(request, _service(request).extend, identity_of(request), _id(request), body)
        )

    async def reap(request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, ReapRequest)
        return json_ok(await _call(request, _service(request).reap, identity_of(request), body))

    return [
        *base_routes(),
        Route("POST", "/sandboxes", create, "Create a sandbox", CreateSandbox, SandboxView),
        Route("GET", "/sandboxes", list_sandboxes, "Your sandboxes", None, SandboxList),
        Route("GET", "/sandboxes/{id}", get, "One sandbox", None, SandboxView),
        Route("DELETE", "/sandboxes/{id}", destroy, "Destroy; final usage", None, Destroyed),
        Route("POST", "/sandboxes/{id}/exec", exec_, "Run a command", ExecRequest, ExecResult),
        Route(
            "POST",
            "/sandboxes/{id}/exec/stream",
            exec_stream,
            "Run a command, output as NDJSON chunks then the result",
            ExecRequest,
            StreamChunk,
        ),
        Route("GET", "/sandboxes/{id}/usage", usage, "ResourceUsage", None, UsageAnswer),
        Route(
            "POST",
            "/sandboxes/{id}/deadline",
            extend,
            "Move the deadline to ttl_seconds from now",
            Extend,
            SandboxView,
        ),
        Route(
            "DELETE",
            "/tasks/{root_task_id}",
            destroy_task,
            "Destroy a root task's sandboxes, deepest first",
            None,
            DestroyedList,
        ),
        Route("POST", "/run", run, "One-shot: create, exec, destroy", RunRequest, RunResult),
        Route(
            "GET", "/usage/tree", tree, "The level tree with OOM/throttle blame", None, LevelNode
        ),
        Route(
            "POST",
            "/reaper",
            reap,
            "One reaper pass now (admins); dry_run only plans",
            ReapRequest,
            Report,
        ),
    ]


ROUTES = _routes()


def _id(request: web.Request) -> str:
    return request.match_info["id"]


async def _call(request: web.Request, function: Callable[..., T], *args: Any) -> T:
    """A request's short blocking step (Docker, systemd, cgroupfs) on the calls pool."""
    return await run_in(pools_of(request).calls, function, *args)


async def _exec(request: web.Request, function: Callable[..., T], *args: Any) -> T:
    """An exec holds its thread until the command ends: the exec pool, never the calls one."""
    return await run_in(pools_of(request).execs, function, *args)


async def _sent(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Send the answer now, while the exec's output budget is still held for it: a caller that
    reads slowly keeps its share reserved instead of leaving an unaccounted copy queued."""
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        pass  # the caller went away; its exec is audited, nothing is left to answer
    return response


async def _stream(
    request: web.Request, events: Iterator[StreamChunk | ExecResult]
) -> web.StreamResponse:
    """Pump ``events`` on one exec-pool thread into a bounded queue on the loop; the socket
    writes from the loop. A full queue holds the exec back; a caller that is gone stops it."""
    loop = asyncio.get_running_loop()
    pool = pools_of(request).execs
    first = await run_in(pool, _first, events)  # errors before any output are plain errors
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    items: asyncio.Queue[object] = asyncio.Queue(maxsize=STREAM_QUEUE)
    gone = threading.Event()
    producer = loop.run_in_executor(pool, _produce, first, events, _Handoff(loop, items, gone))
    try:
        while (item := await items.get()) is not _DONE:
            await response.write(_line(item))
    except ConnectionError:
        # A caller that closes its stream early (Ctrl-C, a client's close()) is not a failure
        # of the agent: the producer stops and closes the exec, and nothing is left to answer.
        gone.set()
        return response
    except BaseException:
        gone.set()  # the producer stops and closes the exec
        raise
    finally:
        if gone.is_set():
            _drain(items)
    await producer
    await response.write_eof()
    return response


class _Handoff:
    """The producer thread's side of the queue: put with backpressure until the caller is gone."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, items: asyncio.Queue[object], gone: threading.Event
    ) -> None:
        self._loop = loop
        self._items = items
        self.gone = gone

    def put(self, item: object) -> bool:
        while not self.gone.is_set():
            future = asyncio.run_coroutine_threadsafe(self._items.put(item), self._loop)
            try:
                future.result(timeout=HANDOFF_POLL)
                return True
            except concurrent.futures.TimeoutError:
                future.cancel()
            except (RuntimeError, concurrent.futures.CancelledError):
                return False  # the loop is closing or the put was cancelled
        return False


def _first(events: Iterator[StreamChunk | ExecResult]) -> object:
    return next(events, _DONE)


def _produce(first: object, events: Iterator[object], handoff: _Handoff) -> None:
    try:
        if first is not _DONE and handoff.put(first):
            for event in events:
                if not handoff.put(event):
                    break
    except SliceboxError as exc:
        handoff.put(ErrorBody(code=exc.code, message=exc.message))
    except Exception:
        log.exception("streaming exec failed")
        handoff.put(ErrorBody(code="internal", message="the agent failed; see its journal"))
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()  # closing the exec stream early kills the exec's processes
        handoff.put(_DONE)


def _drain(items: asyncio.Queue[object]) -> None:
    """Free a producer blocked on a full queue once nobody reads it."""
    while not items.empty():
        items.get_nowait()


def _line(event: object) -> bytes:
    if isinstance(event, ExecResult):
        return b'{"result": ' + event.model_dump_json().encode() + b"}\n"
    if isinstance(event, ErrorBody):
        return b'{"error": ' + event.model_dump_json().encode() + b"}\n"
    assert isinstance(event, BaseModel)
    return event.model_dump_json().encode() + b"\n"
