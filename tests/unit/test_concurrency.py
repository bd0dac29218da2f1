"""Many callers at once on the agent's real app and socket, the core over fakes: execs hold no
thread while their commands run, so many of them neither grow the agent's threads nor starve
short calls; a slow user database does not stall the event loop; the reaper's thread is its
own."""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from pathlib import Path

import pytest

from slicebox.backends.base import StdinSource
from slicebox.client import AsyncClient, Client
from slicebox.core.blocking import Blocking
from slicebox.host.identity import CachedUsers, PeerCredentials, SystemUsers, resolve
from slicebox.model.api import CreateSandbox
from slicebox.model.exec import (
    ExecEvent,
    ExecRequest,
    ExecResult,
    ExecState,
    OutputStream,
    StreamChunk,
)
from slicebox.server.api import base_routes, build_app
from slicebox.server.daemon import _every
from slicebox.server.pools import AFTER_ANSWER_MAX, CALL_THREADS, POOLS, AfterAnswer, Pools
from slicebox.web.server import serve_path
from tests.fakes.exec_fakes import FakeClock, FakeExecApi
from tests.unit.agentserver import served
from tests.unit.test_service import World

EXECS = 50
STARTED = StreamChunk(stream=OutputStream.STDOUT, data=b"started\n")


class GatedExecs(FakeExecApi):
    """Every exec prints a line, then its command runs until ``gate`` opens: its reads wait on
    the agent's event loop, as the real attachment's do."""

    def __init__(self, world: World) -> None:
        super().__init__(FakeClock(), world.host, world.run)
        self.gate = threading.Event()
        self.started = 0  # counted on the agent's loop thread only
        self._ids = itertools.count()

    def make_exec(
        self, container_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        return f"exec-{next(self._ids)}"

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> GatedAttachment:
        return GatedAttachment(self)

    def exec_state(self, exec_id: str) -> ExecState:
        return ExecState(pid=4242, running=False, exit_code=0)


class GatedAttachment:
    def __init__(self, execs: GatedExecs) -> None:
        self._execs = execs
        self._said = False

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        if not self._said:
            self._said = True
            self._execs.started += 1
            return [STARTED]
        if self._execs.gate.is_set():
            return None
        await asyncio.sleep(min(timeout, 0.02))
        return []

    def close(self) -> None:
        pass


def fill(pool: ThreadPoolExecutor, size: int) -> None:
    """Make ``pool`` start all its threads now (it starts them on demand)."""
    meet = threading.Barrier(size)
    for done in [pool.submit(meet.wait, 5) for _ in range(size)]:
        done.result()


def test_fifty_execs_hold_no_thread_and_a_list_still_answers_at_once(tmp_path: Path) -> None:
    """Issue 13: with six execs running, a list waited 2.5 s on the shared executor; then each
    running exec held a thread of a pool of 24, and the 25th waited for one."""
    request = ExecRequest(argv=("x",), output_cap=1000)

    async def stream(client: AsyncClient, box: str) -> list[ExecEvent]:
        async with aclosing(client.exec_stream(box, request)) as events:
            return [event async for event in events]

    with served(tmp_path) as agent:
        execs = agent.world.docker.execs = GatedExecs(agent.world)

        async def main() -> tuple[int, int, float, list[object]]:
            async with AsyncClient(agent.socket, timeout=30) as client:
                box = (await client.create(CreateSandbox(project="p"))).id
                execs.gate.set()
                await client.exec(box, request)  # the agent's threads, warmed up
                execs.gate = threading.Event()
                fill(agent.pools.calls, CALL_THREADS)
                before = threading.active_count()
                running = [
                    asyncio.ensure_future(
                        client.exec(box, request) if n % 2 else stream(client, box)
                    )
                    for n in range(EXECS)
                ]
                while execs.started < EXECS + 1:
                    await asyncio.sleep(0.01)
                during = threading.active_count()
                began = time.monotonic()
                assert [s.id for s in await client.list_sandboxes()] == [box]
                listed = time.monotonic() - began
                execs.gate.set()
                return before, during, listed, list(await asyncio.gather(*running))

        before, during, listed, answers = asyncio.run(main())
    print(f"threads: {before} with the agent idle, {during} with {EXECS} execs running")
    # All fifty ran at once (``started``) on the agent's loop: no thread per exec (the calls
    # pool had started all its threads before; other tests' threads may come and go).
    assert during <= before + 2
    assert listed < 2.0
    streamed = [a for a in answers if isinstance(a, list)]
    results = [a for a in answers if isinstance(a, ExecResult)] + [s[-1] for s in streamed]
    assert [r.exit_code for r in results if isinstance(r, ExecResult)] == [0] * EXECS
    assert [s[0] for s in streamed] == [STARTED] * (EXECS // 2)
    assert [e for e in agent.world.journal.events() if e[0] == "exec"] == [("exec", "ok")] * (
        EXECS + 1
    )


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
    users = SlowUsers(delay=1.0)

    async def main() -> tuple[float, int]:
        serving = await serve_path(build_app(base_routes(), users), str(tmp_path / "s.sock"))
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
        await serving.close()
        return max(gaps), users.calls

    worst, calls = asyncio.run(main())
    assert worst < 0.5, f"the loop stalled {worst:.2f}s behind a user look-up"
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
        for _ in range(CALL_THREADS + 8):
            pools.calls.submit(blocked.wait, 10)

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


def test_the_app_brings_bounded_pools_and_takes_them_down(tmp_path: Path) -> None:
    app = build_app(base_routes(), SystemUsers())
    pools = app[POOLS]
    assert pools.calls._max_workers == CALL_THREADS

    async def cycle() -> None:
        serving = await serve_path(app, str(tmp_path / "s.sock"))
        await serving.close()

    asyncio.run(cycle())
    with pytest.raises(RuntimeError):
        pools.calls.submit(int)


def test_work_after_answers_is_bounded_and_a_stopping_app_waits_for_it(tmp_path: Path) -> None:
    app = build_app(base_routes(), SystemUsers())
    pools = app[POOLS]
    gate, finished = threading.Event(), list[int]()

    async def removal(n: int, blocking: Blocking) -> None:
        await blocking(lambda: gate.wait(10))
        await asyncio.sleep(0.05)
        finished.append(n)

    async def cycle() -> None:
        serving = await serve_path(app, str(tmp_path / "s.sock"))
        taken = [pools.aside(functools.partial(removal, n)) for n in range(AFTER_ANSWER_MAX + 1)]
        assert taken == [True] * AFTER_ANSWER_MAX + [False], "beyond the bound the caller awaits"
        assert len(pools.after_answer) == AFTER_ANSWER_MAX
        threading.Timer(0.2, gate.set).start()
        await serving.close()

    asyncio.run(cycle())
    assert sorted(finished) == list(range(AFTER_ANSWER_MAX)), "the stop waited for each"
    with pytest.raises(RuntimeError):
        pools.calls.submit(int)


def test_a_stop_waits_for_work_after_answers_a_bounded_time() -> None:
    after = AfterAnswer(limit=1)

    async def main() -> None:
        gate = asyncio.Event()
        assert after.submit(gate.wait)
        assert not after.submit(gate.wait), "beyond the bound the caller awaits it itself"
        assert await after.drain(0.05) == 1, "unfinished: left to the reaper"
        gate.set()
        await asyncio.sleep(0.01)
        assert await after.drain(0.05) == 0
        assert not after.submit(gate.wait), "a stopping agent takes nothing: the caller awaits it"

    asyncio.run(main())
