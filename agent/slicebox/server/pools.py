"""The agent's worker threads: bounded pools, one per kind of work, so no kind starves another.

Docker, systemd, cgroupfs and NSS calls block, so they run off the event loop; no call waits for
a command, and an exec holds no thread while its command runs: its output is read on the event
loop (:meth:`slicebox.core.execution.ExecEngine.stream`). Which pool a call runs on decides
what it can hold up:

- ``calls``: the short steps of every request: a create's, get's, list's, destroy's or usage
  read's Docker, systemd and cgroupfs calls, an identity look-up, and an exec's own steps
  (finding the sandbox and its cgroup, killing it at its timeout, writing its audit record).
- ``background``: the reaper's passes and the memory sampler, which never wait behind requests
  and never make requests wait.

Each pool is bounded, and nothing else makes threads per request: the agent's thread count does
not grow with the number of callers or of execs running.

Some work goes on after its request has been answered: a one-shot run's removal. It is a task on
the event loop whose steps run on the calls pool too, at most :data:`AFTER_ANSWER_MAX` at once
(beyond that, a run removes its sandbox before answering, as it once always did), and
:class:`AfterAnswer` keeps track of it, so that a graceful stop of the agent waits for it (at
most :data:`AFTER_ANSWER_WAIT` seconds; whatever is left then, the reaper finishes at the next
start).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from slicebox.core.blocking import Blocking
from slicebox.web.app import AppKey
from slicebox.web.request import Request

log = logging.getLogger(__name__)
T = TypeVar("T")

# Each step of a create holds a calls thread (Docker's create and start, the longest, up to a
# second or so) and every exec passes through several times: 16 keeps an exec's steps from
# queueing long behind a burst of creates, and the agent well under 40 threads in all.
CALL_THREADS = 16
BACKGROUND_THREADS = 2
# Removals left running after their run's answer: each holds a calls thread for a second or so
# (mostly waiting for Docker, which removes ``backends.docker.REMOVALS`` at a time), so half of
# them at most, and requests' own steps always find threads.
AFTER_ANSWER_MAX = CALL_THREADS // 2
# How long a graceful stop waits for them: well within the unit's TimeoutStopSec (30 s).
AFTER_ANSWER_WAIT = 20.0


class AfterAnswer:
    """Work left running after its request was answered: bounded, and tracked to its end. It
    is taken on the event loop, and only there."""

    def __init__(self, limit: int = AFTER_ANSWER_MAX) -> None:
        self._limit = limit
        self._running: set[asyncio.Task[object]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._running)

    def submit(self, make: Callable[[], Awaitable[object]]) -> bool:
        """Start ``make()`` as a task of the running loop; False (nothing started) when
        ``limit`` are running or the agent is stopping: the caller then awaits it itself."""
        if self._closed or len(self._running) >= self._limit:
            return False
        task = asyncio.get_running_loop().create_task(_awaited(make))
        self._running.add(task)
        task.add_done_callback(self._done)
        return True

    async def drain(self, timeout: float = AFTER_ANSWER_WAIT) -> int:
        """Take no more, and wait up to ``timeout`` seconds for the work started so far; how
        much is unfinished."""
        self._closed = True
        running = list(self._running)
        if not running:
            return 0
        log.info("waiting up to %.0f s for %d removals after answers", timeout, len(running))
        _, left = await asyncio.wait(running, timeout=timeout)
        if left:
            log.warning("%d removals after answers unfinished; the reaper finishes them", len(left))
        return len(left)

    def _done(self, task: asyncio.Task[object]) -> None:
        self._running.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("work after an answer failed", exc_info=error)


async def _awaited(make: Callable[[], Awaitable[object]]) -> object:
    return await make()


def _pool(size: int, name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"slicebox-{name}")


class Pools:
    def __init__(self) -> None:
        self.calls = _pool(CALL_THREADS, "call")
        self.background = _pool(BACKGROUND_THREADS, "background")
        self.after_answer = AfterAnswer()

    async def call(self, function: Callable[[], T]) -> T:
        """``function()`` on the calls pool, awaited: the core's
        :class:`~slicebox.core.blocking.Blocking` for a request's steps."""
        return await run_in(self.calls, function)

    def aside(self, make: Callable[[Blocking], Awaitable[object]]) -> bool:
        """The coroutine ``make(self.call)`` after the answer, tracked: the core's
        :class:`~slicebox.core.blocking.Aside`."""
        return self.after_answer.submit(lambda: make(self.call))

    def shutdown(self) -> None:
        for pool in (self.calls, self.background):
            pool.shutdown(wait=False, cancel_futures=True)


async def run_in(pool: ThreadPoolExecutor, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on a thread of ``pool``, awaited from the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, functools.partial(function, *args))


POOLS = AppKey("slicebox.pools", Pools)


def pools_of(request: Request) -> Pools:
    return request.app[POOLS]
