"""The ``/v1`` routes: parse at the edge, call :class:`~slicebox.service.Service`, serialize.

Docker and systemd calls block, so each runs on a bounded pool of worker threads
(:mod:`slicebox.server.pools`); the event loop stays free to answer other callers and to ping
systemd's watchdog. An exec holds no thread while its command runs: the service reads its output
on the loop (``Service.exec``/``exec_stream``), where the look-up and Docker's exec create
and inspect are made too, and sends only its short steps (the cgroup reads, the kill at its
timeout, the audit record) to the calls pool.

A one-shot run answers once its exec has ended and its final usage is read: the removal of its
sandbox goes on after the answer, on the calls pool, and a graceful stop waits for it
(``Pools.aside``).

Streaming exec answers newline-delimited JSON: ``{"stream": "stdout", "data": <base64>}`` chunks
as output is produced, then one ``{"result": {...}}``. Each chunk is written to the response as
it comes, and the next output is read only once the socket has taken it (``await
response.write``), so memory stays flat whatever the command prints. A caller that goes away
ends the exec (its processes are killed and it is audited ``abandoned``).
An exec's part of the output budget is reserved before it starts and held until its answer is
sent (see :mod:`slicebox.core.budget`); a streamed one holds one of the streams in flight as
long (:mod:`slicebox.core.shares`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from slicebox.core.progress import with_progress
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
from slicebox.model.capacity import Capacity, CapacityQuery
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecRequest, ExecResult, StreamChunk
from slicebox.model.pool import PoolList
from slicebox.model.progress import ProgressEvent, ProgressLine
from slicebox.model.reaper import Report
from slicebox.model.usage import LevelNode
from slicebox.server.api import (
    MAX_EXEC_BODY_BYTES,
    Route,
    base_routes,
    identity_of,
    json_ok,
    parse_body,
    parse_query,
)
from slicebox.server.fileroutes import FILE_ROUTES
from slicebox.server.metrics import metrics
from slicebox.server.pools import pools_of, run_in
from slicebox.server.progresslines import created, progress_line
from slicebox.server.snapshotroutes import SNAPSHOT_ROUTES, fork, unpaused
from slicebox.server.state import service_of
from slicebox.web.request import Request
from slicebox.web.response import StreamResponse

log = logging.getLogger(__name__)
T = TypeVar("T")


# The handlers, one a route; the table below names each with its method, path and models.


async def create(request: Request) -> StreamResponse:
    body = await parse_body(request, CreateSandbox)
    if body.from_snapshot is not None:  # a fork (core.snapshots)
        return json_ok(await fork(request, body), status=201)
    view = await service_of(request).create(identity_of(request), body, pools_of(request).call)
    return json_ok(view, status=201)


async def create_stream(request: Request) -> StreamResponse:
    body = await parse_body(request, CreateSandbox)
    if body.from_snapshot is not None:  # a fork: its workspace copied in before it answers
        made = fork(request, body)
    else:
        made = service_of(request).create(identity_of(request), body, pools_of(request).call)
    return await _stream(request, with_progress(created(made)))


async def list_sandboxes(request: Request) -> StreamResponse:
    found = await service_of(request).list_sandboxes(identity_of(request), pools_of(request).call)
    return json_ok(SandboxList(found))


async def get(request: Request) -> StreamResponse:
    service, calls = service_of(request), pools_of(request).call
    return json_ok(await service.get(identity_of(request), _id(request), calls))


async def destroy(request: Request) -> StreamResponse:
    service, calls = service_of(request), pools_of(request).call
    return json_ok(await service.destroy(identity_of(request), _id(request), calls))


async def destroy_task(request: Request) -> StreamResponse:
    root = request.match_info["root_task_id"]
    service, calls = service_of(request), pools_of(request).call
    return json_ok(DestroyedList(await service.destroy_tree(identity_of(request), root, calls)))


async def exec_(request: Request) -> StreamResponse:
    body = await parse_body(request, ExecRequest, MAX_EXEC_BODY_BYTES)
    service, who = service_of(request), identity_of(request)
    calls = pools_of(request).call
    with await _call(request, service.reserve, who, body.output_cap, "exec", _id(request)) as held:
        result = await service.exec(who, _id(request), body, held, calls)
        return await _sent(request, json_ok(result))


async def exec_stream(request: Request) -> StreamResponse:
    body = await parse_body(request, ExecRequest, MAX_EXEC_BODY_BYTES)
    service, who = service_of(request), identity_of(request)
    calls = pools_of(request).call
    with await _call(
        request, service.reserve_stream, who, body.output_cap, "exec", _id(request)
    ) as held:
        events = service.exec_stream(who, _id(request), body, held, calls)
        return await _stream(request, events)


async def run(request: Request) -> StreamResponse:
    body = await parse_body(request, RunRequest, MAX_EXEC_BODY_BYTES)
    service, who, pools = service_of(request), identity_of(request), pools_of(request)
    with await _call(request, service.reserve, who, body.exec.output_cap, "run") as held:
        ran = await service.run(who, body, held, pools.call, pools.aside)
        return await _sent(request, json_ok(ran))


async def run_stream(request: Request) -> StreamResponse:
    body = await parse_body(request, RunRequest, MAX_EXEC_BODY_BYTES)
    service, who, pools = service_of(request), identity_of(request), pools_of(request)
    reserve = service.reserve_stream
    with await _call(request, reserve, who, body.exec.output_cap, "run") as held:
        events = service.run_stream(who, body, held, pools.call, pools.aside)
        return await _stream(request, with_progress(events, soft_first=True))


async def usage(request: Request) -> StreamResponse:
    service, calls = service_of(request), pools_of(request).call
    found = await service.usage(identity_of(request), _id(request), calls)
    return json_ok(UsageAnswer(usage=found))


async def tree(request: Request) -> StreamResponse:
    service, calls = service_of(request), pools_of(request).call
    return json_ok(await service.level_tree(identity_of(request), calls))


async def capacity(request: Request) -> StreamResponse:
    query = parse_query(request, CapacityQuery)
    service, calls = service_of(request), pools_of(request).call
    return json_ok(await service.capacity(identity_of(request), query, calls))


async def extend(request: Request) -> StreamResponse:
    body = await parse_body(request, Extend)
    service, calls = service_of(request), pools_of(request).call
    return json_ok(await service.extend(identity_of(request), _id(request), body, calls))


async def pools(request: Request) -> StreamResponse:
    return json_ok(service_of(request).pools(identity_of(request)))


async def reap(request: Request) -> StreamResponse:
    body = await parse_body(request, ReapRequest)
    service, calls = service_of(request), pools_of(request).call
    return json_ok(await service.reap(identity_of(request), body, calls))


# Every route of the agent: data; the app they are served by holds the Service.
ROUTES: list[Route] = [
    *base_routes(),
    Route("POST", "/sandboxes", create, "Create a sandbox", CreateSandbox, SandboxView),
    Route(
        "POST",
        "/sandboxes/stream",
        create_stream,
        "Create a sandbox, its progress as NDJSON lines, then the sandbox",
        CreateSandbox,
        ProgressLine,
    ),
    Route("GET", "/sandboxes", list_sandboxes, "Your sandboxes", None, SandboxList),
    Route("GET", "/sandboxes/{id}", get, "One sandbox", None, SandboxView),
    Route("DELETE", "/sandboxes/{id}", destroy, "Destroy; final usage", None, Destroyed),
    Route(
        "POST",
        "/sandboxes/{id}/exec",
        unpaused(exec_, MAX_EXEC_BODY_BYTES),
        "Run a command",
        ExecRequest,
        ExecResult,
    ),
    Route(
        "POST",
        "/sandboxes/{id}/exec/stream",
        unpaused(exec_stream, MAX_EXEC_BODY_BYTES),
        "Run a command, output as NDJSON chunks then the result",
        ExecRequest,
        StreamChunk,
    ),
    *FILE_ROUTES,
    *SNAPSHOT_ROUTES,
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
        "POST",
        "/run/stream",
        run_stream,
        "One-shot, its output as NDJSON chunks, then the run's result",
        RunRequest,
        StreamChunk,
    ),
    Route("GET", "/usage/tree", tree, "The level tree with OOM/throttle blame", None, LevelNode),
    Route(
        "GET",
        "/capacity",
        capacity,
        "What is left at each level and how many sandboxes of a shape fit, as admission counts",
        None,
        Capacity,
        query=CapacityQuery,
    ),
    Route("GET", "/pool", pools, "Warm pools: key, ready/busy, hit rate, refill", None, PoolList),
    Route(
        "POST",
        "/reaper",
        reap,
        "One reaper pass now (admins); dry_run only plans",
        ReapRequest,
        Report,
    ),
    Route(
        "GET",
        "/metrics",
        metrics,
        "Prometheus metrics (OpenMetrics when Accept asks); a non-admin sees their own series",
        raw_answer=True,
        prefix="",
        answer_types=("text/plain", "application/openmetrics-text"),
    ),
]

# What a nested sandbox's own socket serves besides the health (core.nesting): creates of its
# children and acts on its descendants; the service keeps each to its descendants. Any other
# route, one added later included, is refused there (``nested_refused``).
NESTED_ROUTES = frozenset(
    {
        ("POST", "/sandboxes"),
        ("POST", "/sandboxes/stream"),
        ("GET", "/sandboxes"),
        ("GET", "/sandboxes/{id}"),
        ("DELETE", "/sandboxes/{id}"),
        ("POST", "/sandboxes/{id}/exec"),
        ("POST", "/sandboxes/{id}/exec/stream"),
        ("PUT", "/sandboxes/{id}/files"),
        ("GET", "/sandboxes/{id}/files"),
        ("GET", "/sandboxes/{id}/files/stat"),
        ("GET", "/sandboxes/{id}/usage"),
        ("POST", "/sandboxes/{id}/deadline"),
        ("DELETE", "/tasks/{root_task_id}"),
        ("POST", "/run"),
        ("POST", "/run/stream"),
    }
)
ROUTES = [r._replace(nested=True) if (r.method, r.path) in NESTED_ROUTES else r for r in ROUTES]


def _id(request: Request) -> str:
    return request.match_info["id"]


async def _call(request: Request, function: Callable[..., T], *args: Any) -> T:
    """A request's short blocking step (Docker, systemd, cgroupfs) on the calls pool."""
    return await run_in(pools_of(request).calls, function, *args)


async def _sent(request: Request, response: StreamResponse) -> StreamResponse:
    """Send the answer now, while the exec's output budget is still held for it: a caller that
    reads slowly keeps its share reserved instead of leaving an unaccounted copy queued."""
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        pass  # the caller went away; its exec is audited, nothing is left to answer
    return response


async def _stream(request: Request, events: AsyncGenerator[object, None]) -> StreamResponse:
    """Write ``events`` as NDJSON lines as they come; leaving early closes ``events``, which
    kills the exec."""
    async with contextlib.aclosing(events):
        first = await anext(events, None)  # an error before any output is a plain error answer
        response = StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await response.prepare(request)
            item: object = first
            while item is not None:
                await response.write(_line(item))
                item = await _next_or_error(events)
            await response.write_eof()
        except ConnectionError:
            # A caller that closes its stream early (Ctrl-C, a client's close()) is not a failure
            # of the agent; nothing is left to answer.
            pass
    return response


async def _next_or_error(events: AsyncGenerator[object, None]) -> object:
    """The next event, None at the end; an error of the exec becomes the stream's last line."""
    try:
        return await anext(events, None)
    except SliceboxError as exc:
        return ErrorBody(code=exc.code, message=exc.message)
    except Exception:
        log.exception("streaming exec failed")
        return ErrorBody(code="internal", message="the agent failed; see its journal")


def _line(event: object) -> bytes:
    if isinstance(event, ExecResult):
        return b'{"result": ' + event.model_dump_json().encode() + b"}\n"
    if isinstance(event, RunResult):
        return b'{"run": ' + event.model_dump_json().encode() + b"}\n"
    if isinstance(event, ProgressEvent | SandboxView):
        return progress_line(event)
    if isinstance(event, ErrorBody):
        return b'{"error": ' + event.model_dump_json().encode() + b"}\n"
    assert isinstance(event, BaseModel)
    return event.model_dump_json().encode() + b"\n"
