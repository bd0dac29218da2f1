"""An exec backend that runs the command on this machine: the real ``sh``, ``tar`` and ``cat``
that file transfers drive, in a directory that stands in for the sandbox's filesystem.

``LocalExecs`` implements the exec primitives of ``backends.base.ExecApi`` (on the event loop
only) and ``LocalHost`` the engine's ``SandboxHost``: its kill is a real SIGKILL of the exec's
process group. Every absolute path among the script's arguments is moved below ``root``, which is
how the fake confines what the sandbox's mount namespace confines for real. The attachment is
the real one's shape: stdout and stderr read as they come, a streamed stdin written only as the
pipe takes it, the source's failure raised by the next read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from slicebox.backends.base import StdinSource
from slicebox.core.launch import WAITER_COMMAND
from slicebox.model.exec import ExecRequest, ExecState, OutputStream, StreamChunk
from tests.fakes.onloop import ExecCallsOnLoop

PIECE = 64 * 1024


@dataclass
class LocalHost:
    """The engine's view of the sandbox's processes: only the kill does anything."""

    killed: list[int] = field(default_factory=list)
    waiters: list[int] = field(default_factory=list)  # launched waiters' process groups

    def cgroup_of(self, pid: int) -> Path:
        return Path("/nonexistent")

    def cgroup_at(self, relative: str) -> Path:
        return Path("/nonexistent")

    def oom_kills(self, cgroup: Path) -> int | None:
        return None

    def process_clock(self) -> int:
        return 0

    def kill_since(self, cgroup: Path, since: int) -> int:
        """The launched commands' processes: here the waiters' whole process groups (the
        waiter stands for the sandbox, so its run ends without its markers)."""
        return sum(self.kill_exec(cgroup, pid, since) for pid in self.waiters)

    def kill_exec(self, cgroup: Path, pid: int, since: int) -> int:
        self.killed.append(pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
            return 1
        return 0


class LocalAttachment:
    def __init__(self, process: asyncio.subprocess.Process, stdin: bytes | StdinSource) -> None:
        assert process.stdin is not None
        assert process.stdout is not None
        assert process.stderr is not None
        self._process = process
        self._queue: asyncio.Queue[StreamChunk | None] = asyncio.Queue(maxsize=2)
        self._open = 2
        self._tasks = [
            asyncio.create_task(self._pump(process.stdout, OutputStream.STDOUT)),
            asyncio.create_task(self._pump(process.stderr, OutputStream.STDERR)),
        ]
        self._feeder: asyncio.Task[None] | None = asyncio.create_task(
            self._feed(process.stdin, stdin)
        )

    async def _pump(self, pipe: asyncio.StreamReader, stream: OutputStream) -> None:
        while data := await pipe.read(PIECE):
            await self._queue.put(StreamChunk(stream=stream, data=data))
        await self._queue.put(None)

    async def _feed(self, pipe: asyncio.StreamWriter, stdin: bytes | StdinSource) -> None:
        try:
            if isinstance(stdin, bytes):
                await _write(pipe, stdin)
                return
            while chunk := await stdin.read():
                if not await _write(pipe, chunk):
                    return
        finally:
            pipe.close()

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        if self._open == 0:
            return None
        getter = asyncio.ensure_future(self._queue.get())
        woken = {getter} if self._feeder is None else {getter, self._feeder}
        await asyncio.wait(woken, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
        self._raise_stdin_failure()
        if not getter.done() or getter.cancelled():
            return []
        chunk = getter.result()
        if chunk is None:
            self._open -= 1
            return [] if self._open else None
        return [chunk]

    def _raise_stdin_failure(self) -> None:
        feeder = self._feeder
        if feeder is not None and feeder.done():
            self._feeder = None
            if not feeder.cancelled() and (error := feeder.exception()) is not None:
                raise error

    def close(self) -> None:
        for task in [*self._tasks, *([self._feeder] if self._feeder else [])]:
            task.cancel()
        self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """Close the process's pipes once it is gone (the engine kills it if it must), or
        when the loop ends: asyncio complains of a transport left to the collector."""
        try:
            await self._process.wait()
        finally:
            self._process._transport.close()  # type: ignore[attr-defined]


async def _write(pipe: asyncio.StreamWriter, data: bytes) -> bool:
    try:
        pipe.write(data)
        await pipe.drain()
    except (BrokenPipeError, ConnectionResetError):
        return False  # the command exited without reading all of its stdin
    return True


class LocalWaiter(LocalAttachment):
    """A launched run's attachment: the waiter goes with it, as its sandbox is removed."""

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        super().close()


class LocalExecs(ExecCallsOnLoop):
    def __init__(self, root: Path, host: LocalHost | None = None) -> None:
        self.root = root
        self.host = host or LocalHost()
        self.argv: dict[str, tuple[str, ...]] = {}
        self.processes: dict[str, asyncio.subprocess.Process] = {}

    def sandbox_pid(self, backend_id: str) -> int:
        return 1

    def make_exec(self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False) -> str:
        exec_id = f"local-{len(self.argv)}"
        self.argv[exec_id] = self._rooted(request.argv)
        return exec_id

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> LocalAttachment:
        process = await asyncio.create_subprocess_exec(
            *self.argv[exec_id],
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.processes[exec_id] = process
        return LocalAttachment(process, stdin)

    async def launch_async(self, backend_id: str, stdin: bytes) -> LocalWaiter:
        """The real waiter (``core.launch``) run by this machine's ``sh``, given ``stdin``."""
        process = await asyncio.create_subprocess_exec(
            *WAITER_COMMAND,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.host.waiters.append(process.pid)
        return LocalWaiter(process, stdin)

    def exec_state(self, exec_id: str) -> ExecState:
        process = self.processes[exec_id]
        code = process.returncode
        if code is not None and code < 0:
            code = 128 - code  # killed by a signal, as Docker reports it
        return ExecState(pid=process.pid, running=code is None, exit_code=code)

    def _rooted(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        head, args = argv[:4], argv[4:]  # sh -c SCRIPT sh, then the script's arguments
        return head + tuple(str(self.root) + a if a.startswith("/") else a for a in args)
