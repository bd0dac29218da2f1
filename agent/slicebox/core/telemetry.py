"""ResourceUsage per sandbox and the level tree, straight from cgroup v2 counters.

``ResourceUsage`` is the seed's contract (cogmo ``ResourceUsageSchema``): strict, unknown keys
rejected, optional fields omitted rather than ``null`` on the wire, timestamps as UTC ISO-8601
with ``Z``. slicebox adds the optional ``memory_seconds``, ``disk_bytes_written`` and
``network_bytes``.

Reads go through :class:`slicebox.host.cgroupfs.CgroupFiles` and
:class:`slicebox.host.netstats.NetCounters` so that the logic runs on a temporary tree in
tests. Never from ``docker stats``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple

from slicebox.host.cgroupfs import CgroupFiles, CgroupReader
from slicebox.host.netstats import NetCounters
from slicebox.model.names import PODMAN_MONITOR, scope_name
from slicebox.model.usage import (
    Level,
    LevelNode,
    MemoryBytes,
    Provisioned,
    ResourceUsage,
    SandboxInfo,
)

log = logging.getLogger(__name__)

MANAGED_SLICE = "slicebox.slice"


# --- where a sandbox lives and what it was given -----------------------------------------------


class SandboxCgroups(NamedTuple):
    """Cgroup paths (relative to the cgroup root) of a sandbox scope and its three slices."""

    scope: str
    project: str
    user: str
    managed: str

    @classmethod
    def of_scope(cls, scope: str) -> SandboxCgroups:
        """Derive the slices from the scope path: each level is its parent directory."""
        parts = scope.strip("/").split("/")
        if len(parts) < 4:
            raise ValueError(f"{scope!r} is not managed/user/project/scope deep")
        up = ("/".join(parts[:n]) for n in (len(parts) - 1, len(parts) - 2, 1))
        return cls("/".join(parts), *up)


class SandboxMeta(NamedTuple):
    """What the lifecycle knows about a sandbox (from its labels)."""

    backend: str
    created_at: datetime
    cpu: float
    memory_bytes: int
    deleted_at: datetime | None = None
    init_pid: int | None = None  # for network_bytes; None when unknown or not running

    def info(self) -> SandboxInfo:
        return _sandbox_info(self)


def scope_pid(files: CgroupFiles, scope: str) -> int | None:
    """A process of the sandbox, from its scope's ``cgroup.procs``, for its network counters
    (every process in the scope shares the container's network namespace): no Docker call.
    None when the scope is empty or gone."""
    procs = (files.read(scope, "cgroup.procs") or "").split()
    if not procs and scope.endswith(".slice"):  # a native sandbox: its units hold them
        for unit in sorted(files.children(scope)):
            procs = (files.read(f"{scope}/{unit}", "cgroup.procs") or "").split()
            if procs:
                break
    return int(procs[0]) if procs else None


@functools.lru_cache(maxsize=4096)
def _sandbox_info(meta: SandboxMeta) -> SandboxInfo:
    """Validated once per sandbox, not once per poll: the metadata never changes."""
    provisioned = Provisioned(cpu=meta.cpu, memory_bytes=meta.memory_bytes)
    return SandboxInfo(
        backend=meta.backend,
        created_at=meta.created_at,
        deleted_at=meta.deleted_at,
        provisioned=provisioned,
    )


# --- memory_seconds ------------------------------------------------------------------------


class MemoryIntegrator:
    """Integrates memory.current over time (trapezoids between the agent's samples).

    The clock is injected (``time.monotonic`` in the agent) so tests run without sleeping.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}
        self._total: dict[str, float] = {}
        self._lock = threading.Lock()

    def sample(self, key: str, memory_bytes: int | None) -> None:
        """Record one reading; a missing reading (vanished cgroup) is skipped, not a zero."""
        if memory_bytes is None:
            return
        now = self.clock()
        with self._lock:
            previous = self._last.get(key)
            self._last[key] = (now, memory_bytes)
            area = 0.0 if previous is None else (now - previous[0]) * (previous[1] + memory_bytes)
            self._total[key] = self._total.get(key, 0.0) + area / 2

    def sample_all(self, reader: CgroupReader, scopes: list[str]) -> None:
        for scope in scopes:
            self.sample(scope, reader.memory_current(scope))

    def value(self, key: str) -> float | None:
        """Byte-seconds so far; None for a sandbox never sampled."""
        with self._lock:
            return self._total.get(key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._last.pop(key, None)
            self._total.pop(key, None)


# --- ResourceUsage from the kernel ---------------------------------------------------------


class UsageReader:
    """Builds ResourceUsage for a sandbox from its cgroups, its netns and the integrator."""

    def __init__(
        self,
        files: CgroupFiles,
        net: NetCounters | None = None,
        integrator: MemoryIntegrator | None = None,
    ) -> None:
        self.cgroups = CgroupReader(files)
        self.net = net
        self.integrator = integrator

    def usage(self, where: SandboxCgroups, meta: SandboxMeta) -> ResourceUsage:
        return self._usage(where, meta, self.cgroups.memory_current)

    def usage_many(
        self, sandboxes: list[tuple[SandboxCgroups, SandboxMeta]]
    ) -> list[ResourceUsage]:
        """Usage of many sandboxes; each slice is read once, so siblings see the same value."""
        slices: dict[str, int | None] = {}

        def slice_memory(cgroup: str) -> int | None:
            if cgroup not in slices:
                slices[cgroup] = self.cgroups.memory_current(cgroup)
            return slices[cgroup]

        return [self._usage(where, meta, slice_memory) for where, meta in sandboxes]

    def _usage(
        self,
        where: SandboxCgroups,
        meta: SandboxMeta | None,
        slice_memory: Callable[[str], int | None],
    ) -> ResourceUsage:
        usec = self.cgroups.cpu_usage_usec(where.scope)
        return ResourceUsage(
            memory_bytes=memory_bytes(where, slice_memory),
            cpu_seconds=None if usec is None else usec / 1e6,
            sandbox=None if meta is None else meta.info(),
            memory_seconds=self.memory_seconds(where),
            disk_bytes_written=self.cgroups.io_bytes_written(where.scope),
            network_bytes=None if meta is None else self.network_bytes(meta),
            paused=self.cgroups.frozen(where.scope),
        )

    def final_usage(
        self, where: SandboxCgroups, meta: SandboxMeta | None, now: datetime
    ) -> ResourceUsage:
        """Read just before the sandbox is deleted: the counters die with its cgroup. Without
        ``meta`` (its labels could not be read: Docker did not answer) the counters are still
        the kernel's; only the ``sandbox`` part and ``network_bytes`` are left out."""
        if self.integrator is not None:
            self.integrator.sample(where.scope, self.cgroups.memory_current(where.scope))
        dated = None if meta is None else meta._replace(deleted_at=now)
        usage = self._usage(where, dated, self.cgroups.memory_current)
        if self.integrator is not None:
            self.integrator.forget(where.scope)
        return usage

    def memory_seconds(self, where: SandboxCgroups) -> float | None:
        return None if self.integrator is None else self.integrator.value(where.scope)

    def network_bytes(self, meta: SandboxMeta) -> int | None:
        if self.net is None or meta.init_pid is None:
            return None
        return self.net.bytes_for_pid(meta.init_pid)


def find_scope(files: CgroupFiles, container_id: str, root: str = MANAGED_SLICE) -> str | None:
    """The cgroup of a container's scope, wherever in the slice tree it runs; None when it
    runs nowhere. For when its labels (and so its user and project) cannot be read."""
    scope = scope_name(container_id)
    for user in files.children(root):
        for project in files.children(f"{root}/{user}"):
            if scope in files.children(f"{root}/{user}/{project}"):
                return f"{root}/{user}/{project}/{scope}"
    return None


def memory_bytes(where: SandboxCgroups, current: Callable[[str], int | None]) -> MemoryBytes | None:
    managed, user, project = (current(c) for c in (where.managed, where.user, where.project))
    if managed is None or user is None or project is None:
        return None  # a slice vanished: no value rather than a made-up zero
    return MemoryBytes(managed=managed, user=user, project=project)


# --- the level tree ------------------------------------------------------------------------


_BELOW = {Level.MANAGED: Level.USER, Level.USER: Level.PROJECT, Level.PROJECT: Level.SANDBOX}

# Maps (level, unit name) to a display name, e.g. the names module's decoding of
# slicebox-alice-web.slice to "web". The tree keeps the unit name either way.
UnitDecoder = Callable[[Level, str], str | None]


def _is_child(level: Level, name: str) -> bool:
    if level is Level.MANAGED:
        return name.startswith("slicebox-") and name.endswith(".slice")
    if level is Level.USER:
        return name.endswith(".slice")
    # Podman's monitor of a container (``libpod-conmon-<id>.scope``) lives beside it: not one.
    # A native sandbox is a slice of its own (backends.native).
    return (
        level is Level.PROJECT
        and name.endswith((".scope", ".service", ".slice"))
        and not name.startswith(PODMAN_MONITOR)
    )


class TreeReader:
    """Reads the whole level tree: managed -> users -> projects -> sandboxes."""

    def __init__(self, files: CgroupFiles, decode: UnitDecoder | None = None) -> None:
        self.files = files
        self.cgroups = CgroupReader(files)
        self.decode = decode

    def tree(self, root: str = MANAGED_SLICE) -> LevelNode:
        return self.node(Level.MANAGED, root.strip("/"))

    def node(self, level: Level, cgroup: str) -> LevelNode:
        unit = cgroup.rsplit("/", 1)[-1]
        return LevelNode(
            level=level,
            unit=unit,
            cgroup=cgroup,
            name=self.decode(level, unit) if self.decode else None,
            children=self.children(level, cgroup),
            **self.counters(cgroup),
        )

    def children(self, level: Level, cgroup: str) -> tuple[LevelNode, ...]:
        below = _BELOW.get(level)
        if below is None:
            return ()
        names = [n for n in self.files.children(cgroup) if _is_child(level, n)]
        return tuple(self.node(below, f"{cgroup}/{name}") for name in names)

    def counters(self, cgroup: str) -> dict[str, Any]:
        c = self.cgroups
        return {
            **_memory_counters(c, cgroup),
            **_cpu_counters(c, cgroup),
            "pids_current": c.pids_current(cgroup),
            "pids_max": c.pids_max(cgroup),
            "frozen": c.frozen(cgroup),
        }


def _memory_counters(c: CgroupReader, cgroup: str) -> dict[str, Any]:
    events, local = c.memory_events(cgroup), c.memory_events_local(cgroup)
    return {
        "memory_current": c.memory_current(cgroup),
        "memory_peak": c.memory_peak(cgroup),
        "memory_max": c.memory_max(cgroup),
        "memory_high": c.memory_high(cgroup),
        "oom_kills": None if events is None else events.oom_kill,
        "ooms_caused": None if local is None else local.oom,
        "memory_max_hits": None if local is None else local.max,
    }


def _cpu_counters(c: CgroupReader, cgroup: str) -> dict[str, Any]:
    stat = c.cpu_stat(cgroup)
    return {
        "cpu_usage_usec": None if stat is None else stat.usage_usec,
        "cpu_quota": c.cpu_quota_cpus(cgroup),
        "cpu_nr_throttled": None if stat is None else stat.nr_throttled,
        "cpu_throttled_usec": None if stat is None else stat.throttled_usec,
    }
