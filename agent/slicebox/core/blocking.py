"""How the core's async code runs its short blocking steps: Docker and systemd calls, cgroupfs
and /proc reads, journal writes.

The core does not own the agent's threads. Whoever calls an async entry point of the core passes
a :class:`Blocking` function, which runs one step where it may block and awaits it: the agent
passes its bounded calls pool (:mod:`slicebox.server.pools`); :func:`inline` runs the step in
place, for callers that are a worker thread themselves. Work that may go on after the answer (a
one-shot run's removal) is handed to an :class:`Aside` when the caller passes one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Blocking(Protocol):
    def __call__(self, function: Callable[[], T], /) -> Awaitable[T]:
        """Run ``function()`` where it may block; its result or its exception, awaited."""


class Aside(Protocol):
    def __call__(self, function: Callable[[], object], /) -> bool:
        """Start ``function()`` where it may block, and return without waiting for it: True
        when it was taken (whoever passes this sees it to its end, and a graceful stop of the
        agent waits for it); False when no more is taken now, and the caller runs it itself."""


async def inline(function: Callable[[], T]) -> T:
    """A :class:`Blocking` that runs the step in the calling thread, which it blocks."""
    return function()


async def settle(blocking: Blocking, function: Callable[[], T]) -> T:
    """A step that undoes or records (a kill, an audit record, a destroy, the end of an
    operation): it runs to its end even when its caller is cancelled while it waits."""
    return await asyncio.shield(blocking(function))
