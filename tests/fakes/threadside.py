"""The service's awaited calls made from a test's own thread, the way a worker thread makes
them (:func:`~slicebox.core.blocking.from_thread`): the tests of what a call does, beside the
ones of how it behaves on the agent's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import TypeVar

from slicebox.core.blocking import from_thread
from slicebox.core.sandboxes import Sandbox, SandboxManager
from slicebox.core.service import Service
from slicebox.core.shares import Reservation
from slicebox.host.identity import Identity
from slicebox.model.api import (
    CreateSandbox,
    Destroyed,
    Extend,
    ReapRequest,
    RunRequest,
    RunResult,
    SandboxView,
)
from slicebox.model.capacity import Capacity, CapacityQuery
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult
from slicebox.model.reaper import Report
from slicebox.model.spec import SandboxSpec
from slicebox.model.usage import LevelNode, ResourceUsage

T = TypeVar("T")


async def _offloaded(function: Callable[[], T]) -> T:
    return await asyncio.to_thread(function)


def created(
    manager: SandboxManager,
    spec: SandboxSpec,
    *,
    one_shot: bool = False,
    owner: tuple[int, int] | None = None,
    pool_key: str = "",
) -> Sandbox:
    """``manager.create`` from the test's own thread."""
    return from_thread(
        lambda b: manager.create(spec, b, one_shot=one_shot, owner=owner, pool_key=pool_key)
    )


class ThreadSide:
    def __init__(self, service: Service) -> None:
        self._service = service

    def create(self, who: Identity, request: CreateSandbox) -> SandboxView:
        return from_thread(lambda b: self._service.create(who, request, b))

    def list_sandboxes(self, who: Identity) -> list[SandboxView]:
        return from_thread(lambda b: self._service.list_sandboxes(who, b))

    def get(self, who: Identity, sandbox_id: str) -> SandboxView:
        return from_thread(lambda b: self._service.get(who, sandbox_id, b))

    def extend(self, who: Identity, sandbox_id: str, request: Extend) -> SandboxView:
        return from_thread(lambda b: self._service.extend(who, sandbox_id, request, b))

    def destroy_tree(self, who: Identity, root_task_id: str) -> list[Destroyed]:
        return from_thread(lambda b: self._service.destroy_tree(who, root_task_id, b))

    def usage(self, who: Identity, sandbox_id: str) -> ResourceUsage:
        return from_thread(lambda b: self._service.usage(who, sandbox_id, b))

    def level_tree(self, who: Identity) -> LevelNode:
        return from_thread(lambda b: self._service.level_tree(who, b))

    def capacity(self, who: Identity, query: CapacityQuery) -> Capacity:
        return from_thread(lambda b: self._service.capacity(who, query, b))

    def reap(self, who: Identity, request: ReapRequest) -> Report:
        return from_thread(lambda b: self._service.reap(who, request, b))

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
