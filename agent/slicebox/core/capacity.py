"""The capacity answer (``GET /v1/capacity``, ``Service.capacity``): for a user, one of its
projects and the host (the managed level), what each level's sandboxes and creates in flight
are provisioned against its ceilings, what admission leaves, and how many sandboxes of one
shape fit now.

Every figure is what a create's admission uses at that moment: the shape goes through the
create's own parsing and per-sandbox checks (``policy.sized``: an unparsable size is
``invalid_limit``, a shape over a project's or user's ceiling ``admission_refused``, as a
create of it would be), and the levels' rooms and ``fits`` are ``core.headroom``'s, over the
ledger admission counts (``core.commitments``). So ``fits == n`` means that n creates of the
shape, one after another, are admitted and the next is refused, unless something else is
created or destroyed meanwhile. The host's available memory (``host.meminfo``) is reported
beside them, never in them.

Who may ask: anyone for their own user; root and slicebox-admin for any user. Another user's
capacity, or pool, answers a caller who may not see it ``not_found``, in the same words for
every name, so nothing tells whether that user exists or what it runs. The host level is
shown to everyone: it bounds everyone's creates, and holds sums only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from slicebox.core.blocking import Blocking
from slicebox.core.headroom import USEC_PER_CPU, LevelUse, Ratios, fit, ratios_of, rooms
from slicebox.core.headroom import Room as Held
from slicebox.core.policy import sized
from slicebox.core.pool import WarmPool
from slicebox.core.sandboxes import SandboxManager
from slicebox.host.identity import Identity
from slicebox.host.meminfo import read_meminfo
from slicebox.model.capacity import (
    Bound,
    Capacity,
    CapacityQuery,
    CpuRoom,
    HostMemory,
    LevelRoom,
    Resource,
    Room,
)
from slicebox.model.errors import InvalidName, InvalidRequest, NotFound
from slicebox.model.limits import Limits
from slicebox.model.pool import PoolStats
from slicebox.model.spec import parse_spec


class Capacities:
    """What the Service answers ``GET /v1/capacity`` with."""

    def __init__(
        self,
        sandboxes: SandboxManager,
        pool: WarmPool | None,
        meminfo: Callable[[], HostMemory] = read_meminfo,
    ) -> None:
        self._sandboxes = sandboxes
        self._pool = pool
        self._meminfo = meminfo

    async def answer(self, who: Identity, query: CapacityQuery, blocking: Blocking) -> Capacity:
        """The answer to ``query`` as ``who`` may have it. The host's memory is read, and a
        pool looked up (its stats list Docker's pool members), through ``blocking``."""
        if query.pool and _shape(query, None) != _NO_SHAPE:
            raise InvalidRequest(
                "pool: give a shape (memory, cpus, pids) or a pool, not both",
                code="invalid_field",
                field="pool",
            )
        pool = await self._pool_of(who, query, blocking) if query.pool else None
        user = pool.key.user if pool else _user(who, query.user)
        project = pool.key.project if pool else query.project
        if project is None:
            raise InvalidName(
                "project: required; name the project whose capacity you ask for (or a pool)",
                field="project",
            )
        spec = parse_spec({"user": user, "project": project, **_shape(query, pool)})
        config, manager = self._sandboxes.config, self._sandboxes
        shape, placement = sized(spec, config, manager.host_memory)
        uses = manager.commitments.levels(user, project, placement)
        host = await blocking(self._meminfo)
        ratios = ratios_of(config.admission)
        return answered(user, project, shape, uses, ratios, host=host, pool=pool)

    async def _pool_of(self, who: Identity, query: CapacityQuery, blocking: Blocking) -> PoolStats:
        """The pool ``query.pool`` names, if the caller may see it and it serves the user and
        project the query names (when it names them)."""
        found = await blocking(self._pool.stats) if self._pool is not None else None
        for pool in found.pools if found is not None else ():
            key = pool.key
            mine = who.may_see(key.user) and query.user in (None, key.user)
            if pool.fingerprint == query.pool and mine and query.project in (None, key.project):
                return pool
        raise NotFound(f"no pool {query.pool} of yours; GET /v1/pool lists their keys")


_NO_SHAPE = {"memory": None, "cpus": None, "pids": None}


def _shape(query: CapacityQuery, pool: PoolStats | None) -> dict[str, object]:
    """The shape's fields as a create request gives them: the query's, or the pool key's."""
    if pool is None:
        return query.model_dump(include={"memory", "cpus", "pids"})
    limits = pool.key.limits
    return {"memory": limits.memory_bytes, "cpus": limits.cpus, "pids": limits.pids}


def _user(who: Identity, asked: str | None) -> str:
    """The user whose capacity is asked: the caller's own unless an admin names another; any
    other name is answered as a user with nothing would be, never ``forbidden``."""
    if asked is None or asked == who.user_name:
        return who.user_name
    if not who.is_admin:
        raise NotFound(
            f"no capacity of user {asked!r} for you to see; leave 'user' out for your own"
        )
    return asked


def answered(
    user: str,
    project: str,
    shape: Limits,
    uses: Sequence[LevelUse],
    ratios: Ratios,
    *,
    host: HostMemory,
    pool: PoolStats | None = None,
) -> Capacity:
    """The answer from admission's own figures: each level's rooms and ``fits``, and the
    shape's ``fits`` across them all (the level and resource that run out first)."""
    found = fit(shape, uses, ratios)
    bound = (
        Bound(level=found.level.level, resource=found.room.resource)
        if found.level is not None and found.room is not None
        else None
    )
    return Capacity(
        user=user,
        project=project,
        shape=shape,
        pool=pool.fingerprint if pool else "",
        pool_ready=pool.ready if pool else None,
        counted=tuple(r for r, ratio in zip(Resource, ratios, strict=True) if ratio is not None),
        fits=found.fits,
        bound=bound,
        levels=tuple(_level(use, shape, ratios) for use in uses),
        host=host,
    )


def _level(use: LevelUse, shape: Limits, ratios: Ratios) -> LevelRoom:
    memory, pids, cpus = rooms(use, ratios)
    return LevelRoom(
        level=use.level,
        unit=use.unit,
        sandboxes=use.used.sandboxes,
        memory=_room(memory),
        pids=_room(pids),
        cpus=CpuRoom(
            ceiling=_cpus(cpus.ceiling),
            admits=_cpus(cpus.admits),
            provisioned=cpus.used / USEC_PER_CPU,
            left=_cpus(cpus.left),
        ),
        fits=fit(shape, [use], ratios).fits,
    )


def _room(held: Held) -> Room:
    return Room(ceiling=held.ceiling, admits=held.admits, provisioned=held.used, left=held.left)


def _cpus(usec: int | None) -> float | None:
    return None if usec is None else usec / USEC_PER_CPU
