"""A worker thread's way into the async core (``core.blocking.from_thread``): the coroutine on
the core loop, its blocking steps in the thread that waits for it."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from slicebox.core.blocking import Blocking, from_thread
from slicebox.model.errors import SandboxNotFound


def test_the_coroutine_runs_on_the_core_loop_and_its_steps_in_the_calling_thread() -> None:
    caller = threading.current_thread()
    seen: dict[str, threading.Thread] = {}

    def step() -> int:
        seen["step"] = threading.current_thread()
        return 41

    async def work(blocking: Blocking) -> int:
        seen["coroutine"] = threading.current_thread()
        return await blocking(step) + 1

    assert from_thread(work) == 42
    assert seen["step"] is caller
    assert seen["coroutine"] is not caller
    assert seen["coroutine"].name == "slicebox-core"


def test_a_step_s_error_reaches_the_coroutine_and_then_the_caller() -> None:
    def missing() -> None:
        raise SandboxNotFound("no sandbox sbx-1")

    async def handled(blocking: Blocking) -> str:
        try:
            await blocking(missing)
        except SandboxNotFound as exc:
            return f"handled: {exc.message}"
        return "not raised"

    async def unhandled(blocking: Blocking) -> None:
        await blocking(missing)

    assert from_thread(handled) == "handled: no sandbox sbx-1"
    with pytest.raises(SandboxNotFound, match="sbx-1"):
        from_thread(unhandled)


def test_callers_do_not_wait_for_each_other_s_steps() -> None:
    """Eight threads whose steps block until all eight are in one: served by their own
    threads, so none waits behind another's (a shared pool of fewer would never finish)."""
    together = threading.Barrier(8, timeout=10)

    async def work(blocking: Blocking) -> int:
        await asyncio.sleep(0)
        return await blocking(together.wait)

    with ThreadPoolExecutor(8) as threads:
        ranks = list(threads.map(lambda _: from_thread(work), range(8)))
    assert sorted(ranks) == list(range(8))


def test_a_call_from_the_core_loop_itself_is_refused_not_hung() -> None:
    async def nested(blocking: Blocking) -> None:
        async def inner(blocking: Blocking) -> None:
            return None

        from_thread(inner)

    with pytest.raises(RuntimeError, match="core loop"):
        from_thread(nested)
