"""What ``GET /metrics`` reads at scrape time, as prometheus-client metric families.

One collector, :class:`AgentCollector`, walks the slice tree in cgroupfs once per scrape and
yields every family read from where it already is:

- each level's counters (managed, user, project: ``cpu.stat``, ``memory.*``, ``pids.*`` and
  the PSI files where the kernel has them; a missing file, or a limit of ``max``, leaves its
  series out rather than writing a zero or a made-up limit);
- the sandboxes: each sandbox unit in a project slice is one that runs now (a container's
  scope, a native sandbox's slice), so counting them asks no backend. Its backend is the
  unit's shape (a scope: docker; a slice: native), or what the reaper's last listing said of
  it (wasm, a sandbox's id); a pool's ready member is ``idle``; remote (daytona) sandboxes have
  no cgroup here and are counted as the reaper's last listing left them;
- per sandbox, when the operator opts in, at most ``per_sandbox_max`` of them;
- the warm pools, from their memory (``WarmPool.census``) and the tree (a member handed out is
  busy while its scope runs);
- egress per project, from one listing of nftables' counters and the resolver's tallies.

No family here lists Docker or asks systemd: a scrape costs file reads, whatever the number of
sandboxes, and with per-sandbox series off it reads no sandbox's files at all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

import slicebox
from slicebox.backends.base import SandboxInfo
from slicebox.core.egresstally import EgressTally, Project
from slicebox.core.poolstate import PoolCensus
from slicebox.core.sandbox import Sandbox
from slicebox.core.telemetry import MANAGED_SLICE
from slicebox.host.cgroupfs import CgroupFiles, CgroupReader
from slicebox.model.errors import SliceboxError
from slicebox.model.metrics import MetricsConfig
from slicebox.model.names import is_container_scope, parse_slice
from slicebox.model.spec import Backend

LEVEL = ["level", "user", "project"]
PROJECT = ["user", "project"]
SANDBOX = ["user", "project", "sandbox"]
POOL = ["user", "project", "pool"]
# PSI: cAdvisor's words, ``waiting`` for the file's ``some`` line, ``stalled`` for ``full``.
PRESSURE = [
    (resource, kind, word)
    for resource in ("cpu", "memory", "io")
    for kind, word in (("some", "waiting"), ("full", "stalled"))
]


class Sources(NamedTuple):
    """Where a scrape reads, each a call into memory the agent already keeps."""

    files: CgroupFiles
    config: Callable[[], MetricsConfig]
    listed: Callable[[], list[SandboxInfo]]  # the reaper's last listing
    pools: Callable[[], list[PoolCensus]]
    egress: Callable[[], Mapping[Project, EgressTally]]


class Level(NamedTuple):
    level: str  # managed, user, project
    user: str
    project: str
    cgroup: str


class Unit(NamedTuple):
    """A sandbox found running in a project slice."""

    user: str
    project: str
    name: str  # docker-<id>.scope, libpod-<id>.scope, or a native sandbox's slice
    cgroup: str

    @property
    def backend_id(self) -> str:
        """The backend's id: a container's id from its scope, a native sandbox's slice."""
        if self.name.endswith(".slice"):
            return self.name
        return self.name.removesuffix(".scope").split("-", 1)[-1]

    @property
    def shape(self) -> str:
        return Backend.NATIVE.value if self.name.endswith(".slice") else Backend.DOCKER.value


def walk(files: CgroupFiles, root: str = MANAGED_SLICE) -> tuple[list[Level], list[Unit]]:
    """Every level of the tree and every sandbox unit in it: directory listings only."""
    levels, units = [Level("managed", "", "", root)], []
    for user_unit in files.children(root):
        user, _ = _names(user_unit)
        if user is None:
            continue
        user_cgroup = f"{root}/{user_unit}"
        levels.append(Level("user", user, "", user_cgroup))
        for project_unit in files.children(user_cgroup):
            owner, project = _names(project_unit)
            if owner != user or project is None:
                continue
            cgroup = f"{user_cgroup}/{project_unit}"
            levels.append(Level("project", user, project, cgroup))
            units += [
                Unit(user, project, name, f"{cgroup}/{name}")
                for name in files.children(cgroup)
                if is_container_scope(name)
            ]
    return levels, units


def _names(unit: str) -> tuple[str | None, str | None]:
    try:
        return parse_slice(unit)
    except SliceboxError:  # not a slice slicebox makes: no user's
        return None, None


class _Levels:
    """The level families, filled one level at a time."""

    def __init__(self) -> None:
        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=LEVEL)

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=LEVEL)

        self.cpu = counter("slicebox_level_cpu_seconds", "CPU time used (cpu.stat usage_usec).")
        self.throttled = counter(
            "slicebox_level_cpu_cfs_throttled_seconds",
            "Time throttled by this level's CPU quota (cpu.stat throttled_usec).",
        )
        self.throttled_periods = counter(
            "slicebox_level_cpu_cfs_throttled_periods",
            "Periods throttled by this level's CPU quota (cpu.stat nr_throttled).",
        )
        self.memory = gauge("slicebox_level_memory_usage_bytes", "Memory used (memory.current).")
        self.limit = gauge(
            "slicebox_level_memory_limit_bytes",
            "Memory ceiling (memory.max); left out where there is none.",
        )
        self.peak = gauge(
            "slicebox_level_memory_max_usage_bytes", "Most memory ever used (memory.peak)."
        )
        self.ooms = counter(
            "slicebox_level_oom_kills",
            "Processes the OOM killer killed in this level or below (memory.events oom_kill).",
        )
        self.tasks = gauge("slicebox_level_tasks_current", "Tasks (pids.current).")
        self.tasks_max = gauge(
            "slicebox_level_tasks_max", "Task ceiling (pids.max); left out where there is none."
        )
        self.pressure = {
            (resource, kind): counter(
                f"slicebox_level_pressure_{resource}_{word}_seconds",
                f"Time {'some' if kind == 'some' else 'all'} tasks stalled on {resource} "
                f"({resource}.pressure {kind} total); left out without PSI.",
            )
            for resource, kind, word in PRESSURE
        }

    def read(self, reader: CgroupReader, level: Level) -> None:
        labels = [level.level, level.user, level.project]
        cgroup = level.cgroup
        stat = reader.cpu_stat(cgroup)
        if stat is not None:
            self.cpu.add_metric(labels, stat.usage_usec / 1e6)
            self.throttled.add_metric(labels, stat.throttled_usec / 1e6)
            self.throttled_periods.add_metric(labels, stat.nr_throttled)
        events = reader.memory_events(cgroup)
        if events is not None:
            self.ooms.add_metric(labels, events.oom_kill)
        for family, value in (
            (self.memory, reader.memory_current(cgroup)),
            (self.limit, reader.memory_max(cgroup)),
            (self.peak, reader.memory_peak(cgroup)),
            (self.tasks, reader.pids_current(cgroup)),
            (self.tasks_max, reader.pids_max(cgroup)),
        ):
            if value is not None:
                family.add_metric(labels, value)
        for resource in ("cpu", "memory", "io"):
            stalls = reader.pressure(cgroup, resource) or {}
            for kind, usec in stalls.items():
                if (resource, kind) in self.pressure:
                    self.pressure[resource, kind].add_metric(labels, usec / 1e6)

    def families(self) -> list[Metric]:
        fixed = [self.cpu, self.throttled, self.throttled_periods, self.memory, self.limit]
        fixed += [self.peak, self.ooms, self.tasks, self.tasks_max]
        return fixed + list(self.pressure.values())


class AgentCollector(Collector):
    """Every family read at scrape time (the module says from where)."""

    def __init__(self, sources: Sources) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        sources = self._sources
        levels, units = walk(sources.files)
        reader = CgroupReader(sources.files)
        found = _Levels()
        for level in levels:
            found.read(reader, level)
        yield from found.families()
        roster = _roster(sources.listed())
        pools = sources.pools()
        idle = {member for pool in pools for member in pool.ready}
        yield _sandboxes(units, roster, idle)
        config = sources.config()
        if config.per_sandbox:
            yield from _per_sandbox(reader, units, roster, config.per_sandbox_max)
        yield from _pools(pools, {unit.backend_id for unit in units}, roster)
        yield from _egress(sources.egress())


def _roster(listed: Iterable[SandboxInfo]) -> dict[str, Sandbox]:
    """Backend id -> the sandbox its labels describe (decoded once per container: cached)."""
    found = {}
    for info in listed:
        try:
            found[info.id] = Sandbox.from_info(info)
        except (SliceboxError, ValueError):  # labels that are not a sandbox's: none of ours
            continue
    return found


def _sandboxes(units: list[Unit], roster: Mapping[str, Sandbox], idle: set[str]) -> Metric:
    counts: Counter[tuple[str, str, str, str]] = Counter()
    for unit in units:
        known = roster.get(unit.backend_id)
        backend = known.backend if known is not None else unit.shape
        state = "idle" if unit.backend_id in idle else "running"
        counts[unit.user, unit.project, backend, state] += 1
    for sandbox in roster.values():
        if sandbox.backend == Backend.DAYTONA:  # remote: as the reaper's last listing says
            counts[sandbox.user, sandbox.project, sandbox.backend, sandbox.state.value] += 1
    family = GaugeMetricFamily(
        "slicebox_sandboxes",
        "Sandboxes by owner, backend and state: running and idle (a pool's ready member) from "
        "the slice tree; remote ones as the reaper last listed them.",
        labels=[*PROJECT, "backend", "state"],
    )
    for labels, count in sorted(counts.items()):
        family.add_metric(list(labels), count)
    return family


def _per_sandbox(
    reader: CgroupReader, units: list[Unit], roster: Mapping[str, Sandbox], most: int
) -> Iterator[Metric]:
    """The first ``most`` sandboxes by owner and unit (the same ones scrape after scrape);
    the rest are only in their levels' series, and counted as dropped."""
    cpu = CounterMetricFamily("slicebox_sandbox_cpu_seconds", "CPU time used.", labels=SANDBOX)
    memory = GaugeMetricFamily(
        "slicebox_sandbox_memory_usage_bytes", "Memory used.", labels=SANDBOX
    )
    ooms = CounterMetricFamily("slicebox_sandbox_oom_kills", "OOM kills.", labels=SANDBOX)
    tasks = GaugeMetricFamily("slicebox_sandbox_tasks_current", "Tasks.", labels=SANDBOX)
    ordered = sorted(units)
    for unit in ordered[:most]:
        known = roster.get(unit.backend_id)
        name = known.id if known is not None else unit.backend_id[:12]
        labels = [unit.user, unit.project, name]
        usec = reader.cpu_usage_usec(unit.cgroup)
        if usec is not None:
            cpu.add_metric(labels, usec / 1e6)
        events = reader.memory_events(unit.cgroup)
        if events is not None:
            ooms.add_metric(labels, events.oom_kill)
        for family, value in (
            (memory, reader.memory_current(unit.cgroup)),
            (tasks, reader.pids_current(unit.cgroup)),
        ):
            if value is not None:
                family.add_metric(labels, value)
    dropped = GaugeMetricFamily(
        "slicebox_metrics_sandboxes_dropped",
        "Sandboxes past [metrics] per_sandbox_max, given no series of their own.",
        value=max(0, len(ordered) - most),
    )
    return iter([cpu, memory, ooms, tasks, dropped])


def _pools(
    pools: list[PoolCensus], live: set[str], roster: Mapping[str, Sandbox]
) -> Iterator[Metric]:
    ready = GaugeMetricFamily("slicebox_pool_ready", "Members ready to hand out.", labels=POOL)
    busy = GaugeMetricFamily(
        "slicebox_pool_busy", "Members handed out whose sandbox still runs.", labels=POOL
    )
    hits = CounterMetricFamily(
        "slicebox_pool_hits", "Requests served by a ready member.", labels=POOL
    )
    misses = CounterMetricFamily(
        "slicebox_pool_misses", "Requests of a pool's key that found nothing ready.", labels=POOL
    )
    for pool in pools:
        labels = [pool.user, pool.project, pool.fingerprint]
        members = {
            backend_id
            for backend_id, sandbox in roster.items()
            if sandbox.lineage.pool and sandbox.lineage.pool_key == pool.fingerprint
        }
        ready.add_metric(labels, len(pool.ready))
        busy.add_metric(labels, len(((pool.handed | members) & live) - pool.ready))
        hits.add_metric(labels, pool.hits)
        misses.add_metric(labels, pool.misses)
    return iter([ready, busy, hits, misses])


def _egress(totals: Mapping[Project, EgressTally]) -> Iterator[Metric]:
    verdict = [*PROJECT, "verdict"]
    packets = CounterMetricFamily(
        "slicebox_egress_packets", "Packets of egress sandboxes, allowed or denied.", labels=verdict
    )
    size = CounterMetricFamily(
        "slicebox_egress_bytes", "Bytes of egress sandboxes, allowed or denied.", labels=verdict
    )
    names = CounterMetricFamily(
        "slicebox_egress_dns_refused", "Names the egress resolver refused.", labels=PROJECT
    )
    for (user, project), tally in sorted(totals.items()):
        packets.add_metric([user, project, "allowed"], tally.allowed_packets)
        packets.add_metric([user, project, "denied"], tally.denied_packets)
        size.add_metric([user, project, "allowed"], tally.allowed_bytes)
        size.add_metric([user, project, "denied"], tally.denied_bytes)
        names.add_metric([user, project], tally.refused_names)
    return iter([packets, size, names])


class ProcessExtras(Collector):
    """What prometheus-client's ProcessCollector leaves out: the agent's threads (the
    kernel's count, native ones included), and the build."""

    def __init__(self, status: str = "/proc/self/status") -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily(
            "slicebox_build", "The agent's version.", value={"version": slicebox.__version__}
        )
        threads = _threads(self._status)
        if threads is not None:
            yield GaugeMetricFamily("process_threads", "Threads of the agent.", value=threads)


def _threads(status: str) -> int | None:
    try:
        with open(status) as lines:
            for line in lines:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
