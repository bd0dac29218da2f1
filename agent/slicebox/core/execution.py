"""Exec in a sandbox: the request, the result, and the engine that runs one exec.

The engine talks to the world through three small interfaces, so its logic (caps, the timeout,
the OOM verdict) is tested with fakes and proved in the guest with the real ones:

- ``ExecApi``: the backend's exec primitives (:mod:`slicebox.backends.base`; the Docker
  backend's read the output off the daemon's socket).
- ``ExecAttachment``: one exec's attached output stream, already demultiplexed.
- ``SandboxHost``: the sandbox's scope cgroup and its processes (``host.procs.CgroupHost``).

What is kept of an output stream: its head. The first ``output_cap`` bytes of each stream are
kept (and streamed); the rest is read and dropped, so the command never blocks on a full pipe,
and ``<stream>_dropped_bytes`` counts what was dropped. Memory is bounded by two caps plus one
read buffer whatever the command prints.

Docker cannot kill an exec. On timeout the engine asks the host to kill the exec's processes
(found from its host pid in exec inspect: its session and descendants, inside the sandbox's
cgroup only, none older than the exec) and answers once none is left, orphans and a fork bomb
included; the sandbox itself survives, and the result says ``timed_out`` with exit code 124.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from slicebox.backends.base import ExecApi, ExecAttachment
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import (
    TIMEOUT_EXIT_CODE,
    ExecEvent,
    ExecRequest,
    ExecResult,
    OutputStream,
    StreamChunk,
)

log = logging.getLogger(__name__)

# After the kill, how long the stream may take to end: the pipe closes when the killed processes
# are gone, unless a detached process (its own session) still holds it.
KILL_GRACE = 5.0
POLL = 0.5
EXIT_POLL = 0.02
START_FAILED = 126
NOT_FOUND_EXIT_CODE = 127
OCI_START_FAILURE = b"OCI runtime exec failed"


class SandboxHost(Protocol):
    def cgroup_of(self, pid: int) -> Path:
        """The cgroup directory the process is in: for a container's init, its scope."""

    def oom_kills(self, cgroup: Path) -> int | None:
        """memory.events oom_kill of the cgroup; None when it cannot be read."""

    def process_clock(self) -> int:
        """Now, on the clock of process start times: taken before an exec starts, it tells the
        exec's processes from older ones."""

    def kill_exec(self, cgroup: Path, pid: int, since: int) -> int:
        """SIGKILL the processes of exec ``pid`` (begun at ``since``) inside ``cgroup``: its
        session and descendants, orphans included, until none is left, however fast they fork;
        return how many processes were killed."""


class OutputCapture:
    """Keeps the head of each stream up to the cap and counts what it drops."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._kept = {stream: bytearray() for stream in OutputStream}
        self._dropped = dict.fromkeys(OutputStream, 0)

    def add(self, chunk: StreamChunk) -> StreamChunk | None:
        """Record a chunk; return the part that is kept (None if nothing is)."""
        kept = self._kept[chunk.stream]
        room = max(self._cap - len(kept), 0)
        head = chunk.data[:room]
        kept += head
        self._dropped[chunk.stream] += len(chunk.data) - len(head)
        return StreamChunk(stream=chunk.stream, data=head) if head else None

    def result(
        self, *, exit_code: int, timed_out: bool, oom_killed: bool, duration: float
    ) -> ExecResult:
        out, err = OutputStream.STDOUT, OutputStream.STDERR
        return ExecResult(
            stdout=bytes(self._kept[out]),
            stderr=bytes(self._kept[err]),
            exit_code=exit_code,
            timed_out=timed_out,
            oom_killed=oom_killed,
            stdout_truncated=self._dropped[out] > 0,
            stderr_truncated=self._dropped[err] > 0,
            stdout_dropped_bytes=self._dropped[out],
            stderr_dropped_bytes=self._dropped[err],
            duration=duration,
        )


@dataclass
class _Run:
    """The state of one exec while its output is pumped."""

    exec_id: str
    cgroup: Path
    oom_before: int | None
    since: int  # the host's process clock before the exec was created
    started: float
    deadline: float
    timed_out: bool = False
    finished: bool = False


class ExecEngine:
    """Runs execs in sandboxes (containers) through the interfaces above."""

    def __init__(
        self,
        api: ExecApi,
        host: SandboxHost,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._api = api
        self._host = host
        self._clock = clock
        self._sleep = sleep

    def run(self, container_id: str, request: ExecRequest) -> ExecResult:
        """Run to the end and return the result (the stream's last event)."""
        for event in self.stream(container_id, request):
            if isinstance(event, ExecResult):
                return event
        raise SliceboxError("the exec stream ended without a result")  # pragma: no cover

    def stream(self, container_id: str, request: ExecRequest) -> Generator[ExecEvent, None, None]:
        """Yield kept output chunks as they are produced, then the ExecResult.

        Closing the iterator early kills the exec's processes: nobody is left to read them.
        """
        run = self._begin(container_id, request)
        capture = OutputCapture(request.output_cap)
        attachment = self._api.exec_start(run.exec_id, request.stdin)
        try:
            for chunk in self._pump(run, attachment):
                if (kept := capture.add(chunk)) is not None:
                    yield kept
            run.finished = True
        finally:
            attachment.close()
            if not run.finished:
                self._kill(run, "its stream was abandoned")
        yield self._finish(run, capture)

    def _begin(self, container_id: str, request: ExecRequest) -> _Run:
        cgroup = self._host.cgroup_of(self._api.sandbox_pid(container_id))
        oom_before = self._host.oom_kills(cgroup)
        since = self._host.process_clock()
        exec_id = self._api.exec_create(container_id, request)
        started = self._clock()
        return _Run(exec_id, cgroup, oom_before, since, started, started + request.timeout)

    def _finish(self, run: _Run, capture: OutputCapture) -> ExecResult:
        exit_code = self._exit_code(run)  # first: it may time the run out
        result = capture.result(
            exit_code=exit_code,
            timed_out=run.timed_out,
            oom_killed=_grew(run.oom_before, self._host.oom_kills(run.cgroup)),
            duration=self._clock() - run.started,
        )
        return explain_start_failure(result)

    async def astream(self, container_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        """``stream`` for asyncio callers: each blocking read runs in a worker thread."""
        events = self.stream(container_id, request)
        try:
            while (event := await asyncio.to_thread(next, events, None)) is not None:
                yield event
        finally:
            events.close()

    def _pump(self, run: _Run, attachment: ExecAttachment) -> Iterator[StreamChunk]:
        while True:
            remaining = run.deadline - self._clock()
            if remaining <= 0:
                if run.timed_out:
                    log.warning(
                        "exec %s: stream still open %ss after the kill", run.exec_id, KILL_GRACE
                    )
                    return
                self._time_out(run)
                continue
            chunks = attachment.read(min(remaining, POLL))
            if chunks is None:
                return
            yield from chunks

    def _time_out(self, run: _Run) -> None:
        run.timed_out = True
        self._kill(run, "it timed out")
        run.deadline = self._clock() + KILL_GRACE

    def _kill(self, run: _Run, why: str) -> None:
        pid = self._exec_pid(run)
        killed = self._host.kill_exec(run.cgroup, pid, run.since) if pid > 0 else 0
        log.info("exec %s killed (%s processes) because %s", run.exec_id, killed, why)

    def _exec_pid(self, run: _Run) -> int:
        """The exec's host pid; Docker reports 0 until the exec has started, so wait for it."""
        give_up = self._clock() + KILL_GRACE
        state = self._api.exec_inspect(run.exec_id)
        while state.pid == 0 and state.exit_code is None and self._clock() < give_up:
            self._sleep(0.05)
            state = self._api.exec_inspect(run.exec_id)
        return state.pid

    def _exit_code(self, run: _Run) -> int:
        """The exit code once Docker has it; a command that closed its output but runs on past
        the deadline is timed out like any other."""
        if run.timed_out:
            return TIMEOUT_EXIT_CODE
        state = self._api.exec_inspect(run.exec_id)
        while state.running and self._clock() < run.deadline:
            self._sleep(EXIT_POLL)
            state = self._api.exec_inspect(run.exec_id)
        if state.running:
            self._time_out(run)
            return TIMEOUT_EXIT_CODE
        if state.exit_code is None:
            log.warning("exec %s: no exit code from Docker", run.exec_id)
            return -1
        return state.exit_code


def explain_start_failure(result: ExecResult) -> ExecResult:
    """Docker reports a command that could not start (no such program, no such cwd) as exit
    code 126 with runc's message on stdout; move the message to stderr, and answer 127 for a
    missing program, as a shell would."""
    if result.exit_code != START_FAILED or not result.stdout.startswith(OCI_START_FAILURE):
        return result
    missing = b"executable file not found" in result.stdout
    return result.model_copy(
        update={
            "stdout": b"",
            "stderr": result.stderr + result.stdout.replace(b"\r\n", b"\n"),
            "exit_code": NOT_FOUND_EXIT_CODE if missing else START_FAILED,
        }
    )


def _grew(before: int | None, after: int | None) -> bool:
    return before is not None and after is not None and after > before
