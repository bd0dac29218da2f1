"""How the core's async code runs its short blocking steps: Docker and systemd calls, cgroupfs
and /proc reads, journal writes.

The core does not own the agent's threads. Whoever calls an async entry point of the core passes
a :class:`Blocking` function, which runs one step where it may block and awaits it: the agent
passes its bounded calls pool (:mod:`slicebox.server.pools`); :func:`inline` runs the step in
place, for callers that are a worker thread themselves. Work that may go on after the answer (a
one-shot run's removal) is handed to an :class:`Aside` when the caller passes one.

A worker thread that needs the async core (a create's git clone, a pool member's wipe) calls
:func:`from_thread`: the coroutine runs on the core loop and its blocking steps in that thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, cast

T = TypeVar("T")
S = TypeVar("S")


class Blocking(Protocol):
    def __call__(self, function: Callable[[], T], /) -> Awaitable[T]:
        """Run ``function()`` where it may block; its result or its exception, awaited."""


class Aside(Protocol):
    def __call__(self, make: Callable[[Blocking], Awaitable[object]], /) -> bool:
        """Start the coroutine ``make(blocking)`` with a ``blocking`` of its own, and return
        without waiting for it: True when it was taken (whoever passes this sees it to its end,
        and a graceful stop of the agent waits for it); False when no more is taken now, and
        the caller awaits it itself."""


async def inline(function: Callable[[], T]) -> T:
    """A :class:`Blocking` that runs the step in the calling thread, which it blocks."""
    return function()


async def settle(blocking: Blocking, function: Callable[[], T]) -> T:
    """A step that undoes or records (a kill, an audit record, a destroy, the end of an
    operation): it runs to its end even when its caller is cancelled while it waits."""
    return await asyncio.shield(blocking(function))


# --- a worker thread's way into the async core ----------------------------------------------


class _CoreLoop:
    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    lock = threading.Lock()


_WAKE = 0.5  # how often a waiting thread looks whether its coroutine has ended


def _loop() -> asyncio.AbstractEventLoop:
    """The process's core loop, started at the first call: one thread that runs the coroutines
    worker threads hand to it, so what a backend keeps per loop (a connection pool) is made
    once."""
    with _CoreLoop.lock:
        if _CoreLoop.loop is None or _CoreLoop.loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="slicebox-core", daemon=True)
            thread.start()
            _CoreLoop.loop, _CoreLoop.thread = loop, thread
        return _CoreLoop.loop


def core_loop() -> asyncio.AbstractEventLoop:
    """The core loop (started at the first call): where work shared by callers of any loop runs."""
    return _loop()


class _Steps:
    """The blocking steps of one coroutine handed over by :func:`from_thread`, queued for the
    thread that waits for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()

    async def __call__(self, function: Callable[[], S], /) -> S:
        future: asyncio.Future[object] = self._loop.create_future()
        self.queue.put((function, future))
        return cast(S, await future)


_Step = tuple[Callable[[], object], "asyncio.Future[object]"]


def from_thread(make: Callable[[Blocking], Awaitable[T]]) -> T:
    """Run the coroutine ``make(blocking)`` from a worker thread (a create's, a pool refill's)
    and return its result or raise its exception.

    The coroutine runs on the core loop; each blocking step it awaits through ``blocking`` runs
    in the calling thread, which waits for the coroutine anyway: a kill or a cgroupfs read never
    holds up the loop, and no other thread is taken, so callers cannot starve each other."""
    loop = _loop()
    if threading.current_thread() is _CoreLoop.thread:  # waiting here would never end
        raise RuntimeError("from_thread was called on the core loop, which it waits for")
    steps = _Steps(loop)

    async def main() -> T:
        try:
            return await make(steps)
        finally:
            steps.queue.put(None)

    done = asyncio.run_coroutine_threadsafe(main(), loop)
    while True:
        try:
            step = steps.queue.get(timeout=_WAKE)
        except queue.Empty:
            if done.done():
                break
            continue
        if step is None:
            break
        function, future = step
        try:
            value = function()
        except Exception as exc:  # handed to the coroutine that asked
            loop.call_soon_threadsafe(_settle_future, future, None, exc)
        except BaseException:
            done.cancel()
            raise
        else:
            loop.call_soon_threadsafe(_settle_future, future, value, None)
    return done.result()


def on_core_loop(make: Callable[[], Awaitable[T]]) -> T:
    """``make()`` awaited on the core loop from a worker thread, for a coroutine that has no
    blocking step (an adapter's network calls): the :class:`~slicebox.backends.base.Portal`
    the composition root gives the backends that are async inside."""
    return from_thread(lambda _: make())


def _settle_future(
    future: asyncio.Future[object], value: object, exc: BaseException | None
) -> None:
    if future.done():  # its coroutine was cancelled meanwhile
        return
    if exc is None:
        future.set_result(value)
    else:
        future.set_exception(exc)
