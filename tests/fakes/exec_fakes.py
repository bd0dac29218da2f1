"""Fakes of the exec engine's interfaces (backends.base.ExecApi, AsyncExecAttachment, SandboxHost).

They keep a tiny model of a sandbox: a table of processes in its cgroup, an OOM counter, and a
scripted output stream. Time is a FakeClock that reads advance, so timeouts need no sleeping.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from slicebox.backends.base import AsyncExecAttachment, StdinSource
from slicebox.model.errors import SandboxNotFound
from slicebox.model.exec import ExecRequest, ExecState, OutputStream, StreamChunk
from tests.fakes.onloop import ExecCallsOnLoop

NONCE = re.compile(rb"'?([0-9a-f]{32})'? \"\$s\"")  # the marker's nonce in a launch line


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)  # other tasks run meanwhile, as they would


@dataclass
class FakeExec:
    """A scripted exec: what each read returns, in order; then silence until killed."""

    script: list[list[StreamChunk] | None]
    exit_code: int = 0
    pid: int = 4242
    pid_after_inspects: int = 0  # Docker reports pid 0 for this many inspects
    running_after_exit: int = 0  # ... and "running" for this many inspects after the exit
    exits_at_eof: bool = True  # False: the command closed its output but runs on
    silent_reads: int = 0  # reads that wait their whole timeout for nothing, before the script
    never_starts: bool = False  # the runtime refused it: pid 0, never running, then its code
    inspects: int = 0
    exited: bool = False
    killed: bool = False
    closed: bool = False
    stdin: bytes = b""
    request: ExecRequest | None = None


class FakeAttachment:
    def __init__(self, run: FakeExec, clock: FakeClock, host: FakeSandboxHost) -> None:
        self._run = run
        self._clock = clock
        self._host = host

    def read(self, timeout: float) -> list[StreamChunk] | None:
        if self._run.silent_reads > 0:
            self._run.silent_reads -= 1
            self._clock.now += timeout
            return []
        if self._run.script:
            item = self._run.script.pop(0)
            self._run.exited = item is None and self._run.exits_at_eof
            if item == []:  # a read that waited its whole timeout for nothing
                self._clock.now += timeout
            return item
        self._run.killed = self._run.pid not in self._host.procs
        if self._run.killed or self._run.exited:
            return None
        self._clock.now += timeout
        return []

    def close(self) -> None:
        self._run.closed = True


class FakeAsyncAttachment:
    """FakeAttachment on the event loop: the same script, each read a chance for other tasks."""

    def __init__(self, attachment: FakeAttachment) -> None:
        self._attachment = attachment

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        await asyncio.sleep(0)
        return self._attachment.read(timeout)

    def close(self) -> None:
        self._attachment.close()


@dataclass
class FakeSandboxHost:
    """Processes of one sandbox cgroup as (pid -> parent pid), with the process clock tick each
    started at (``started``; a process missing there counts as started with the exec)."""

    procs: dict[int, int] = field(default_factory=dict)
    started: dict[int, int] = field(default_factory=dict)
    ticks: int = 0
    oom_kill_count: int | None = 0
    oom_kills_during_exec: int = 0
    kill_calls: list[int] = field(default_factory=list)
    cgroup: Path = Path("/sys/fs/cgroup/slicebox.slice/docker-fake.scope")
    reads: int = 0
    scopes: list[str] = field(default_factory=list)  # the cgroups asked for by path

    def cgroup_of(self, pid: int) -> Path:
        return self.cgroup

    def cgroup_at(self, relative: str) -> Path:
        self.scopes.append(relative)
        return self.cgroup

    def oom_kills(self, cgroup: Path) -> int | None:
        self.reads += 1
        if self.oom_kill_count is None:
            return None
        return self.oom_kill_count + (self.oom_kills_during_exec if self.reads > 1 else 0)

    def process_clock(self) -> int:
        self.ticks += 1
        return self.ticks

    def kill_since(self, cgroup: Path, since: int) -> int:
        self.kill_calls.append(since)
        doomed = {p for p in self.procs if self.started.get(p, since) >= since}
        for victim in doomed:
            self.procs.pop(victim, None)
        return len(doomed)

    def kill_exec(self, cgroup: Path, pid: int, since: int) -> int:
        self.kill_calls.append(pid)
        doomed = {pid}
        while more := {p for p, parent in self.procs.items() if parent in doomed} - doomed:
            doomed |= more
        doomed = {p for p in doomed if self.started.get(p, since) >= since}
        for victim in doomed:
            self.procs.pop(victim, None)
        return len(doomed)


class FakeExecApi(ExecCallsOnLoop):
    def __init__(self, clock: FakeClock, host: FakeSandboxHost, run: FakeExec) -> None:
        self.clock = clock
        self.host = host
        self.run = run
        self.containers = {"box": 100}
        self.launched: list[str] = []  # the containers a run was launched in

    def sandbox_pid(self, container_id: str) -> int:
        if container_id not in self.containers:
            raise SandboxNotFound(f"no sandbox {container_id}")
        return self.containers[container_id]

    def make_exec(
        self, container_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        self.run.request = request
        return "exec-1"

    def attach_run(self, exec_id: str, stdin: bytes) -> FakeAttachment:
        self.run.stdin = stdin
        self.host.procs.setdefault(self.run.pid, 100)
        self.host.started.setdefault(self.run.pid, self.host.process_clock())
        return FakeAttachment(self.run, self.clock, self.host)

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> AsyncExecAttachment:
        if not isinstance(stdin, bytes):  # a streamed stdin is read whole, then the script runs
            stdin = b"".join([chunk async for chunk in _chunks(stdin)])
        return FakeAsyncAttachment(self.attach_run(exec_id, stdin))

    async def launch_async(self, container_id: str, stdin: bytes) -> FakeAsyncAttachment:
        """The script as the sandbox's waiter would run it (``core.launch``): the line is
        kept as the run's stdin, and the script's end is the waiter's two markers."""
        self.launched.append(container_id)
        nonce = NONCE.search(stdin)
        if nonce is None:
            raise AssertionError(f"no launch line in {stdin[:200]!r}")
        self.run.script = self.run.script[:]
        if None in self.run.script:
            end = self.run.script.index(None)
            marker = nonce.group(1) + b" %d\n" % self.run.exit_code
            markers = [StreamChunk(stream=s, data=marker) for s in OutputStream]
            self.run.script[end:end] = [markers]
        return FakeAsyncAttachment(self.attach_run(container_id, stdin))

    def exec_state(self, exec_id: str) -> ExecState:
        run = self.run
        run.inspects += 1
        run.killed = run.pid not in self.host.procs
        if run.never_starts:
            return ExecState(pid=0, running=False, exit_code=run.exit_code if run.exited else None)
        started = run.inspects > run.pid_after_inspects
        if run.exited and run.running_after_exit > 0:
            run.running_after_exit -= 1
            return ExecState(pid=run.pid, running=True, exit_code=None)
        finished = run.exited or run.killed
        code = 137 if run.killed else run.exit_code
        return ExecState(
            pid=run.pid if started else 0,
            running=not finished,
            exit_code=code if finished else None,
        )


async def _chunks(source: StdinSource) -> AsyncIterator[bytes]:
    while chunk := await source.read():
        yield chunk
