"""The agent's real app, every route, on a real unix socket, with the core over fakes.

For tests of what talks to the agent (the Python clients, the CLI): the bytes on the socket
are the agent's own, only Docker, systemd and the exec behind them are fakes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from slicebox.host.identity import SystemUsers
from slicebox.host.listen import bind_unix
from slicebox.model.exec import OutputStream, StreamChunk
from slicebox.server.api import build_app
from slicebox.server.pools import POOLS, Pools
from slicebox.server.routes import ROUTES
from slicebox.server.state import SERVICE
from slicebox.web.server import serve
from tests.fakes.exec_fakes import FakeExec
from tests.fakes.threadside import ThreadSide
from tests.unit.test_service import World


class AnyContainer(dict[str, int]):
    """Every container the fake Docker made can be exec'd in (init pid 100)."""

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> int:
        return 100


@dataclass
class Agent:
    socket: str
    world: World
    pools: Pools

    def script(self, *chunks: tuple[OutputStream, bytes], exit_code: int = 0) -> FakeExec:
        """The next exec prints ``chunks`` (one per read), then exits with ``exit_code``."""
        run = FakeExec(
            [[StreamChunk(stream=stream, data=data)] for stream, data in chunks] + [None],
            exit_code=exit_code,
        )
        self.world.exec_api.run = run
        return run

    def sandboxes(self) -> list[str]:
        """The sandboxes left, once what requests left running after their answers is done."""
        wait_for(lambda: not self.pools.after_answer)
        return [
            v.id
            for v in ThreadSide(self.world.service).list_sandboxes(self.world.service_identity())
        ]


@contextmanager
def served(tmp: Path, world: World | None = None) -> Iterator[Agent]:
    world = world or World(tmp)
    world.exec_api.containers = AnyContainer()
    path = tmp / "agent.sock"
    sock = bind_unix(path, group=None)
    loop = asyncio.new_event_loop()
    pools = Pools()
    app = build_app(ROUTES, SystemUsers(), {SERVICE: world.service, POOLS: pools})
    serving = loop.run_until_complete(serve(app, sock))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield Agent(str(path), world, pools)
    finally:
        asyncio.run_coroutine_threadsafe(serving.close(), loop).result(10)
        asyncio.run_coroutine_threadsafe(_settle(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        sock.close()
        pools.shutdown()


async def _settle() -> None:
    """End what requests left on the loop (a fake exec's reaper of its process, whose pipes it
    closes), as ``asyncio.run`` would: a task destroyed with its loop leaves a subprocess
    transport to the collector, which then complains of a closed loop."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.02)
