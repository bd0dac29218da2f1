"""Capacity as it travels (``GET /v1/capacity``), and the ``[admission]`` table it follows.

``[admission]`` says whether a create counts what the sandboxes already at each level are
provisioned. Left out (the default), a create is refused only when its own limits exceed its
project's or user's ceiling: the kernel shares each ceiling among the sandboxes below it,
whose limits may add up to more (most sandboxes use a fraction of theirs). A ratio counts its
resource: the limits of a level's sandboxes and creates in flight together may add up to that
many times the level's ceiling, and a create past it is refused ``admission_refused``.

    [admission]
    memory_ratio = 1.0   # the memory limits below each level add up to at most its MemoryMax
    pids_ratio = 1.0     # the same for TasksMax
    cpus_ratio = 4.0     # CPU quotas may add up to four times a level's (throttled, not killed)

The answer: for a user, one of its projects and the host (the managed level), what each
level's sandboxes are provisioned against its ceiling, what admission leaves of it, and how
many sandboxes of one shape fit now (``fits``), all from the one computation a create's
admission makes (``core.headroom``); the host's available memory is reported beside them,
never counted in them.
"""

from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from slicebox.model.base import Model
from slicebox.model.limits import Limits
from slicebox.model.usage import Level


class Resource(StrEnum):
    MEMORY = "memory"  # bytes: MemoryMax
    PIDS = "pids"  # tasks: TasksMax
    CPUS = "cpus"  # CPUs: CPUQuota


def _ratio(description: str) -> Any:
    return Field(default=None, gt=0, le=1000, description=description)


class AdmissionConfig(Model):
    """``[admission]``: which resources a create counts, and against how much of each ceiling."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    memory_ratio: float | None = _ratio(
        "the memory limits of a level's sandboxes and creates in flight may add up to this "
        "many times its MemoryMax; unset: not counted (the kernel shares it)"
    )
    pids_ratio: float | None = _ratio(
        "the same for their pids and the level's TasksMax; unset: not counted"
    )
    cpus_ratio: float | None = _ratio(
        "the same for their CPUs and the level's CPU quota; unset: not counted"
    )

    def counted(self) -> tuple[Resource, ...]:
        """The resources a create counts, in the answer's order."""
        ratios = (self.memory_ratio, self.pids_ratio, self.cpus_ratio)
        return tuple(r for r, ratio in zip(Resource, ratios, strict=True) if ratio is not None)


class CapacityQuery(Model):
    """``GET /v1/capacity``'s query string: whose capacity and of what shape.

    ``user``: the caller's own when left out (an admin may name another). ``project``: the
    project level asked about; with ``pool`` it is the pool's. The shape is ``memory``,
    ``cpus`` and ``pids`` as a create takes them (what is left out is the configured default,
    as in a create), or ``pool``, a warm pool's key fingerprint (``GET /v1/pool``), whose
    limits are the shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # As a create takes them, checked where a create's are (a name by its slice unit, a size by
    # its parser), so that each gets the code and words a create of it would.
    project: str | None = None
    user: str | None = None
    memory: int | str | None = None
    cpus: float | str | None = None
    pids: int | str | None = None
    pool: Annotated[str | None, Field(pattern=r"^[0-9a-f]{24}$")] = None


class _Answer(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Room(_Answer):
    """One resource at one level, in bytes (memory) or tasks (pids): the kernel's ceiling
    (null: none), what admission lets the level's sandboxes add up to (null: not counted),
    what its sandboxes and creates in flight are provisioned (their own limits, summed), and
    what admission leaves of it (null: not counted)."""

    ceiling: int | None
    admits: int | None
    provisioned: int
    left: int | None


class CpuRoom(_Answer):
    """``Room`` for CPUs (1.5 is one and a half CPUs of quota)."""

    ceiling: float | None
    admits: float | None
    provisioned: float
    left: float | None


class LevelRoom(_Answer):
    """One level of the slice tree: what is left under its ceilings, and how many sandboxes of
    the shape it alone would still admit (null: nothing counted bounds them here)."""

    level: Level
    unit: str
    sandboxes: int  # its sandboxes (pool members among them) and creates in flight
    memory: Room
    pids: Room
    cpus: CpuRoom
    fits: int | None


class Bound(_Answer):
    """The level and resource that bound ``fits``: the first to run out."""

    level: Level
    resource: Resource


class HostMemory(_Answer):
    """The host's memory as the kernel counts it (/proc/meminfo): MemTotal and MemAvailable
    (null where the kernel has none). Reported beside admission's figures, never in them."""

    total_bytes: int
    available_bytes: int | None


class Capacity(_Answer):
    """What still fits for ``user`` in ``project`` on this host. ``fits``: how many more
    sandboxes of ``shape`` a create admits now, one after another (null: admission counts no
    resource, or none that bounds them: the ceilings alone refuse a sandbox, as its own
    limits); ``counted``: the resources ``[admission]`` counts."""

    user: str
    project: str
    shape: Limits
    pool: str = ""  # the pool key's fingerprint, when the shape is a pool's
    pool_ready: int | None = None  # its members ready now: an acquire takes one, no create
    counted: tuple[Resource, ...]
    fits: int | None
    bound: Bound | None
    levels: tuple[LevelRoom, ...]  # managed, user, project
    host: HostMemory
