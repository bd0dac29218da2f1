"""The pause, snapshot and fork routes (core.pausing, core.snapshots), and the guard that an
exec or a file transfer passes first: a paused sandbox answers ``sandbox_paused`` unless the
request says ``?resume=1``."""

from __future__ import annotations

import functools
from collections.abc import Awaitable

from pydantic import ValidationError

from slicebox.core.pausing import Pausing
from slicebox.core.service import Service
from slicebox.core.snapshots import Snapshots
from slicebox.model.api import CreateSandbox, SandboxView
from slicebox.model.errors import InvalidName, InvalidRequest, NotFound
from slicebox.model.snapshots import (
    PauseState,
    SnapshotDeleted,
    SnapshotList,
    SnapshotQuery,
    SnapshotRequest,
    SnapshotView,
)
from slicebox.model.validation import refusal
from slicebox.server.api import Route, identity_of, json_ok, parse_body, parse_query
from slicebox.server.pools import pools_of
from slicebox.server.state import service_of
from slicebox.web.app import Handler
from slicebox.web.request import Request
from slicebox.web.response import StreamResponse

RESUME = "resume"  # ?resume=1: a paused sandbox is resumed before the exec or transfer


def _pausing(service: Service) -> Pausing:
    return _snapshots(service).pausing


def _snapshots(service: Service) -> Snapshots:
    if service.snapshots is None:
        raise NotFound("this agent has no snapshots (no Docker engine)")
    return service.snapshots


def unpaused(handler: Handler, body_first: int | None = None) -> Handler:
    """``handler`` for a sandbox that is not paused (or is resumed first, ``?resume=1``).
    ``body_first``: the body is read whole first, up to that many bytes, so that a body the
    handler would refuse (its framing, its size) is refused as before, whatever sandbox it
    names."""

    @functools.wraps(handler)
    async def guarded(request: Request) -> StreamResponse:
        if body_first is not None:
            await request.read(body_first)  # kept: the handler's parse reads it from there
        resume = request.query.pop(RESUME, "") in ("1", "true", "yes")
        service = service_of(request)
        if service.snapshots is not None:
            await service.snapshots.pausing.ensure_running(
                identity_of(request), request.match_info["id"], resume, pools_of(request).call
            )
        return await handler(request)

    return guarded


async def fork(request: Request, body: CreateSandbox) -> SandboxView:
    """A create with ``from_snapshot`` (``routes.create`` hands it here)."""
    service = service_of(request)
    return await _snapshots(service).fork(
        identity_of(request), body, pools_of(request).call, service
    )


async def pause(request: Request) -> StreamResponse:
    pausing = _pausing(service_of(request))
    who, calls = identity_of(request), pools_of(request).call
    return json_ok(await pausing.pause(who, request.match_info["id"], calls))


async def resume(request: Request) -> StreamResponse:
    pausing = _pausing(service_of(request))
    who, calls = identity_of(request), pools_of(request).call
    return json_ok(await pausing.resume(who, request.match_info["id"], calls))


async def take(request: Request) -> StreamResponse:
    body = await _named(parse_body(request, SnapshotRequest))
    snapshots = _snapshots(service_of(request))
    who, calls = identity_of(request), pools_of(request).call
    view = await snapshots.take(who, request.match_info["id"], body.name, calls)
    return json_ok(view, status=201)


async def list_snapshots(request: Request) -> StreamResponse:
    query = parse_query(request, SnapshotQuery)
    snapshots = _snapshots(service_of(request))
    found = await snapshots.listed(identity_of(request), query.user, pools_of(request).call)
    return json_ok(SnapshotList(found))


async def delete(request: Request) -> StreamResponse:
    query = parse_query(request, SnapshotQuery)
    name = (await _named(_request_of(request.match_info["name"]))).name
    snapshots = _snapshots(service_of(request))
    who, calls = identity_of(request), pools_of(request).call
    return json_ok(await snapshots.delete(who, name, query.user, calls))


async def _request_of(name: str) -> SnapshotRequest:
    try:
        return SnapshotRequest(name=name)
    except ValidationError as exc:
        raise refusal(exc) from exc


async def _named(parsing: Awaitable[SnapshotRequest]) -> SnapshotRequest:
    """A snapshot's name that is not one is ``invalid_name``, as a volume's would be."""
    try:
        return await parsing
    except InvalidRequest as exc:
        if exc.field != "name":
            raise
        raise InvalidName(exc.message, field=exc.field) from exc


SNAPSHOT_ROUTES: list[Route] = [
    Route(
        "POST",
        "/sandboxes/{id}/pause",
        pause,
        "Pause: freeze every process (no CPU, memory kept); the deadline keeps running",
        None,
        PauseState,
    ),
    Route("POST", "/sandboxes/{id}/resume", resume, "Resume a paused sandbox", None, PauseState),
    Route(
        "POST",
        "/sandboxes/{id}/snapshots",
        take,
        "Snapshot: its root filesystem and /workspace as your snapshot `name` (no env, no "
        "credentials); fork it with from_snapshot in a create",
        SnapshotRequest,
        SnapshotView,
    ),
    Route(
        "GET",
        "/snapshots",
        list_snapshots,
        "Your snapshots (an admin's: everyone's, or ?user=)",
        None,
        SnapshotList,
        query=SnapshotQuery,
    ),
    Route(
        "DELETE",
        "/snapshots/{name}",
        delete,
        "Delete your snapshot `name` (forks running from it keep running)",
        None,
        SnapshotDeleted,
        query=SnapshotQuery,
    ),
]
