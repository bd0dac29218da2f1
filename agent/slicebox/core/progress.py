"""Where a create's progress goes: to whoever streams the answer, or nowhere.

The steps that take long (an image's pull in ``core.pulls``, a git clone in ``core.gitclone``,
the start in ``core.creation``) call :func:`report`; a streamed route runs the service's events
through :func:`with_progress`, which sets the context's sink (the create's shielded task copies
the context, so it reports there too) and puts the progress between the events as it comes.
Without a sink (every non-streamed call) a report is dropped.

A slow reader is never a reason to buffer: the feed keeps only the latest snapshot of each
phase, so what it holds is bounded whatever a pull says and however slowly the caller reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar, cast

from slicebox.model.progress import Phase, ProgressEvent

T = TypeVar("T")

Report = Callable[[ProgressEvent], None]


class ProgressFeed:
    """The latest snapshot of each phase not yet taken, and a wake-up for the reader.
    ``soft`` events (a start with nothing before it) are kept only once something was."""

    def __init__(self, *, soft_first: bool = False) -> None:
        self._pending: dict[Phase, ProgressEvent] = {}
        self._ready = asyncio.Event()
        self._opened = not soft_first

    def put(self, event: ProgressEvent) -> None:
        if event.phase is Phase.STARTING and not self._opened:
            return
        self._opened = True
        self._pending.pop(event.phase, None)  # the newest last, in the order phases came
        self._pending[event.phase] = event
        self._ready.set()

    def take(self) -> list[ProgressEvent]:
        taken, self._pending = list(self._pending.values()), {}
        self._ready.clear()
        return taken

    async def wait(self) -> None:
        await self._ready.wait()


_SINK: contextvars.ContextVar[Report | None] = contextvars.ContextVar(
    "slicebox_progress", default=None
)


def report(event: ProgressEvent) -> None:
    """Hand ``event`` to the current context's sink, if any."""
    sink = _SINK.get()
    if sink is not None:
        sink(event)


def sink() -> Report | None:
    """The current context's sink (a pull shared by many creates reports to each one's)."""
    return _SINK.get()


async def with_progress(
    events: AsyncGenerator[T, None], *, soft_first: bool = False
) -> AsyncGenerator[T | ProgressEvent, None]:
    """``events`` with the progress reported while each is awaited put before it. Closing
    this closes ``events`` (a streamed run's command is killed as before)."""
    feed = ProgressFeed(soft_first=soft_first)
    step = _step(events, feed)
    try:
        while True:
            waiting = asyncio.ensure_future(feed.wait())
            try:
                await asyncio.wait((step, waiting), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
            for event in feed.take():
                yield event
            if not step.done():
                continue
            item = step.result()
            if item is _END:
                return
            yield cast(T, item)
            step = _step(events, feed)
    finally:
        if not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
        await events.aclose()


_END: object = object()


def _step(events: AsyncGenerator[T, None], feed: ProgressFeed) -> asyncio.Task[object]:
    """The next of ``events`` in a task of its own, whose context (copied here) has the sink."""
    token = _SINK.set(feed.put)
    try:
        return asyncio.ensure_future(_next(events))
    finally:
        _SINK.reset(token)


async def _next(events: AsyncGenerator[T, None]) -> object:
    return await anext(events, _END)
