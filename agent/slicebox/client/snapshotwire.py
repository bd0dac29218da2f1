"""The pause, snapshot and fork calls of both clients, sans I/O (as :mod:`.wire`)."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from slicebox.client.wire import Call, _body, _id
from slicebox.model.snapshots import (
    PauseState,
    SnapshotDeleted,
    SnapshotList,
    SnapshotRequest,
    SnapshotView,
)

T = TypeVar("T", bound=BaseModel)


def pause(sandbox_id: str) -> Call[PauseState]:
    return Call("POST", f"/sandboxes/{_id(sandbox_id)}/pause", PauseState)


def resume(sandbox_id: str) -> Call[PauseState]:
    return Call("POST", f"/sandboxes/{_id(sandbox_id)}/resume", PauseState)


def snapshot(sandbox_id: str, name: str) -> Call[SnapshotView]:
    """A snapshot: the sandbox's filesystem, which may take a while for a large one."""
    body = _body(SnapshotRequest(name=name))
    return Call("POST", f"/sandboxes/{_id(sandbox_id)}/snapshots", SnapshotView, body, 3600.0)


def snapshots() -> Call[SnapshotList]:
    return Call("GET", "/snapshots", SnapshotList)


def delete_snapshot(name: str) -> Call[SnapshotDeleted]:
    return Call("DELETE", f"/snapshots/{_id(name)}", SnapshotDeleted)


def resuming(call: Call[T]) -> Call[T]:
    """``call`` (an exec, a transfer) resuming a paused sandbox first (``?resume=1``)."""
    joint = "&" if "?" in call.path else "?"
    return call._replace(path=f"{call.path}{joint}resume=1")
