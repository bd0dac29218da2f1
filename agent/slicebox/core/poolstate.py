"""One warm pool's state in memory (:mod:`slicebox.core.pool` keeps one per key), and what it
shows: its stats for ``GET /v1/pool`` and its census for ``GET /metrics``, which is read from
memory only (a scrape asks Docker nothing).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple

from slicebox.core.policy import Admitted
from slicebox.core.sandbox import Sandbox
from slicebox.model.pool import PoolConfig, PoolKey, PoolStats

SAMPLES = 64  # refill and acquire durations kept for the medians


class PoolState:
    def __init__(self, config: PoolConfig, key: PoolKey, admitted: Admitted) -> None:
        self.config = config
        self.key = key
        self.admitted = admitted
        self.ready: list[Sandbox] = []
        self.acquiring: set[str] = set()
        self.creating = 0
        self.hits = 0
        self.misses = 0
        self.held_back = ""
        # Why its last member could not be made (a create's refusal), until one is.
        self.failing = ""
        self.refills: deque[float] = deque(maxlen=SAMPLES)
        self.acquires: deque[float] = deque(maxlen=SAMPLES)
        self.learned = False  # made for demand (``[pool_learning]``), not declared
        self.last_asked = 0.0  # when a request of its key last came (the pool's clock)


class PoolCensus(NamedTuple):
    """One pool as a scrape sees it: its owner, its key's fingerprint, the container ids of
    its ready members, its counters since it was made (this agent run), and the container ids
    of the members it handed out (busy while their scope runs)."""

    user: str
    project: str
    fingerprint: str
    ready: frozenset[str]
    hits: int
    misses: int
    creating: int
    handed: frozenset[str]


def census_of(pool: PoolState, handed: frozenset[str]) -> PoolCensus:
    key = pool.key
    return PoolCensus(
        user=key.user,
        project=key.project,
        fingerprint=key.fingerprint(),
        ready=frozenset(member.container_id for member in pool.ready),
        hits=pool.hits,
        misses=pool.misses,
        creating=pool.creating,
        handed=handed,
    )


def stats_of(pool: PoolState, busy: int) -> PoolStats:
    asked = pool.hits + pool.misses
    return PoolStats(
        key=pool.key,
        fingerprint=pool.key.fingerprint(),
        size=pool.config.size,
        ready=len(pool.ready),
        busy=busy,
        creating=pool.creating,
        hits=pool.hits,
        misses=pool.misses,
        hit_rate=pool.hits / asked if asked else None,
        refill_seconds_last=pool.refills[-1] if pool.refills else None,
        refill_seconds_p50=statistics.median(pool.refills) if pool.refills else None,
        acquire_seconds_p50=statistics.median(pool.acquires) if pool.acquires else None,
        held_back=pool.failing or pool.held_back,
        learned=pool.learned,
    )
