"""A sandbox as its container's labels describe it: the value every caller of the lifecycle
gets (its lineage, limits, deadline, and where its cgroups are), and the look-up that says
whether a container found by name is that sandbox.

Labels never change, so each container's are decoded once (``_DECODED``).
"""

from __future__ import annotations

import re
import secrets
from datetime import datetime
from pathlib import PurePosixPath

from pydantic import ConfigDict

from slicebox.backends.base import SandboxInfo, SandboxState
from slicebox.core.deadlines import Timer
from slicebox.core.recent import Recent
from slicebox.model.base import Model
from slicebox.model.errors import NotFound
from slicebox.model.labels import Lineage, decode, selector
from slicebox.model.limits import Limits
from slicebox.model.names import SliceCgroups, SliceNames, scope_name, slice_names
from slicebox.model.paths import CGROUP_ROOT
from slicebox.model.pool import Lease

# Sandboxes known by id, the most recently used kept (``SandboxManager.known``): a few KiB each,
# more than a host runs at once.
KNOWN_SANDBOXES = 1024
# What Docker accepts as a container name: anything else is no sandbox's id, and never reaches
# Docker's API as part of a path.
CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+")


def new_sandbox_id() -> str:
    return "sbx-" + secrets.token_hex(6)


class Sandbox(Model):
    """A sandbox as its labels and container describe it."""

    model_config = ConfigDict(frozen=True)

    id: str
    container_id: str
    user: str
    project: str
    lineage: Lineage
    limits: Limits
    backend: str
    created_at: datetime
    expires_at: datetime | None
    # What the backend said of it when it was looked up (a create's own: running).
    state: SandboxState = SandboxState.UNKNOWN
    lease: Lease | None = None  # an acquired pool member's, from systemd (model.pool)

    @property
    def pool_state(self) -> str:
        """``idle`` (a pool member no one acquired), ``acquired``, or "" (no pool member)."""
        if not self.lineage.pool:
            return ""
        return "idle" if self.lease is None else "acquired"

    def leased(self, timer: Timer) -> Sandbox:
        """This pool member as the lease on its deadline ``timer`` says: its task's lineage
        and deadline over the labels' (written before the task was known)."""
        lease = timer.lease
        if lease is None:
            return self
        facts = lease.model_dump(exclude={"oneshot"}) | {"expires_at": timer.at}
        lineage = self.lineage.model_copy(update={**facts, "oneshot": lease.oneshot})
        return self.model_copy(update={"lineage": lineage, "lease": lease, "expires_at": timer.at})

    @classmethod
    def from_info(cls, info: SandboxInfo) -> Sandbox:
        """The sandbox a container's labels describe, in the state ``info`` gives. Decoded
        once per container (``_DECODED``): a reaper pass reads every container's labels."""
        key = (info.id, frozenset(info.labels.items()))
        known = _DECODED.get(key)
        if known is None:
            known = cls._decoded(info)
            _DECODED.put(key, known)
        return (
            known if known.state == info.state else known.model_copy(update={"state": info.state})
        )

    @classmethod
    def _decoded(cls, info: SandboxInfo) -> Sandbox:
        lineage = decode(info.labels)
        return cls(
            id=lineage.sandbox_id,
            container_id=info.id,
            user=lineage.user,
            project=lineage.project,
            lineage=lineage,
            limits=Limits(
                cpus=lineage.provisioned_cpu,
                memory_bytes=lineage.provisioned_memory_bytes,
                pids=lineage.provisioned_pids,
            ),
            backend=lineage.backend,
            created_at=lineage.created_at,
            expires_at=lineage.expires_at,
            state=info.state,
        )

    def slices(self) -> SliceNames:
        return slice_names(self.user, self.project)

    def slice_cgroups(self, root: PurePosixPath = CGROUP_ROOT) -> SliceCgroups:
        """The cgroup directories of the managed, user and project slices."""
        return self.slices().cgroups(root)

    def scope_cgroup(self, root: PurePosixPath = CGROUP_ROOT) -> PurePosixPath:
        """The cgroup directory of the container's scope (exec'd processes land here too)."""
        return self.slice_cgroups(root).project / scope_name(self.container_id)

    def running_scope(self) -> str | None:
        """The scope cgroup (below the cgroup root) of a sandbox its look-up or its create found
        running, for an exec in it: the exec then need not ask the backend for the container's
        init, a second inspect of the same container a moment later. None in any other state:
        the exec asks, and a stopped or paused sandbox is refused in its own words."""
        if self.state != SandboxState.RUNNING:
            return None
        return str(self.scope_cgroup(PurePosixPath("/"))).lstrip("/")


# Sandboxes decoded from their containers' labels, the most recently used kept: labels never
# change, so each container's are validated once, not at every reaper pass. Keyed by the
# container and its labels both, so no entry can stand for other labels.
_DECODED: Recent[tuple[str, frozenset[tuple[str, str]]], Sandbox] = Recent(KNOWN_SANDBOXES)


def labelled(info: SandboxInfo, sandbox_id: str) -> bool:
    """Whether the container carries the labels of slicebox's sandbox ``sandbox_id``."""
    return all(info.labels.get(k) == v for k, v in selector(sandbox_id=sandbox_id).items())


def found(info: SandboxInfo | None, sandbox_id: str) -> Sandbox:
    """The sandbox a look-up by name found, if its labels say it is that sandbox."""
    if info is None or not labelled(info, sandbox_id):
        raise NotFound(f"no sandbox {sandbox_id}; list sandboxes to see the ids")
    return Sandbox.from_info(info)
