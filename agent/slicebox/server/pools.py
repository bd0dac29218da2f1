"""The agent's worker threads: bounded pools, one per kind of work, so no kind starves another.

Docker, systemd, cgroupfs and NSS calls block, so they run off the event loop; no call waits for
a command, and an exec holds no thread while its command runs: its output is read on the event
loop (:meth:`slicebox.core.execution.ExecEngine.astream`). Which pool a call runs on decides
what it can hold up:

- ``calls``: the short steps of every request: a create, get, list, destroy or usage read, an
  identity look-up, and an exec's own steps (finding the sandbox and its cgroup, creating the
  exec, polling its exit code, killing it at its timeout, writing its audit record).
- ``background``: the reaper's passes and the memory sampler, which never wait behind requests
  and never make requests wait.

Each pool is bounded, and nothing else makes threads per request: the agent's thread count does
not grow with the number of callers or of execs running.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

# A create holds a calls thread for up to a second or so (systemd, Docker create and start) and
# every exec passes through several times: 16 keeps an exec's steps from queueing long behind a
# burst of creates, and the agent well under 40 threads in all.
CALL_THREADS = 16
BACKGROUND_THREADS = 2


def _pool(size: int, name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"slicebox-{name}")


@dataclass(frozen=True)
class Pools:
    calls: ThreadPoolExecutor = field(default_factory=lambda: _pool(CALL_THREADS, "call"))
    background: ThreadPoolExecutor = field(
        default_factory=lambda: _pool(BACKGROUND_THREADS, "background")
    )

    async def call(self, function: Callable[[], T]) -> T:
        """``function()`` on the calls pool, awaited: the core's
        :class:`~slicebox.core.blocking.Blocking` for a request's steps."""
        return await run_in(self.calls, function)

    def shutdown(self) -> None:
        for pool in (self.calls, self.background):
            pool.shutdown(wait=False, cancel_futures=True)


async def run_in(pool: ThreadPoolExecutor, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on a thread of ``pool``, awaited from the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, functools.partial(function, *args))


POOLS = web.AppKey("slicebox.pools", Pools)


def pools_of(request: web.Request) -> Pools:
    return request.app[POOLS]
