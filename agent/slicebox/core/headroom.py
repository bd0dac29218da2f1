"""What is provisioned and what is left at each level of the slice tree, and how many sandboxes
of one shape fit under it: the one computation behind a create's admission (which
``core.commitments`` makes under its lock), the capacity answer (``core.capacity``) and the
warm pool's refill (``core.pool``), so none of them can say a shape fits that another refuses.

A level's room in a resource is what ``[admission]`` lets its sandboxes add up to (its ceiling
times the resource's ratio; nothing when the resource is not counted or the level has no
ceiling) less what its sandboxes and creates in flight are provisioned. Amounts are whole
numbers (bytes, tasks, and CPU as systemd's quota counts it: microseconds of CPU per second),
so ``fits == n`` is exact: each of n sandboxes of the shape, made one after another, leaves the
next exactly its own amounts less, and the (n+1)th finds a level without room.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

from slicebox.core.policy import Placement
from slicebox.model.capacity import AdmissionConfig, Resource
from slicebox.model.errors import AdmissionRefused
from slicebox.model.limits import Ceiling, Limits, cpu_quota_usec, human_bytes, plain_number
from slicebox.model.usage import Level

USEC_PER_CPU = 1_000_000


class Ratios(NamedTuple):
    """How many times each level's ceiling a resource's limits may add up to; None: that
    resource is not counted."""

    memory: float | None = None
    pids: float | None = None
    cpus: float | None = None

    def within(self, other: Ratios) -> Ratios:
        """The stricter of the two for each resource (counted where either counts it)."""
        return Ratios(*(_stricter(a, b) for a, b in zip(self, other, strict=True)))


def _stricter(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def ratios_of(admission: AdmissionConfig) -> Ratios:
    return Ratios(admission.memory_ratio, admission.pids_ratio, admission.cpus_ratio)


# The warm pool makes no member past any level's MemoryMax or TasksMax, counted or not: a member
# is made ahead of any request, so it never takes room the kernel does not have.
WARM = Ratios(memory=1.0, pids=1.0)


class Amounts(NamedTuple):
    """What sandboxes are provisioned, summed: memory bytes, tasks, CPU (microseconds of CPU
    per second) and how many sandboxes."""

    memory: int = 0
    pids: int = 0
    cpus: int = 0
    sandboxes: int = 0

    def plus(self, other: Amounts, times: int = 1) -> Amounts:
        return Amounts(*(a + times * b for a, b in zip(self, other, strict=True)))


def amounts(limits: Limits) -> Amounts:
    """One sandbox's own limits as amounts (a CPU quota rounds to a microsecond, at least one,
    as systemd writes it)."""
    return Amounts(limits.memory_bytes, limits.pids, max(1, cpu_quota_usec(limits.cpus)), 1)


class LevelUse(NamedTuple):
    """One level: its slice, its ceilings and what is provisioned below it."""

    level: Level
    unit: str
    name: str  # "alice/web", "alice", "" for the host: what a message calls it
    ceiling: Ceiling
    used: Amounts


Used = tuple[Amounts, Amounts, Amounts]  # what is provisioned below managed, user, project


def levels(user: str, project: str, placement: Placement, used: Used) -> tuple[LevelUse, ...]:
    """The three levels above a sandbox of ``user`` in ``project`` (managed, user, project),
    placed at ``placement``, with what is provisioned below each."""
    names = placement.names
    return (
        LevelUse(Level.MANAGED, names.managed, "", placement.managed, used[0]),
        LevelUse(Level.USER, names.user, user, placement.user, used[1]),
        LevelUse(Level.PROJECT, names.project, f"{user}/{project}", placement.project, used[2]),
    )


class Room(NamedTuple):
    """One resource at one level: its ceiling, what admission lets it hold (None: not counted),
    what is provisioned, and what is left (None: not counted)."""

    resource: Resource
    ceiling: int | None
    admits: int | None
    used: int
    left: int | None


def rooms(use: LevelUse, ratios: Ratios) -> tuple[Room, Room, Room]:
    """The level's room in memory, pids and CPUs, in that order."""
    ceiling = use.ceiling
    cpus = None if ceiling.cpus is None else cpu_quota_usec(ceiling.cpus)
    found = (
        (Resource.MEMORY, ceiling.memory_bytes, ratios.memory, use.used.memory),
        (Resource.PIDS, ceiling.pids, ratios.pids, use.used.pids),
        (Resource.CPUS, cpus, ratios.cpus, use.used.cpus),
    )
    made = []
    for resource, cap, ratio, used in found:
        admits = None if cap is None or ratio is None else _times(cap, ratio)
        left = None if admits is None else max(0, admits - used)
        made.append(Room(resource, cap, admits, used, left))
    return made[0], made[1], made[2]


def _times(ceiling: int, ratio: float) -> int:
    """``ceiling`` times ``ratio``, rounded down exactly (no float rounding at large sizes)."""
    return math.floor(Fraction(ceiling) * Fraction(ratio))


class Fit(NamedTuple):
    """How many sandboxes of a shape fit (None: nothing counted bounds them), and the level
    and room that bound them."""

    fits: int | None
    level: LevelUse | None = None
    room: Room | None = None


def fit(shape: Limits, uses: Sequence[LevelUse], ratios: Ratios) -> Fit:
    """How many sandboxes of ``shape`` the levels ``uses`` still admit, one after another.
    Of two levels out of room at once the deeper is named: its ceiling is the nearer one."""
    need = amounts(shape)
    best = Fit(None)
    for use in reversed(uses):
        for room in rooms(use, ratios):
            if room.left is None:
                continue
            fits = room.left // _need(need, room.resource)
            if best.fits is None or fits < best.fits:
                best = Fit(fits, use, room)
    return best


def _need(need: Amounts, resource: Resource) -> int:
    return {Resource.MEMORY: need.memory, Resource.PIDS: need.pids, Resource.CPUS: need.cpus}[
        resource
    ]


def admit(shape: Limits, uses: Sequence[LevelUse], ratios: Ratios) -> None:
    """Refuse a sandbox of ``shape`` that a level has no room left for (admission's count)."""
    found = fit(shape, uses, ratios)
    if found.fits == 0 and found.level is not None and found.room is not None:
        raise _refused(shape, found.level, found.room)


def shown(resource: Resource, amount: int) -> str:
    """An amount as people read it: ``256 MiB``, ``100`` tasks, ``1.5`` CPUs."""
    if resource is Resource.MEMORY:
        return human_bytes(amount)
    if resource is Resource.CPUS:
        return plain_number(amount / USEC_PER_CPU)
    return str(amount)


def where(use: LevelUse) -> str:
    """A level as a message names it: ``project alice/web``, ``user alice``, ``the host``."""
    return f"{use.level.value} {use.name}" if use.name else f"the host ({use.unit})"


def _refused(shape: Limits, use: LevelUse, room: Room) -> AdmissionRefused:
    resource = room.resource
    asked = shown(resource, _need(amounts(shape), resource))
    left, admits = shown(resource, room.left or 0), shown(resource, room.admits or 0)
    used = shown(resource, room.used)
    hint = f"ask for at most {left}, " if room.left else ""
    return AdmissionRefused(
        f"{resource.value} {asked}: {where(use)} has {left} left of the {admits} its "
        f"sandboxes may add up to ({used} provisioned by its {use.used.sandboxes} sandboxes "
        f"and creates in flight); {hint}destroy sandboxes you no longer need, or ask an "
        f"operator to raise the {use.level.value} ceiling or [admission] "
        f"{resource.value}_ratio (GET /v1/capacity shows what is left)",
        field=resource.value,
    )
