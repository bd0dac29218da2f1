"""What a caller is shown of a sandbox: its view, and its resource usage and the slice tree's,
with each egress sandbox's counters where the egress guard keeps them.

Read from the sandbox's labels (its view, its limits, its scope's cgroup) and from cgroupfs
(:mod:`slicebox.core.telemetry`); nothing here decides who may see what: that is the
service's (:mod:`slicebox.core.service`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import PurePosixPath

from slicebox.core.egress import EgressGuard
from slicebox.core.sandboxes import Sandbox, SandboxManager
from slicebox.core.telemetry import SandboxCgroups, SandboxMeta, TreeReader, UsageReader
from slicebox.model.api import SandboxView
from slicebox.model.usage import EgressCounters, LevelNode, ResourceUsage

log = logging.getLogger(__name__)


def view_of(sandbox: Sandbox) -> SandboxView:
    lineage = sandbox.lineage
    return SandboxView(
        id=sandbox.id,
        container_id=sandbox.container_id,
        user=sandbox.user,
        project=sandbox.project,
        backend=sandbox.backend,
        created_at=sandbox.created_at,
        expires_at=sandbox.expires_at,
        root_task_id=lineage.root_task_id,
        task_id=lineage.task_id,
        parent_id=lineage.parent_id,
        depth=lineage.depth,
        limits=sandbox.limits,
        workspace_volume=lineage.workspace_volume,
        pool=sandbox.pool_state,
        egress=tuple(entry for entry in lineage.egress.split(",") if entry),
    )


def cgroups_of(sandbox: Sandbox) -> SandboxCgroups:
    return SandboxCgroups.of_scope(str(sandbox.scope_cgroup(PurePosixPath("/"))))


def meta_of(sandbox: Sandbox, init_pid: int | None) -> SandboxMeta:
    """What telemetry reports about the sandbox itself, from its labels."""
    return SandboxMeta(
        backend=sandbox.backend,
        created_at=sandbox.created_at,
        cpu=sandbox.limits.cpus,
        memory_bytes=sandbox.limits.memory_bytes,
        init_pid=init_pid,
    )


class Views:
    """A sandbox's usage, its final usage (a destroy's last look) and the level tree."""

    def __init__(
        self,
        sandboxes: SandboxManager,
        *,
        usage: UsageReader,
        tree: TreeReader,
        pid_of: Callable[[Sandbox], int | None],
        clock: Callable[[], datetime],
        egress: EgressGuard | None,
    ) -> None:
        self._sandboxes = sandboxes
        self._usage = usage
        self._tree = tree
        self._pid_of = pid_of
        self._clock = clock
        self._egress = egress

    def usage(self, sandbox: Sandbox) -> ResourceUsage:
        return self._with_egress(
            sandbox, self._usage.usage(cgroups_of(sandbox), self._meta(sandbox))
        )

    def tree(self) -> LevelNode:
        return self._tree.tree().with_egress(self._egress_by_unit())

    def final_usage(self, sandbox: Sandbox) -> ResourceUsage | None:
        """Its usage read just before its removal; None (and a logged error) when it cannot
        be read: a destroy goes on without it."""
        try:
            usage = self._usage.final_usage(cgroups_of(sandbox), self._meta(sandbox), self._clock())
            return self._with_egress(sandbox, usage)
        except Exception:
            log.exception("could not read the final usage of %s", sandbox.id)
            return None

    def _meta(self, sandbox: Sandbox) -> SandboxMeta:
        return meta_of(sandbox, self._pid_of(sandbox))

    def _egress_by_unit(self) -> dict[str, EgressCounters]:
        """Each egress sandbox's counters by its scope's unit (one listing; none without)."""
        if self._egress is None or not self._egress.guarding():
            return {}
        found: dict[str, EgressCounters] = {}
        for sandbox in self._sandboxes.find():
            counters = self._egress.counters(sandbox.id) if sandbox.lineage.egress_address else None
            if counters is not None:
                found[cgroups_of(sandbox).scope.rsplit("/", 1)[-1]] = counters
        return found

    def _with_egress(self, sandbox: Sandbox, usage: ResourceUsage) -> ResourceUsage:
        if self._egress is None or not sandbox.lineage.egress_address:
            return usage
        counters = self._egress.counters(sandbox.id)
        return usage if counters is None else usage.model_copy(update={"egress": counters})
