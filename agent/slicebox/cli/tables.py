"""The CLI's human views of the agent's models: lines of text, nothing printed here."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from slicebox.model.api import Destroyed, SandboxView
from slicebox.model.exec import ExecResult
from slicebox.model.pool import PoolList
from slicebox.model.reaper import Report
from slicebox.model.usage import LevelNode

MiB = 1024 * 1024


def sandboxes(views: Sequence[SandboxView]) -> Iterator[str]:
    yield (
        f"{'ID':<18} {'USER':<12} {'PROJECT':<14} {'MEMORY':>10} {'CPUS':>5} "
        f"{'CREATED':<25} {'EXPIRES':<25} {'POOL'}"
    )
    for v in views:
        memory = f"{v.limits.memory_bytes // MiB}MB"
        expires = v.expires_at.isoformat() if v.expires_at else "-"
        yield (
            f"{v.id:<18} {v.user:<12} {v.project:<14} {memory:>10} {v.limits.cpus:>5} "
            f"{v.created_at.isoformat():<25} {expires:<25} {v.pool or '-'}"
        ).rstrip()


def pools(found: PoolList) -> Iterator[str]:
    """Each pool's key, members and how well it serves; idle members are charged to no task."""
    yield (
        f"{'USER/PROJECT':<24} {'IMAGE':<28} {'MEMORY':>8} {'CPUS':>5} {'NET':<7} {'REUSE':<5} "
        f"{'READY':>5} {'BUSY':>4} {'SIZE':>4} {'HIT%':>5} {'REFILL':>7} {'ACQUIRE':>8}"
    )
    for p in found.pools:
        key = p.key
        hit = f"{100 * p.hit_rate:.0f}" if p.hit_rate is not None else "-"
        yield (
            f"{key.user + '/' + key.project:<24} {key.image:<28} "
            f"{key.limits.memory_bytes // MiB:>6}MB {key.limits.cpus:>5} {key.network:<7} "
            f"{'yes' if key.reuse else 'no':<5} {p.ready:>5} {p.busy:>4} {p.size:>4} {hit:>5} "
            f"{_seconds(p.refill_seconds_p50):>7} {_seconds(p.acquire_seconds_p50):>8}"
        )
        if p.learned:
            yield "  learned from demand ([pool_learning]): kept while its key is asked for"
        if p.held_back:
            yield f"  held back: {p.held_back}"
    yield f"cold creates and runs (no pool's key): {found.cold}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def destroyed(gone: Destroyed) -> str:
    state = "destroyed" if gone.destroyed else "already gone"
    cpu = gone.usage.cpu_seconds if gone.usage else None
    return f"{gone.id} {state}" + (f" (cpu {cpu:.2f}s)" if cpu is not None else "")


def notes(result: ExecResult) -> Iterator[str]:
    """What the output alone does not say: a cap, the timeout, the OOM killer."""
    for name, truncated, dropped in (
        ("stdout", result.stdout_truncated, result.stdout_dropped_bytes),
        ("stderr", result.stderr_truncated, result.stderr_dropped_bytes),
    ):
        if truncated:
            yield f"slicebox: {name} truncated, {dropped} bytes dropped (see --output-cap)"
    if result.timed_out:
        yield "slicebox: the command timed out and was killed"
    if result.oom_killed:
        yield "slicebox: the kernel killed a process (out of memory)"


def tree(node: LevelNode, depth: int = 0) -> Iterator[str]:
    if depth == 0:
        yield f"{'LEVEL':<40} {'MEMORY':>10} {'MAX':>10} {'PIDS':>6} {'CPU s':>8} {'OOM':>4}"
    label = ("  " * depth) + (node.name or node.unit)
    mark = (" !oom" if node.ooms_caused else "") + (" !throttled" if node.cpu_nr_throttled else "")
    yield (
        f"{label[:40]:<40} {_mb(node.memory_current):>10} {_mb(node.memory_max):>10} "
        f"{node.pids_current or 0:>6} {(node.cpu_usage_usec or 0) / 1e6:>8.2f} "
        f"{node.oom_kills or 0:>4}{mark}"
    )
    for child in node.children:
        yield from tree(child, depth + 1)


def reaper(report: Report) -> tuple[list[str], bool]:
    """The pass as lines, and whether an action failed."""
    results = [o.result for o in report.outcomes] or ["planned"] * len(report.plan)
    verb = "would take" if report.dry_run else "took"
    lines = [f"reaper {verb} {len(report.plan)} actions (agent run {report.instance_id})"]
    for action, result in zip(report.plan, results, strict=True):
        lines.append(f"{result:<10} {action.kind:<17} {action.target:<40} {action.reason}")
    return lines, any(r not in ("ok", "skipped", "planned") for r in results)


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.1f}MB"
