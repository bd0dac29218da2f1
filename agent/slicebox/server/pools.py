"""The agent's worker threads: bounded pools, one per kind of work, so no kind starves another.

Docker, systemd and NSS calls block, so they run off the event loop; which pool a call runs on
decides what it can hold up:

- ``calls``: the short steps of a request (create, get, list, destroy, usage, identity look-ups).
- ``execs``: an exec holds its thread for the whole command, up to its timeout; a streaming exec
  holds exactly one (its output reaches the socket through an asyncio queue on the loop).
- ``background``: the reaper's passes and the memory sampler, which never wait behind requests
  and never make requests wait.

Each pool is bounded: the agent's thread count does not grow with the number of callers.
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

CALL_THREADS = 8
EXEC_THREADS = 24
BACKGROUND_THREADS = 2


def _pool(size: int, name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"slicebox-{name}")


@dataclass(frozen=True)
class Pools:
    calls: ThreadPoolExecutor = field(default_factory=lambda: _pool(CALL_THREADS, "call"))
    execs: ThreadPoolExecutor = field(default_factory=lambda: _pool(EXEC_THREADS, "exec"))
    background: ThreadPoolExecutor = field(
        default_factory=lambda: _pool(BACKGROUND_THREADS, "background")
    )

    def shutdown(self) -> None:
        for pool in (self.calls, self.execs, self.background):
            pool.shutdown(wait=False, cancel_futures=True)


async def run_in(pool: ThreadPoolExecutor, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on a thread of ``pool``, awaited from the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, functools.partial(function, *args))


POOLS = web.AppKey("slicebox.pools", Pools)


def pools_of(request: web.Request) -> Pools:
    return request.app[POOLS]
