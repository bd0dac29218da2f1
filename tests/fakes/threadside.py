"""The service's awaited calls made from a test's own thread, the way a worker thread makes
them (:func:`~slicebox.core.blocking.from_thread`): the tests of what a call does, beside the
ones of how it behaves on the agent's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import TypeVar

from slicebox.core.blocking import from_thread
from slicebox.core.service import Service
from slicebox.core.shares import Reservation
from slicebox.host.identity import Identity
from slicebox.model.api import Destroyed, RunRequest, RunResult
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult

T = TypeVar("T")


async def _offloaded(function: Callable[[], T]) -> T:
    return await asyncio.to_thread(function)


class ThreadSide:
    def __init__(self, service: Service) -> None:
        self._service = service

    def exec(
        self, who: Identity, sandbox_id: str, request: ExecRequest, held: Reservation | None = None
    ) -> ExecResult:
        return from_thread(lambda b: self._service.exec(who, sandbox_id, request, held, b))

    def run(self, who: Identity, request: RunRequest, held: Reservation | None = None) -> RunResult:
        return from_thread(lambda b: self._service.run(who, request, held, b))

    def destroy(self, who: Identity, sandbox_id: str) -> Destroyed:
        return from_thread(lambda b: self._service.destroy(who, sandbox_id, b))

    def exec_stream(
        self, who: Identity, sandbox_id: str, request: ExecRequest, held: Reservation | None = None
    ) -> Generator[ExecEvent, None, None]:
        """Closing it early closes the service's stream (which kills the exec)."""
        events = self._service.exec_stream(who, sandbox_id, request, held, _offloaded)
        try:
            while True:
                try:
                    event = from_thread(lambda _: anext(events))
                except StopAsyncIteration:
                    return
                yield event
        finally:
            from_thread(lambda _: events.aclose())
