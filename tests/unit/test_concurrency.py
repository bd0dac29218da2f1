"""Many callers at once on the agent's real app and socket, the core over fakes: long execs do
not starve short calls, a slow user database does not stall the event loop, and the reaper's
thread is its own."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web

from slicebox.cli.client import Client
from slicebox.core.execution import OutputCapture
from slicebox.host.identity import CachedUsers, PeerCredentials, SystemUsers, resolve
from slicebox.model.exec import ExecResult
from slicebox.server.api import base_routes, build_app
from slicebox.server.daemon import _every
from slicebox.server.pools import EXEC_THREADS, POOLS, Pools
from tests.unit.agentserver import served, wait_for

DONE = OutputCapture(cap=0).result(exit_code=0, timed_out=False, oom_killed=False, duration=0.0)


def test_every_exec_thread_busy_and_a_list_still_answers_at_once(tmp_path: Path) -> None:
    """Issue 13: with six execs running, a list waited 2.5 s on the shared executor."""
    release, started = threading.Event(), []
    lock = threading.Lock()

    def long_exec(*args: object) -> ExecResult:
        with lock:
            started.append(1)
        release.wait(30)
        return DONE

    with served(tmp_path) as agent, ThreadPoolExecutor(EXEC_THREADS) as callers:
        client = Client(agent.socket, timeout=30)
        sandbox = client.request("POST", "/sandboxes", {"project": "p"})["id"]
        agent.world.service.exec = long_exec  # type: ignore[method-assign,assignment]
        try:
            running = [
                callers.submit(
                    client.request, "POST", f"/sandboxes/{sandbox}/exec", {"argv": ["x"]}
                )
                for _ in range(EXEC_THREADS)
            ]
            wait_for(lambda: len(started) == EXEC_THREADS)
            began = time.monotonic()
            listed = Client(agent.socket, timeout=5).request("GET", "/sandboxes")
            assert time.monotonic() - began < 2.0
            assert [s["id"] for s in listed] == [sandbox]
        finally:
            release.set()
        assert [f.result()["exit_code"] for f in running] == [0] * EXEC_THREADS


class SlowUsers(SystemUsers):
    """NSS behind a slow LDAP server: every look-up takes a while."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    def user_name(self, uid: int) -> str | None:
        self.calls += 1
        time.sleep(self.delay)
        return super().user_name(uid)


def test_a_slow_user_database_does_not_stall_the_loop_and_is_asked_once(tmp_path: Path) -> None:
    users = SlowUsers(delay=0.5)

    async def main() -> tuple[float, int]:
        runner = web.AppRunner(build_app(base_routes(), users))
        await runner.setup()
        site = web.UnixSite(runner, str(tmp_path / "s.sock"))
        await site.start()
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:  # what the watchdog task does
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        client = Client(str(tmp_path / "s.sock"), timeout=10)
        await asyncio.gather(
            *(asyncio.to_thread(client.request, "GET", "/health") for _ in range(4))
        )
        stop.set()
        await tick
        await runner.cleanup()
        return max(gaps), users.calls

    worst, calls = asyncio.run(main())
    assert worst < 0.3, f"the loop stalled {worst:.2f}s behind a user look-up"
    assert calls <= 4


def test_cached_users_ask_once_per_ttl() -> None:
    users, now = SlowUsers(delay=0), [0.0]
    cached = CachedUsers(users, ttl=10, clock=lambda: now[0])
    creds = PeerCredentials(pid=1, uid=0, gid=0)
    assert [resolve(creds, cached).user_name for _ in range(3)] == ["root"] * 3
    assert users.calls == 1
    now[0] = 11
    assert resolve(creds, cached).is_admin
    assert users.calls == 2


def test_the_reaper_runs_on_its_own_pool_while_every_request_thread_is_busy() -> None:
    pools = Pools()
    blocked, ran = threading.Event(), threading.Event()
    try:
        for _ in range(EXEC_THREADS + 8):
            pools.calls.submit(blocked.wait, 10)
            pools.execs.submit(blocked.wait, 10)

        async def main() -> None:
            task = asyncio.create_task(_every(0.01, ran.set, pools.background))
            try:
                await asyncio.wait_for(asyncio.to_thread(ran.wait, 5), 6)
            finally:
                task.cancel()

        asyncio.run(main())
        assert ran.is_set()
    finally:
        blocked.set()
        pools.shutdown()


def test_the_app_brings_bounded_pools_and_takes_them_down() -> None:
    app = build_app(base_routes(), SystemUsers())
    pools = app[POOLS]
    assert pools.execs._max_workers == EXEC_THREADS

    async def cycle() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        await runner.cleanup()

    asyncio.run(cycle())
    with pytest.raises(RuntimeError):
        pools.calls.submit(int)
