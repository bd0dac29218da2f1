"""Slicebox's terms in Daytona's: backend and exec ids, states, resources, and what a remote
sandbox cannot give. Pure: no SDK, no call."""

from __future__ import annotations

import math

from slicebox.backends.base import SandboxRequest, SandboxState
from slicebox.model.limits import INFINITY, Limits

ID_PREFIX = "daytona-"
EXEC_PREFIX = "daytona-exec-"
NAME_LABEL = "slicebox.name"
SDK_LABELS = frozenset({"code-toolbox-language", NAME_LABEL})  # bookkeeping, not the caller's
GIB = 2**30

# Daytona's states, as slicebox's (Docker's words); any other is unknown.
_STATES = {
    "started": SandboxState.RUNNING,
    "stopped": SandboxState.EXITED,
    "archived": SandboxState.EXITED,
    "error": SandboxState.DEAD,
    "build_failed": SandboxState.DEAD,
    "creating": SandboxState.CREATED,
    "starting": SandboxState.CREATED,
    "restoring": SandboxState.CREATED,
    "pending_build": SandboxState.CREATED,
    "building_snapshot": SandboxState.CREATED,
    "pulling_snapshot": SandboxState.CREATED,
    "pausing": SandboxState.PAUSED,
    "paused": SandboxState.PAUSED,
    "destroying": SandboxState.REMOVING,
    "destroyed": SandboxState.REMOVING,
    "unknown": SandboxState.UNKNOWN,
}


def is_daytona_id(backend_id: str) -> bool:
    """Whether a backend id is a daytona sandbox's (``daytona-<Daytona's id>``)."""
    return backend_id.startswith(ID_PREFIX) and not is_daytona_exec(backend_id)


def is_daytona_exec(exec_id: str) -> bool:
    """Whether an exec id is one this backend minted (``daytona-exec-<token>``)."""
    return exec_id.startswith(EXEC_PREFIX)


def daytona_id(backend_id: str) -> str:
    """Daytona's own id behind a daytona backend id."""
    return backend_id.removeprefix(ID_PREFIX)


def state_of(value: object) -> SandboxState:
    """A Daytona state (its enum or its word) as a :class:`SandboxState`."""
    word = getattr(value, "value", value)
    return _STATES.get(str(word), SandboxState.UNKNOWN)


def resources_of(limits: Limits) -> dict[str, int]:
    """Daytona's ``cpu`` (whole CPUs) and ``memory`` (GiB), each rounded up; a limit that is not
    set is left out, for Daytona's default."""
    resources: dict[str, int] = {}
    if limits.cpus > 0:
        resources["cpu"] = math.ceil(limits.cpus)
    if 0 < limits.memory_bytes < INFINITY:
        resources["memory"] = -(-limits.memory_bytes // GIB)
    return resources


def refusal(request: SandboxRequest) -> str | None:
    """What a daytona sandbox cannot give that ``request`` asks for; None when nothing."""
    if request.network != "none":
        return (
            f'network {request.network!r}: the daytona backend only supports network "none" '
            "(the sandbox has no network at all)"
        )
    if request.mounts:
        return "mounts, workspace volumes and credentials (a remote sandbox has no host paths)"
    if request.cap_add:
        return "cap_add"
    if request.open_stdin:
        return "a launched one-shot (its waiter)"
    if request.wasm is not None:
        return "a wasm plugin (ask for backend wasm)"
    return None
