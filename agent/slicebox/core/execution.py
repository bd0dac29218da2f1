"""Exec in a sandbox: the request, the result, and the engine that runs one exec.

The engine talks to the world through three small interfaces, so its logic (caps, the timeout,
the OOM verdict) is tested with fakes and proved in the guest with the real ones:

- ``ExecApi``: the backend's exec primitives (:mod:`slicebox.backends.base`; the Docker
  backend's read the output off the daemon's socket).
- ``AsyncExecAttachment``: one exec's attached output stream, already demultiplexed.
- ``SandboxHost``: the sandbox's scope cgroup and its processes (``host.procs.CgroupHost``).

What is kept of an output stream: its head. The first ``output_cap`` bytes of each stream are
kept (and streamed); the rest is read and dropped, so the command never blocks on a full pipe,
and ``<stream>_dropped_bytes`` counts what was dropped. Memory is bounded by two caps plus one
read buffer whatever the command prints.

Docker cannot kill an exec. On timeout the engine asks the host to kill the exec's processes
(found from its host pid in exec inspect: its session and descendants, inside the sandbox's
cgroup only, none older than the exec) and answers once none is left, orphans and a fork bomb
included; the sandbox itself survives, and the result says ``timed_out`` with exit code 124.

How it runs: one exec's logic is one async generator (``ExecEngine._events``), written once.
The agent runs it on its event loop (``stream``): the output is awaited on the async
attachment (no thread waits while the command runs), the backend's exec calls are awaited on
the loop too, timeouts are checked on the same monotonic clock as the loop's, and the short
blocking steps (the sandbox's cgroup when its look-up did not give it, the OOM counter, the
kill) go through the :class:`~slicebox.core.blocking.Blocking` the caller passes, the agent's
calls pool. A worker thread (a pool member's wipe, an in-process caller) runs the same
generator with ``run``, through :func:`~slicebox.core.blocking.from_thread`.

File transfers (:mod:`slicebox.core.files`) are execs too, of ``tar`` or ``cat``: on the loop,
their stdin may be streamed from the upload's body (``StdinSource``) and their output handed
to a ``Capture`` of their own that streams all of stdout and keeps only stderr's head.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import NamedTuple, Protocol, TypeVar

from slicebox.backends.base import AsyncExecAttachment, ExecApi, StdinSource
from slicebox.core.blocking import Blocking, from_thread
from slicebox.core.execoutput import (
    PODMAN_EXEC_FAILED,
    START_FAILED,
    Capture,
    OutputCapture,
    explain_start_failure,
    is_paused_refusal,
    may_be_paused_refusal,
)
from slicebox.core.launch import Launched, launch_line, new_nonce
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import (
    TIMEOUT_EXIT_CODE,
    ExecEvent,
    ExecRequest,
    ExecResult,
    ExecState,
    StreamChunk,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# After the kill, how long the stream may take to end: the pipe closes when the killed processes
# are gone, unless a detached process (its own session) still holds it.
KILL_GRACE = 5.0
POLL = 0.5
EXIT_POLL = 0.02
# The pauses before each re-run of an exec the runtime refused while its scope was frozen. A
# kill's freeze lasts milliseconds on a quiet host and longer on a busy one; each re-run also
# takes a runtime start, so these span about ten seconds of a frozen scope, then the caller
# gets the runtime's words (a sandbox paused on purpose is refused before its exec is made).
PAUSED_RETRIES = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0)
# Output that looks like the runtime's refusal is held back until it is known for what it is:
# the refusal ends the stream without the command ever running. Past this many seconds from its
# first bytes, it is let go as soon as the backend says the command runs. No clock runs before
# the first bytes: on a busy host the runtime may take many seconds to refuse (a CI guest on
# one emulated CPU under five users' load took more than the two that once bounded it all).
REFUSAL_WAIT = 2.0


class SandboxHost(Protocol):
    def cgroup_of(self, pid: int) -> Path:
        """The cgroup directory the process is in: for a container's init, its scope."""

    def cgroup_at(self, relative: str) -> Path:
        """The directory of the cgroup at ``relative`` below the cgroup root (a sandbox's
        scope, where its labels place it)."""

    def oom_kills(self, cgroup: Path) -> int | None:
        """memory.events oom_kill of the cgroup; None when it cannot be read."""

    def process_clock(self) -> int:
        """Now, on the clock of process start times: taken before an exec starts, it tells the
        exec's processes from older ones."""

    def kill_exec(self, cgroup: Path, pid: int, since: int) -> int:
        """SIGKILL the processes of exec ``pid`` (begun at ``since``) inside ``cgroup``: its
        session and descendants, orphans included, until none is left, however fast they fork;
        return how many processes were killed."""

    def kill_since(self, cgroup: Path, since: int) -> int:
        """SIGKILL every process of ``cgroup`` started at ``since`` or later, until none is
        left (a launched command's: the sandbox's init and waiter are older); how many."""


class _Run:
    """The state of one exec while its output is pumped."""

    def __init__(
        self,
        exec_id: str,
        cgroup: Path | None,
        *,
        oom_before: int | None,
        since: int,
        started: float,
        deadline: float,
    ) -> None:
        self.exec_id = exec_id
        self.cgroup = cgroup  # None: a remote sandbox (no cgroup here; its backend kills)
        self.oom_before = oom_before
        self.since = since  # the host's process clock before the exec was created
        self.started = started
        self.deadline = deadline
        self.timed_out = False
        self.finished = False
        self.verdict: str | None = None  # the backend's word on how it ended (ExecState.verdict)


class _Io(NamedTuple):
    """How one exec's steps reach the world: its short blocking steps, its pauses, and its
    three calls to the backend (create, start, inspect). ``launched``: the command was handed
    to the sandbox's waiter (``core.launch``), so every process of the sandbox started since
    the run began is the run's, and a kill takes them all."""

    call: Blocking
    pause: Callable[[float], Awaitable[None]]
    create: Callable[[str, ExecRequest, bool], Awaitable[str]]
    start: Callable[[str, bytes | StdinSource], Awaitable[AsyncExecAttachment]]
    inspect: Callable[[str], Awaitable[ExecState]]
    launched: bool = False
    # The backend's own kill of an exec (``ExecApi.exec_kill``: the native backend stops its
    # unit); when it answers False, or is None, the engine kills the exec's processes through
    # the host.
    kill: Callable[[str], Awaitable[bool]] | None = None


class ExecEngine:
    """Runs execs in sandboxes (containers) through the interfaces above.

    One exec's logic is written once (``_events``): ``stream`` runs it on the caller's event
    loop, its output read there and its short blocking steps on the pool it is given; ``run``
    runs it to its result from a worker thread.
    """

    def __init__(
        self,
        api: ExecApi,
        host: SandboxHost,
        clock: Callable[[], float] = time.monotonic,
        asleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._api = api
        self._host = host
        self._clock = clock
        self._asleep = asleep

    def run(self, container_id: str, request: ExecRequest, scope: str | None = None) -> ExecResult:
        """``stream`` to its end from a worker thread (a pool member's wipe, an in-process
        caller), through :func:`~slicebox.core.blocking.from_thread`: its result."""
        return from_thread(
            lambda blocking: result_of(self.stream(container_id, request, blocking, scope))
        )

    def stream(
        self,
        container_id: str,
        request: ExecRequest,
        blocking: Blocking,
        scope: str | None = None,
        *,
        stdin: StdinSource | None = None,
        capture: Capture | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """Yield kept output chunks as they are produced, then the ExecResult, on the running
        event loop: the output is read there (no thread waits for it) and each short blocking
        step runs through ``blocking``. ``scope``: the container's scope cgroup, below the
        cgroup root, when the caller knows it (a sandbox it has just created); otherwise it is
        found from the container's init, which costs the backend a look-up. Closing the
        generator early (``aclose``), or cancelling its reader, kills the exec's processes.

        ``stdin``: a streamed stdin in place of ``request.stdin`` (a file upload's body);
        ``capture``: what becomes of the output, in place of keeping ``output_cap`` of each
        stream (a file download streams all of stdout and keeps none)."""
        api = self._api
        io = _Io(
            blocking,
            self._asleep,
            api.exec_create,
            api.exec_start,
            api.exec_inspect,
            kill=api.exec_kill,
        )
        return self._events(container_id, request, io, scope, stdin=stdin, capture=capture)

    def launch(
        self, container_id: str, request: ExecRequest, blocking: Blocking, scope: str | None = None
    ) -> AsyncGenerator[ExecEvent, None]:
        """``stream`` of a command handed to the sandbox's waiter (``core.launch``) instead of
        a Docker exec: the same events, caps, timeout and kill. Only for a sandbox labelled
        with the launcher whose waiter has had no line yet, and a request ``can_launch``."""
        nonce = new_nonce()
        launched: list[Launched] = []

        async def create(container: str, request: ExecRequest, streamed: bool) -> str:
            return container

        async def start(container: str, stdin: bytes | StdinSource) -> AsyncExecAttachment:
            assert isinstance(stdin, bytes)  # a run's stdin is in its request
            line = launch_line(request, nonce)
            launched.append(Launched(await self._api.launch_async(container, line + stdin), nonce))
            return launched[0]

        async def inspect(container: str) -> ExecState:
            return launched[0].state()

        io = _Io(blocking, self._asleep, create, start, inspect, launched=True)
        return self._events(container_id, request, io, scope)

    async def _events(
        self,
        container_id: str,
        request: ExecRequest,
        io: _Io,
        scope: str | None,
        *,
        stdin: StdinSource | None = None,
        capture: Capture | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        run = await self._begin(container_id, request, scope, stdin is not None, io)
        capture = capture or OutputCapture(request.output_cap)
        # A re-run is only for a command that never ran, whose stdin can be given again.
        retries = list(PAUSED_RETRIES) if stdin is None and not io.launched else []
        while True:
            attachment = await io.start(run.exec_id, request.stdin if stdin is None else stdin)
            # The output so far, while it may be the runtime's refusal to start the command.
            held: list[StreamChunk] | None = [] if retries else None
            looked: float | None = None  # when the held output began to look like one
            try:
                while (chunks := await self._output(run, attachment, io)) is not None:
                    if held is not None:
                        held.extend(chunks)
                        keep, looked = await self._keep_held(run, io, held, looked)
                        if keep:
                            continue
                        chunks, held = held, None
                    for chunk in chunks:
                        if (kept := capture.add(chunk)) is not None:
                            yield kept
                run.finished = True
            finally:
                attachment.close()
                if not run.finished:  # shielded: a caller cancelled again still gets the kill
                    await asyncio.shield(self._kill(run, "its stream was abandoned", io))
            if held and is_paused_refusal(held) and await self._refused(run, io):
                # The runtime refused the exec while the scope was frozen for a moment
                # (another exec's kill, host.procs): the command never ran, so run it again.
                log.info("exec %s met its sandbox frozen: running it again", run.exec_id)
                await io.pause(retries.pop(0))
                run = await self._begin(
                    container_id,
                    request,
                    scope,
                    False,
                    io,
                    started=run.started,
                    deadline=run.deadline,
                )
                continue
            for out in held or ():
                if (kept := capture.add(out)) is not None:
                    yield kept
            break
        yield await self._finish(run, capture, io)

    async def _keep_held(
        self, run: _Run, io: _Io, held: list[StreamChunk], looked: float | None
    ) -> tuple[bool, float | None]:
        """Whether output held while it may be the runtime's refusal stays held, and since when
        it has looked like one: with nothing yet, however long the start takes; with what looks
        like one, for ``REFUSAL_WAIT``, then until the backend says the command runs."""
        if not held:
            return True, looked
        if not may_be_paused_refusal(held):
            return False, looked
        looked = self._clock() if looked is None else looked
        if self._clock() - looked < REFUSAL_WAIT:
            return True, looked
        return not (await self._inspect(run, io)).running, looked

    async def _refused(self, run: _Run, io: _Io) -> bool:
        """Whether the exec ended without starting (runc's start failure), not yet timed out."""
        if run.timed_out or self._clock() >= run.deadline:
            return False
        state = await self._inspect(run, io)
        return not state.running and state.exit_code in {START_FAILED, PODMAN_EXEC_FAILED}

    async def _begin(
        self,
        container_id: str,
        request: ExecRequest,
        scope: str | None,
        streamed: bool,
        io: _Io,
        *,
        started: float | None = None,
        deadline: float | None = None,
    ) -> _Run:
        """A new exec, created; ``started``/``deadline``: an earlier attempt's, kept by a re-run."""
        where = functools.partial(self._where, container_id, scope)
        cgroup, oom_before, since = await io.call(where)
        exec_id = await io.create(container_id, request, streamed)
        if started is None or deadline is None:
            started = self._clock()
            deadline = started + request.timeout
        return _Run(
            exec_id, cgroup, oom_before=oom_before, since=since, started=started, deadline=deadline
        )

    def _where(self, container_id: str, scope: str | None) -> tuple[Path | None, int | None, int]:
        """The sandbox's cgroup, its OOM count and the process clock, before the exec."""
        if not self._api.has_host(container_id):
            return None, None, self._host.process_clock()  # remote: nothing of it here
        if scope is None:
            cgroup = self._host.cgroup_of(self._api.sandbox_pid(container_id))
        else:  # a container that is not running fails its exec create just the same
            cgroup = self._host.cgroup_at(scope)
        return cgroup, self._host.oom_kills(cgroup), self._host.process_clock()

    async def _finish(self, run: _Run, capture: Capture, io: _Io) -> ExecResult:
        exit_code = await self._exit_code(run, io)  # first: it may time the run out
        oom_after = None
        if run.cgroup is not None:
            oom_after = await io.call(functools.partial(self._host.oom_kills, run.cgroup))
        result = capture.result(
            exit_code=exit_code,
            timed_out=run.timed_out or run.verdict == "timeout",
            oom_killed=_grew(run.oom_before, oom_after) or run.verdict == "oom",
            duration=self._clock() - run.started,
        )
        return explain_start_failure(result)

    async def _output(
        self, run: _Run, attachment: AsyncExecAttachment, io: _Io
    ) -> list[StreamChunk] | None:
        """The next read's output; None once the stream has ended, or stays open past the
        kill's grace. At the deadline the exec is killed first."""
        while (remaining := run.deadline - self._clock()) <= 0:
            if run.timed_out:
                log.warning(
                    "exec %s: stream still open %ss after the kill", run.exec_id, KILL_GRACE
                )
                return None
            await self._time_out(run, io)
        return await attachment.read(min(remaining, POLL))

    async def _time_out(self, run: _Run, io: _Io) -> None:
        run.timed_out = True
        await self._kill(run, "it timed out", io)
        run.deadline = self._clock() + KILL_GRACE

    async def _kill(self, run: _Run, why: str, io: _Io) -> None:
        if io.launched and run.cgroup is not None:
            killed = await io.call(functools.partial(self._host.kill_since, run.cgroup, run.since))
            log.info("run %s killed (%s processes) because %s", run.exec_id, killed, why)
            return
        if io.kill is not None and await io.kill(run.exec_id):
            log.info("exec %s stopped because %s", run.exec_id, why)
            return
        if run.cgroup is None:
            log.warning("exec %s could not be killed (%s): its backend did not", run.exec_id, why)
            return
        pid = await self._exec_pid(run, io)
        kill = functools.partial(self._host.kill_exec, run.cgroup, pid, run.since)
        killed = await io.call(kill) if pid > 0 else 0
        log.info("exec %s killed (%s processes) because %s", run.exec_id, killed, why)

    async def _exec_pid(self, run: _Run, io: _Io) -> int:
        """The exec's host pid; Docker reports 0 until the exec has started, so wait for it."""
        give_up = self._clock() + KILL_GRACE
        state = await self._inspect(run, io)
        while state.pid == 0 and state.exit_code is None and self._clock() < give_up:
            await io.pause(0.05)
            state = await self._inspect(run, io)
        return state.pid

    async def _exit_code(self, run: _Run, io: _Io) -> int:
        """The exit code once Docker has it; a command that closed its output but runs on past
        the deadline is timed out like any other."""
        if run.timed_out:
            return TIMEOUT_EXIT_CODE
        state = await self._inspect(run, io)
        while state.running and self._clock() < run.deadline:
            await io.pause(EXIT_POLL)
            state = await self._inspect(run, io)
        if state.running:
            await self._time_out(run, io)
            return TIMEOUT_EXIT_CODE
        if state.exit_code is None:
            log.warning("exec %s: no exit code from Docker", run.exec_id)
            return -1
        run.verdict = state.verdict
        return state.exit_code

    async def _inspect(self, run: _Run, io: _Io) -> ExecState:
        return await io.inspect(run.exec_id)


async def result_of(events: AsyncGenerator[ExecEvent, None]) -> ExecResult:
    """An exec's result, its stream read to the end (its output left to whoever yields it)."""
    result: ExecResult | None = None
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, ExecResult):
                result = event
    if result is None:  # pragma: no cover - the engine always ends with its result
        raise SliceboxError("the exec stream ended without a result")
    return result


def _grew(before: int | None, after: int | None) -> bool:
    return before is not None and after is not None and after > before
