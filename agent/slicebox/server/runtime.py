"""The agent's parts, assembled from the real host: Docker, systemd, cgroupfs, netlink, journald.

Tests assemble the same :class:`~slicebox.service.Service` from fakes; only this module knows
which concrete implementation stands behind each interface.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from slicebox.backends.base import SandboxState
from slicebox.backends.docker import DockerBackend
from slicebox.backends.dockersnap import DockerSnapshots
from slicebox.backends.router import Backends
from slicebox.core.budget import OutputBudget
from slicebox.core.deadlines import Deadlines, find_program
from slicebox.core.egress import BRIDGE, EgressGuard
from slicebox.core.execution import ExecEngine
from slicebox.core.expiry import Expiry
from slicebox.core.pausing import Pausing
from slicebox.core.pool import WarmPool
from slicebox.core.poolreset import MemberReset
from slicebox.core.reaper import Reaper
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.service import Service
from slicebox.core.slices import SliceManager
from slicebox.core.snapshots import Snapshots
from slicebox.core.telemetry import MemoryIntegrator, TreeReader, UsageReader, scope_pid
from slicebox.core.views import cgroups_of
from slicebox.host.beneath import unsafe_roots
from slicebox.host.cgroupfs import CgroupFS, populated
from slicebox.host.journal import Auditor
from slicebox.host.netstats import NetnsCounters
from slicebox.host.nft import Firewall, libnftables
from slicebox.host.owncgroup import agent_memory_max
from slicebox.host.procs import CgroupHost
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.audit import AuditEvent, AuditRecord
from slicebox.model.config import Config, load_config, read_host_memory
from slicebox.model.errors import SliceboxError, Unavailable
from slicebox.model.names import (
    DOCKER_SCOPES,
    SCOPE_PREFIX_ENV,
    is_container_scope,
    parse_slice,
    use_scope_prefix,
)
from slicebox.model.paths import CGROUP_MOUNT
from slicebox.model.reaper import Kind
from slicebox.model.usage import Level
from slicebox.server.backends import backends, docker_backend
from slicebox.server.collectors import Sources
from slicebox.server.inner import InnerListeners
from slicebox.server.metrics import AgentMetrics
from slicebox.server.resolver import UdpUpstream, resolv_conf

log = logging.getLogger(__name__)
SCOPES_GLOB = "slicebox.slice/*/*/*.scope"
NATIVE_GLOB = "slicebox.slice/*/*/*.slice"  # native sandboxes' own slices


def decode_unit(level: Level, unit: str) -> str | None:
    """The user or project name behind a slice unit, for the level tree."""
    if level not in (Level.USER, Level.PROJECT):
        return None
    try:
        user, project = parse_slice(unit)
    except SliceboxError:
        return None
    return user if level == Level.USER else project


class Runtime:
    def __init__(
        self,
        *,
        config_path: Path,
        config: Config,
        host_memory: int,
        slices: SliceManager,
        sandboxes: SandboxManager,
        integrator: MemoryIntegrator,
        usage: UsageReader,
        service: Service,
        auditor: Auditor,
        reaper: Reaper,
        pool: WarmPool,
        backend: Backends,
        docker: DockerBackend,
        egress: EgressGuard,
        metrics: AgentMetrics,
        inner: InnerListeners,
    ) -> None:
        self.inner = inner  # the nested sandboxes' sockets (server.inner)
        self.metrics = metrics
        self.config_path = config_path
        self.config = config
        self.host_memory = host_memory
        self.slices = slices
        self.sandboxes = sandboxes
        self.integrator = integrator
        self.usage = usage
        self.service = service
        self.auditor = auditor
        self.reaper = reaper
        self.pool = pool
        self.backend = backend
        self.docker = docker
        self.egress = egress

    def reconcile(self) -> str:
        """The start-up pass: rebuild the view from labels and systemd before answering, then
        take the idle pool members that are left into their pools and start the refill."""
        report = self.reaper.run()
        adopted = sum(1 for action in report.plan if action.kind is Kind.ADOPT)
        removed = len(report.plan) - adopted
        members = self.pool.adopt()
        self.pool.kick()
        return (
            f"reconciled: {adopted} sandboxes adopted, {removed} other reaper actions, "
            f"{members} idle pool members taken back"
        )

    def nested(self) -> list[Sandbox]:
        """The running and paused nested sandboxes, whose sockets the agent serves
        (server.inner): a paused one resumes to find its socket where it was."""
        found = self.sandboxes.find(nested="true")
        return [s for s in found if s.state in (SandboxState.RUNNING, SandboxState.PAUSED)]

    def reload(self) -> str:
        """Re-read the config and write its ceilings to every running slice, live."""
        config = load_config(self.config_path)
        warn_unsafe_roots(config)
        self.sandboxes.reconfigure(config)
        self.pool.configure(config)
        self.pool.kick()
        self.config = config
        updated = self.apply_ceilings()
        return f"configuration reloaded; ceilings applied to {len(updated)} slices"

    def apply_ceilings(self) -> list[str]:
        updated = self.slices.reapply(self.config, self.host_memory)
        self.auditor.record(
            AuditRecord(event=AuditEvent.CEILINGS_APPLIED, detail=" ".join(updated)[:500])
        )
        return updated

    def sample_memory(self) -> None:
        """One memory_seconds sample of every sandbox scope (cgroupfs only, no Docker call)."""
        root = CGROUP_MOUNT
        scopes = [
            str(path.relative_to(root))
            for glob in (SCOPES_GLOB, NATIVE_GLOB)
            for path in root.glob(glob)
            if is_container_scope(path.name)
        ]
        self.integrator.sample_all(self.usage.cgroups, scopes)


def warn_unsafe_roots(config: Config) -> None:
    """Say in the log which configured bind roots refuse every bind (host.beneath)."""
    for problem in unsafe_roots(config.bind_roots):
        log.warning(
            "bind root %s; every bind under it is refused (bind_root_unsafe) until the "
            "operator fixes it: see `slicebox doctor`",
            problem,
        )


def assemble(config_path: Path, auditor: Auditor) -> Runtime:
    config = load_config(config_path)
    warn_unsafe_roots(config)
    host_memory = read_host_memory()
    systemd = PystemdSystemd()
    slices = SliceManager(systemd)
    docker = docker_backend()
    docker_host = docker.endpoint.base_url
    backend = backends(config, systemd, docker)
    # One question to each backend at start, each a round trip to its service, asked at once.
    answers = backend.availabilities()
    available = answers[0]
    if not available.available:
        if not config.allow_native_fallback:  # systemd restarts the agent until Docker answers
            raise Unavailable(available.detail)
        log.warning(
            "Docker is unavailable, sandboxes run native until it answers: %s", available.detail
        )
    use_scope_prefix(docker.scope_prefix)
    for each in answers:
        log.info("backend %s: %s", each.kind.value, each.detail)
    egress = EgressGuard(
        config.egress,
        lambda gateway: Firewall(libnftables(), BRIDGE, gateway),
        docker,
        UdpUpstream(config.egress.upstream or resolv_conf()),
        auditor.record,
    )
    sandboxes = SandboxManager(
        backend,
        slices,
        config=config,
        host_memory=host_memory,
        instance_id="run-" + uuid.uuid4().hex[:12],
        deadlines=Deadlines(systemd, program=find_program, docker_host=docker_host),
        egress=egress,
    )
    integrator = MemoryIntegrator(time.monotonic)
    files = CgroupFS()
    metrics = AgentMetrics()
    usage = UsageReader(files, NetnsCounters(), integrator)

    def pid_of(sandbox: Sandbox) -> int | None:
        return scope_pid(files, cgroups_of(sandbox).scope)

    def final_usage(sandbox: Sandbox) -> dict[str, object] | None:
        return service.final_usage_wire(sandbox)

    host = CgroupHost()
    engine = ExecEngine(backend, host)
    pool = WarmPool(
        sandboxes,
        reset=MemberReset(backend, engine, host, lambda s: cgroups_of(s).scope),
        alive=lambda member: populated(files, cgroups_of(member).scope),
        instruments=metrics.instruments,
    )
    images = DockerSnapshots(docker.endpoint)  # snapshots' images: the reaper's and forks'
    reaper = Reaper(
        sandboxes,
        slices,
        backend,
        auditor=auditor,
        config=lambda: sandboxes.config.reaper,  # what a reload leaves in force
        final_usage=final_usage,
        pool=pool,
        instruments=metrics.instruments,
        images=images,
    )
    agent_memory = agent_memory_max()  # read once; the config's budget is re-read on reload
    budget = OutputBudget(
        lambda: sandboxes.config.exec_output_budget_bytes(agent_memory),
        share=lambda: sandboxes.config.shares.user_share,
    )
    log.info("exec output budget %s bytes", config.exec_output_budget_bytes(agent_memory))
    inner = InnerListeners()
    service = Service(
        sandboxes,
        engine,
        usage=usage,
        tree=TreeReader(files, decode=decode_unit),
        auditor=auditor,
        pid_of=pid_of,
        reaper=reaper,
        budget=budget,
        pool=pool,
        egress=egress,
        instruments=metrics.instruments,
        inner=inner,
    )
    pausing = Pausing(images, service.files, files)
    service.snapshots = Snapshots(pausing, service.files)
    if available.available:
        pausing.thaw_leftovers()  # what an agent killed mid-snapshot left frozen
    metrics.watch(
        Sources(files, lambda: sandboxes.config.metrics, reaper.listed, pool.census, egress.totals)
    )
    return Runtime(
        config_path=config_path,
        config=config,
        host_memory=host_memory,
        slices=slices,
        sandboxes=sandboxes,
        integrator=integrator,
        usage=usage,
        service=service,
        auditor=auditor,
        reaper=reaper,
        pool=pool,
        backend=backend,
        docker=docker,
        egress=egress,
        metrics=metrics,
        inner=inner,
    )


def assemble_expiry(auditor: Auditor) -> Expiry:
    """What ``sliceboxd expire`` needs, and no more: no config (a removal uses none), no agent
    run id, no reaper. Docker may be down; the expiry copes with that itself."""
    systemd = PystemdSystemd()
    docker = docker_backend()
    backend = backends(None, systemd, docker)
    # Docker may be down: the agent that armed the timer said how its engine names scopes.
    use_scope_prefix(os.environ.get(SCOPE_PREFIX_ENV) or DOCKER_SCOPES)
    sandboxes = SandboxManager(
        backend,
        SliceManager(systemd),
        config=Config(),
        host_memory=read_host_memory(),
        instance_id="expire",
        deadlines=Deadlines(systemd, program=find_program, docker_host=docker.endpoint.base_url),
    )
    usage = UsageReader(CgroupFS(), NetnsCounters())
    return Expiry(sandboxes, backend, systemd, usage=usage, auditor=auditor)
