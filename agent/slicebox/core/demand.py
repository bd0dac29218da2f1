"""Pools learned from demand (``[pool_learning]``): the requests of keys no pool serves, counted
within the learning window, and when a key has been asked for often enough to deserve a pool
of its own.

A key no table declares, asked for ``uses`` times within ``window_seconds``, gets a pool of
``size`` as if a table declared it (``core.poolkeys.learned_table``), at most ``max_pools`` of
them; one nobody asks for within the window is forgotten (``core.pool``), and its idle members
are the reaper's (``pool_surplus``). What was learned is memory only: a restarted agent learns
again, and trims the members an earlier run learned."""

import logging
from collections import deque
from collections.abc import Callable

from slicebox.model.config import PoolLearning
from slicebox.model.pool import PoolKey

log = logging.getLogger(__name__)


class Demand:
    """When each key no pool serves was asked for, within the window; not thread-safe (the
    warm pool calls it under its lock)."""

    def __init__(self) -> None:
        self._asked: dict[PoolKey, deque[float]] = {}

    def clear(self) -> None:
        self._asked.clear()

    def asked_enough(
        self, key: PoolKey, learning: PoolLearning, now: float, learned: Callable[[], int]
    ) -> bool:
        """Count a request of ``key`` at ``now``; whether it now deserves a pool: asked for
        ``uses`` times within the window, and room beside the ``learned()`` pools there are
        (counted only then: every cold request comes here)."""
        if not learning.enabled or key.cap_add or key.mounts or key.reuse:
            return False  # a [[pool]] table could not say them: such keys are declared only
        asked = self._asked.setdefault(key, deque())
        asked.append(now)
        for times in self._asked.values():
            while times and times[0] < now - learning.window_seconds:
                times.popleft()
        self._asked = {k: times for k, times in self._asked.items() if times}
        if len(asked) < learning.uses:
            return False
        if learned() >= learning.max_pools:
            log.info(
                "pool for %s/%s not learned: %s learned pools already (max_pools)",
                key.user,
                key.project,
                learning.max_pools,
            )
            return False
        del self._asked[key]
        return True
