"""The warm pool: containers kept ready for the keys the config declares, handed out at create.

A member is a sandbox made ahead of time for one ``[[pool]]`` table: in that table's project
slice (a cgroup parent cannot change, so a member can only ever serve that project), with
that key's image, limits, network and uid, running the waiter a one-shot run hands its command
to (``core.launch``; a ``reuse`` pool's members run ``sleep infinity``, as a created sandbox
does: a waiter serves one command), labelled ``slicebox.pool=true`` and
``slicebox.pool_key=<fingerprint>``. A create or one-shot run whose key (``poolkeys.key_of``, after
the same admission a cold create has) equals a pool's takes one of its ready members: its
lease, the lineage and deadline the request gives, is armed on its first deadline timer (one
systemd call) and the member is the request's sandbox. Anything else, and a key whose pool
has nothing ready, is created cold. Pools are also learned from demand (``core.demand``).

Refills run on the pool's own threads, never on a request's: an acquire only asks for one.
They make members up to each pool's size, and never past a level's headroom: what its
sandboxes, creates in flight and members being made are provisioned, against its MemoryMax and
TasksMax (and what more ``[admission]`` counts), as admission reckons it (core.headroom).

A release destroys the member by default (the caller's destroy), and the refill makes a fresh
one. A ``reuse`` pool (whose key says so, so only requests that asked for reuse ever match it)
takes a member back instead: every process started since its acquire is killed, its writable
scratch places are emptied, and it goes back to ready only if it is still healthy.

What this pool keeps in memory (ready lists, counters, acquire marks) is rebuilt at start-up
from Docker and systemd: an idle member of a declared key is adopted, the rest is the reaper's
(``pool_surplus``, ``pool_idle``); an acquired member's lineage is its lease (``docs/pool.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Protocol

from slicebox.core.blocking import from_thread
from slicebox.core.demand import Demand
from slicebox.core.headroom import WARM, LevelUse, amounts, fit, ratios_of, shown, where
from slicebox.core.instruments import NOWHERE, Instruments
from slicebox.core.poolkeys import key_of, learned_table, spec_of
from slicebox.core.poolstate import PoolCensus, PoolState, census_of, stats_of
from slicebox.core.recent import Recent
from slicebox.core.sandbox import KNOWN_SANDBOXES
from slicebox.core.sandboxes import Sandbox, SandboxManager
from slicebox.model.config import Config, PoolLearning
from slicebox.model.errors import SliceboxError
from slicebox.model.limits import human_bytes
from slicebox.model.names import slice_names
from slicebox.model.pool import PoolConfig, PoolKey, PoolList
from slicebox.model.spec import SandboxSpec

log = logging.getLogger(__name__)

REFILL_THREADS = 4  # Docker starts four containers at once for the agent (docker.HEAVY_CALLS)


class Reset(Protocol):
    """How a reuse pool's member is made fit for its next request (see :class:`MemberReset`)."""

    def mark(self) -> int:
        """Now, on the clock process start times are kept on."""

    def reset(self, sandbox: Sandbox, since: int) -> bool:
        """Kill every process of the sandbox started since ``since`` and empty its scratch
        places; whether it is healthy after."""


class WarmPool:
    """The pools of the config in force; thread-safe; refills on its own threads."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        reset: Reset | None = None,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        alive: Callable[[Sandbox], bool] = lambda member: True,
        instruments: Instruments = NOWHERE,
    ) -> None:
        """``alive``: whether an idle member still has its processes (its scope's cgroup is
        populated), asked at every acquire: a member killed while idle is replaced, never
        handed out. ``instruments``: where acquire and refill times are observed."""
        self.instruments = instruments
        # Container id -> its pool's fingerprint, of the members handed out (``census``).
        self._handed: Recent[str, str] = Recent(KNOWN_SANDBOXES)
        self._manager = manager
        self._alive = alive
        self._reset = reset
        self._executor = executor or ThreadPoolExecutor(
            REFILL_THREADS, thread_name_prefix="slicebox-pool"
        )
        self._clock = clock
        self._now = now
        self._lock = threading.Lock()
        self._pools: dict[PoolKey, PoolState] = {}
        self._cold = 0
        self._kicked = False  # a refill pass is queued and has not begun
        self._filling = threading.Lock()  # one refill pass at a time: each counts what is made
        # An acquired member of a reuse pool -> its acquire mark and itself as it was idle.
        self._reusable: dict[str, tuple[int, Sandbox]] = {}
        self._ready_since: dict[str, datetime] = {}  # member back from a reuse -> since when
        self._learning = PoolLearning()
        # A key no pool serves -> when it was asked for, within the learning window.
        self._demand = Demand()
        self.configure(manager.config)

    # --- configuration and start-up -----------------------------------------------------------

    def configure(self, config: Config) -> None:
        """Take the ``[[pool]]`` tables of ``config`` (at start and on reload). A pool kept
        keeps its members; a removed one's are the reaper's (``pool_surplus``). Pools learned
        from demand stay while learning is on (a table declaring the same key takes over)."""
        pools: dict[PoolKey, PoolState] = {}
        for table in config.pool:
            made = self._pool_of(table)
            if made is not None:
                with self._lock:
                    kept = self._pools.get(made.key)
                pools[made.key] = (
                    PoolState(table, made.key, made.admitted) if kept is None else kept
                )
                pools[made.key].config = table
                pools[made.key].learned = False
        with self._lock:
            self._learning = config.pool_learning
            if self._learning.enabled:
                learned = {k: p for k, p in self._pools.items() if p.learned and k not in pools}
                pools |= learned
            else:
                self._demand.clear()
            self._pools = pools

    def _pool_of(self, table: PoolConfig) -> PoolState | None:
        try:
            admitted = self._manager.admitted(spec_of(table))
        except SliceboxError as exc:
            log.warning("pool of %s/%s is off: %s", table.user, table.project, exc.message)
            return None
        key = key_of(admitted)
        return None if key is None else PoolState(table, key, admitted)

    def adopt(self) -> int:
        """Take the idle members a previous agent run made for a declared key into their
        pools, up to each pool's size (the reaper trims the rest); how many were taken."""
        members = [s for s in self._manager.find(pool="true") if s.pool_state == "idle"]
        taken = 0
        with self._lock:
            by_print = {pool.key.fingerprint(): pool for pool in self._pools.values()}
            for member in sorted(members, key=lambda s: s.created_at):
                pool = by_print.get(member.lineage.pool_key)
                known = pool is not None and member in pool.ready
                if pool is not None and not known and len(pool.ready) < pool.config.size:
                    pool.ready.append(member)
                    taken += 1
        return taken

    # --- acquire -----------------------------------------------------------------------------

    def acquire(
        self,
        spec: SandboxSpec,
        *,
        owner: tuple[int, int] | None = None,
        one_shot: bool = False,
    ) -> Sandbox | None:
        """A ready member of ``spec``'s key, leased to it; None: create it cold. One-shot, the
        member comes with an operation held, as ``SandboxManager.create`` returns one."""
        if not self._pools and not self._learning.enabled:
            return None
        started = self._clock()
        pool = self._pool_for(spec, owner)
        member = self._take(pool) if pool is not None else None
        leased = (
            None if pool is None or member is None else self._lease(pool, member, spec, one_shot)
        )
        if pool is not None and leased is not None:
            took = self._clock() - started
            self.instruments.pool_acquire_seconds.labels(pool.key.user, pool.key.project).observe(
                took
            )
            self._handed.put(leased.container_id, pool.key.fingerprint())
            with self._lock:
                pool.hits += 1
                pool.acquires.append(took)
        self.kick()
        return leased

    def _pool_for(self, spec: SandboxSpec, owner: tuple[int, int] | None) -> PoolState | None:
        """The pool of the spec's exact key, counted as a miss when it has nothing ready."""
        ttl = spec.ttl_seconds or self._manager.config.default_ttl_seconds
        key = key_of(self._manager.admitted(spec, owner))
        poolable = key is not None and ttl is not None and self._manager.deadlines is not None
        with self._lock:
            self._forget_unasked()
            pool = self._pools.get(key) if key is not None else None
            if pool is not None:
                pool.last_asked = self._clock()
            if pool is not None and poolable:
                return pool
            self._cold += 1
            learn = (
                key is not None
                and pool is None
                and poolable
                and self._demand.asked_enough(key, self._learning, self._clock(), self._learned)
            )
        if learn and key is not None:
            self._learn(key)
        return None

    # --- pools learned from demand -------------------------------------------------------------

    def _learned(self) -> int:  # pools learned from demand; under the lock
        return sum(p.learned for p in self._pools.values())

    def _learn(self, key: PoolKey) -> None:
        """Make ``key`` a pool of its own, as a ``[[pool]]`` table would (its members are
        made by the next refill); nothing when the table would not give back the same key."""
        learning = self._learning
        table = learned_table(key, learning)
        made = self._pool_of(table)
        if made is None or made.key != key:
            log.info(
                "pool for %s/%s not learned: its key cannot be declared", key.user, key.project
            )
            return
        with self._lock:
            if key in self._pools:
                return
            made.learned, made.last_asked = True, self._clock()
            self._pools[key] = made
        log.info(
            "learned a pool of %s for %s/%s (image %s, %s memory): asked for %s times in %ss",
            learning.size,
            key.user,
            key.project,
            key.image,
            human_bytes(key.limits.memory_bytes),
            learning.uses,
            learning.window_seconds,
        )

    def _forget_unasked(self) -> None:
        """Drop the learned pools nobody asked for within the window: their idle members are
        the reaper's (``pool_surplus``). Under the lock."""
        since = self._clock() - self._learning.window_seconds
        for key, pool in list(self._pools.items()):
            if pool.learned and pool.last_asked < since:
                del self._pools[key]
                log.info("forgot the learned pool of %s/%s: not asked for", key.user, key.project)

    def _take(self, pool: PoolState) -> Sandbox | None:
        """The oldest ready member that is still alive (the idle timeout takes the fewest);
        a dead one (killed, OOM-killed while idle) is destroyed on the pool's threads."""
        while True:
            with self._lock:
                if not pool.ready:
                    pool.misses += 1
                    return None
                member = pool.ready.pop(0)
                pool.acquiring.add(member.id)
                self._manager.begin_operation(member.id)
            if self._alive(member):
                return member
            log.warning("pool member %s has no process left; replacing it", member.id)
            with self._lock:
                pool.acquiring.discard(member.id)
                self._ready_since.pop(member.id, None)
            self._manager.end_operation(member.id)
            self._executor.submit(self._manager.destroy_sandbox, member, _nothing)

    def _lease(
        self, pool: PoolState, member: Sandbox, spec: SandboxSpec, one_shot: bool
    ) -> Sandbox | None:
        """The member with its lease armed; None when the lease failed (a parent not found,
        systemd refusing): the request is created cold, which says what is wrong, and the
        member, whose state is not known for sure, is destroyed on the pool's threads."""
        mark = self._reset.mark() if pool.key.reuse and self._reset else None
        try:
            leased = self._manager.lease(member, spec, one_shot=one_shot)
        except Exception as exc:
            log.warning("could not lease pool member %s (%s); creating cold", member.id, exc)
            leased = None
        with self._lock:
            pool.acquiring.discard(member.id)
            self._ready_since.pop(member.id, None)
            if leased is not None and mark is not None:
                self._reusable[member.id] = (mark, member)
        if leased is None or not one_shot:
            self._manager.end_operation(member.id)
        if leased is None:
            self._executor.submit(self._manager.destroy_sandbox, member, _nothing)
        return leased

    # --- release -----------------------------------------------------------------------------

    def takes_back(self, sandbox: Sandbox) -> bool:
        """Whether a destroy of ``sandbox`` is a release into its reuse pool instead: a member
        acquired by this agent run from a pool whose key says reuse."""
        with self._lock:
            return sandbox.id in self._reusable and self._reuse_pool(sandbox) is not None

    def release(self, sandbox: Sandbox) -> bool:
        """Take a reuse member back: reset, checked, its lease disarmed, ready again. False:
        it is not fit (or not wanted any more), and the caller destroys it."""
        with self._lock:
            taken = self._reusable.pop(sandbox.id, None)
            pool = self._reuse_pool(sandbox)
        if taken is None or pool is None or self._reset is None:
            return False
        mark, idle = taken
        with self._manager.operation(sandbox.id):
            if not self._reset.reset(sandbox, mark):
                log.info("pool member %s is not healthy after its reset; replacing it", sandbox.id)
                return False
            deadlines = self._manager.deadlines
            if deadlines is not None:  # without its lease it is idle again
                deadlines.disarm(sandbox.id)
        with self._lock:
            pool.ready.append(idle)
            self._ready_since[sandbox.id] = self._now()
        return True

    def _reuse_pool(self, sandbox: Sandbox) -> PoolState | None:
        for pool in self._pools.values():
            if pool.key.reuse and pool.key.fingerprint() == sandbox.lineage.pool_key:
                return pool
        return None

    def withdraw(self, sandbox_id: str) -> bool:
        """The reaper's, before it removes an idle member: False while an acquire takes it
        (the reaper leaves it); True once it is out of every ready list, or was in none."""
        with self._lock:
            for pool in self._pools.values():
                if sandbox_id in pool.acquiring:
                    return False
                pool.ready = [m for m in pool.ready if m.id != sandbox_id]
            self._ready_since.pop(sandbox_id, None)
            return True

    def ready_since(self) -> dict[str, datetime]:
        """Members back from a reuse -> since when they are idle (others: since created)."""
        with self._lock:
            return dict(self._ready_since)

    def trims(self) -> dict[str, tuple[int, float]]:
        """Fingerprint -> (size, idle timeout in seconds) of every pool: the reaper's rules."""
        with self._lock:
            self._forget_unasked()
            return {
                p.key.fingerprint(): (p.config.size, p.config.idle_timeout_seconds)
                for p in self._pools.values()
            }

    # --- refill ------------------------------------------------------------------------------

    def kick(self) -> None:
        """Queue a refill pass on the pool's own threads; returns at once (a pass queued and
        not begun yet is not queued twice)."""
        with self._lock:
            if self._kicked or not self._pools:
                return
            self._kicked = True
        self._executor.submit(self.refill)

    def refill(self) -> None:
        """Start the members every pool lacks (each on a thread of its own), within headroom."""
        with self._filling:
            with self._lock:
                self._kicked = False
                pools = list(self._pools.values())
            for pool in pools:
                for _ in range(self._wanted(pool)):
                    self._executor.submit(self._make, pool)

    def _wanted(self, pool: PoolState) -> int:
        """How many members to start now: up to the size, within the project's headroom."""
        with self._lock:
            short = pool.config.size - len(pool.ready) - len(pool.acquiring) - pool.creating
        if short <= 0:
            return 0
        room, why = self._headroom(pool)
        with self._lock:
            wanted = max(0, min(short, room))
            pool.held_back = why if room < short else ""
            pool.creating += wanted
        return wanted

    def _headroom(self, pool: PoolState) -> tuple[int, str]:
        """Members of this pool the slice tree still has room for (``core.headroom``, as
        admission counts): what each level's sandboxes and creates in flight are provisioned,
        and the members still to be made, against its MemoryMax and TasksMax at least."""
        key = pool.key
        found = self._manager.commitments.levels(key.user, key.project, pool.admitted.placement)
        with self._lock:
            making = [(p.key, p.creating) for p in self._pools.values() if p.creating]
        ratios = WARM.within(ratios_of(self._manager.config.admission))
        room = fit(key.limits, [_making(use, making) for use in found], ratios)
        if room.fits is None or room.level is None or room.room is None:
            return 1 << 30, ""
        left, resource = room.room.left or 0, room.room.resource
        why = f"{shown(resource, left)} of {resource.value} left under its ceiling"
        return room.fits, f"{where(room.level)} has {why}"

    def _make(self, pool: PoolState) -> None:
        started = self._clock()
        try:
            spec, key = spec_of(pool.config), pool.key.fingerprint()
            member = from_thread(lambda b: self._manager.create(spec, b, pool_key=key))
        except SliceboxError as exc:
            # A refusal says what to do (the image to pull, the plugin to upload): once, as a
            # warning, and in the pool's stats, not a traceback at every refill until then.
            self._failed(pool, f"{exc.code}: {exc.message}")
            return
        except Exception:
            log.exception("could not make a member of pool %s/%s", pool.key.user, pool.key.project)
            self._failed(pool, "internal: see the agent's log")
            return
        took = self._clock() - started
        self.instruments.pool_refill_seconds.labels(pool.key.user, pool.key.project).observe(took)
        with self._lock:
            pool.creating -= 1
            pool.ready.append(member)
            pool.refills.append(took)
            recovered, pool.failing = pool.failing, ""
        if recovered:
            log.info("pool %s/%s makes members again", pool.key.user, pool.key.project)
        self._manager.end_operation(member.id)  # held since its create: now the pool's

    def _failed(self, pool: PoolState, why: str) -> None:
        with self._lock:
            pool.creating -= 1
            new, pool.failing = why != pool.failing, why
        (log.warning if new else log.debug)(
            "pool %s/%s cannot make a member (tried again at each refill): %s",
            pool.key.user,
            pool.key.project,
            why,
        )

    # --- what it shows -----------------------------------------------------------------------

    def stats(self) -> PoolList:
        members = self._manager.find(pool="true")
        busy: dict[str, int] = {}
        for member in members:
            if member.pool_state == "acquired":
                busy[member.lineage.pool_key] = busy.get(member.lineage.pool_key, 0) + 1
        with self._lock:
            pools = [stats_of(p, busy.get(p.key.fingerprint(), 0)) for p in self._pools.values()]
            return PoolList(pools=pools, cold=self._cold)

    def census(self) -> list[PoolCensus]:
        """Each pool as a scrape sees it, from memory alone (``stats`` lists Docker)."""
        handed: dict[str, set[str]] = {}
        for container_id, fingerprint in self._handed.items():
            handed.setdefault(fingerprint, set()).add(container_id)
        with self._lock:
            return [
                census_of(p, frozenset(handed.get(p.key.fingerprint(), ())))
                for p in self._pools.values()
            ]

    def shutdown(self) -> None:
        if isinstance(self._executor, ThreadPoolExecutor):
            self._executor.shutdown(wait=False, cancel_futures=True)


def _making(use: LevelUse, making: list[tuple[PoolKey, int]]) -> LevelUse:
    """The level with the members still to be made below it (each a create to come)."""
    used = use.used
    for key, count in making:
        if use.unit in slice_names(key.user, key.project).model_dump().values():
            used = used.plus(amounts(key.limits), count)
    return use._replace(used=used)


def _nothing(sandbox: Sandbox) -> None:
    """A destroy's last look that reads nothing (a member no task used)."""
