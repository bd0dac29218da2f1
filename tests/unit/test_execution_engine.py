"""The exec engine's logic against fakes: caps, streaming, timeout, OOM verdict, exit codes.

Each behaviour is checked both ways the engine runs one exec: in the calling thread
(``stream``/``run``, as the guest tests and the bench use it) and on an event loop with its
blocking steps on a pool (``astream``, as the agent uses it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from typing import Protocol, TypeVar

import pytest

from slicebox.backends.base import StdinSource
from slicebox.core.blocking import Blocking, from_thread
from slicebox.core.execoutput import OutputCapture
from slicebox.core.execution import KILL_GRACE, PAUSED_RETRIES, REFUSAL_WAIT, ExecEngine
from slicebox.model.errors import SandboxNotFound
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult, OutputStream, StreamChunk
from tests.fakes.exec_fakes import FakeClock, FakeExec, FakeExecApi, FakeSandboxHost

OUT, ERR = OutputStream.STDOUT, OutputStream.STDERR
T = TypeVar("T")


class Way(Protocol):
    def __call__(
        self, engine: ExecEngine, req: ExecRequest, container: str = "box"
    ) -> list[ExecEvent]: ...


def chunk(stream: OutputStream, data: bytes) -> StreamChunk:
    return StreamChunk(stream=stream, data=data)


def make(run: FakeExec, host: FakeSandboxHost | None = None) -> tuple[ExecEngine, FakeExecApi]:
    clock = FakeClock()
    api = FakeExecApi(clock, host or FakeSandboxHost(), run)
    engine = ExecEngine(api, api.host, clock=clock, asleep=clock.asleep)
    return engine, api


def request(**fields: object) -> ExecRequest:
    return ExecRequest.parse({"argv": ["cmd"], **fields})


def in_thread(engine: ExecEngine, req: ExecRequest, container: str = "box") -> list[ExecEvent]:
    """The events as a worker thread sees them (``from_thread``, as ``ExecEngine.run``)."""

    async def events(blocking: Blocking) -> list[ExecEvent]:
        return [e async for e in engine.stream(container, req, blocking)]

    return from_thread(events)


def on_loop(engine: ExecEngine, req: ExecRequest, container: str = "box") -> list[ExecEvent]:
    async def main() -> list[ExecEvent]:
        async with pooled() as blocking:
            return [e async for e in engine.stream(container, req, blocking)]

    return asyncio.run(main())


@asynccontextmanager
async def pooled() -> AsyncIterator[Blocking]:
    """A Blocking on a pool of its own, as the agent's calls pool is."""
    with ThreadPoolExecutor(2) as pool:
        loop = asyncio.get_running_loop()

        async def blocking(function: Callable[[], T]) -> T:
            return await loop.run_in_executor(pool, function)

        yield blocking


@pytest.fixture(params=[in_thread, on_loop], ids=["in-thread", "on-loop"])
def way(request: pytest.FixtureRequest) -> Way:
    chosen: Way = request.param
    return chosen


def result_of(events: list[ExecEvent]) -> ExecResult:
    assert isinstance(events[-1], ExecResult)
    return events[-1]


def test_output_and_exit_code_pass_through_with_stdin(way: Way) -> None:
    run = FakeExec([[chunk(OUT, b"a"), chunk(ERR, b"b")], [chunk(OUT, b"c")], None], exit_code=7)
    engine, _ = make(run)
    result = result_of(way(engine, request(stdin=b"hi")))
    assert (result.stdout, result.stderr, result.exit_code) == (b"ac", b"b", 7)
    assert not result.timed_out
    assert not result.stdout_truncated
    assert run.stdin == b"hi"
    assert run.closed


def test_each_stream_keeps_its_head_and_counts_what_it_drops(way: Way) -> None:
    run = FakeExec([[chunk(OUT, b"12345"), chunk(ERR, b"xy")], [chunk(OUT, b"678")], None])
    engine, _ = make(run)
    events = way(engine, request(output_cap=4))
    result = result_of(events)
    assert events[:-1] == [chunk(OUT, b"1234"), chunk(ERR, b"xy")]
    assert (result.stdout, result.stdout_truncated, result.stdout_dropped_bytes) == (
        b"1234",
        True,
        4,
    )
    assert (result.stderr, result.stderr_truncated, result.stderr_dropped_bytes) == (
        b"xy",
        False,
        0,
    )


def test_capture_holds_at_most_the_cap_whatever_arrives() -> None:
    capture = OutputCapture(10)
    for _ in range(1000):
        capture.add(chunk(OUT, b"z" * 1000))
    result = capture.result(exit_code=0, timed_out=False, oom_killed=False, duration=1.0)
    assert result.stdout == b"z" * 10
    assert result.stdout_dropped_bytes == 1_000_000 - 10


def test_timeout_kills_the_exec_tree_and_answers_124(way: Way) -> None:
    host = FakeSandboxHost(procs={100: 0, 101: 100})
    run = FakeExec([[chunk(OUT, b"started")]], pid=4242)
    host.procs[4243] = 4242  # a child of the exec
    engine, _ = make(run, host)
    result = result_of(way(engine, request(timeout=2)))
    assert (result.exit_code, result.timed_out) == (124, True)
    assert result.stdout == b"started"
    assert host.kill_calls == [4242]
    assert host.procs == {100: 0, 101: 100}, "the sandbox's own processes survive"
    assert 2 <= result.duration < 3


def test_timeout_waits_for_docker_to_report_the_exec_pid(way: Way) -> None:
    host = FakeSandboxHost(procs={100: 0})
    run = FakeExec([], pid=77, pid_after_inspects=3)
    engine, _ = make(run, host)
    result = result_of(way(engine, request(timeout=1)))
    assert result.timed_out
    assert host.kill_calls == [77]


def test_a_stream_that_stays_open_after_the_kill_is_given_up(way: Way) -> None:
    host = FakeSandboxHost(procs={100: 0})
    run = FakeExec([], pid=55)
    engine, _ = make(run, host)
    host.kill_exec = lambda cgroup, pid, since: 0  # type: ignore[method-assign]
    result = result_of(way(engine, request(timeout=1)))
    assert result.timed_out
    assert result.duration == pytest.approx(1 + KILL_GRACE, abs=1)


def test_oom_killed_when_the_sandbox_counter_grew_during_the_exec(way: Way) -> None:
    host = FakeSandboxHost(oom_kill_count=3, oom_kills_during_exec=1)
    engine, _ = make(FakeExec([None], exit_code=137), host)
    assert result_of(way(engine, request())).oom_killed


@pytest.mark.parametrize(("count", "during"), [(3, 0), (None, 1)])
def test_not_oom_killed_when_the_counter_is_unchanged_or_unreadable(
    way: Way, count: int | None, during: int
) -> None:
    host = FakeSandboxHost(oom_kill_count=count, oom_kills_during_exec=during)
    engine, _ = make(FakeExec([None]), host)
    assert not result_of(way(engine, request())).oom_killed


def test_exit_code_waits_until_docker_marks_the_exec_finished(way: Way) -> None:
    engine, _ = make(FakeExec([None], exit_code=3, running_after_exit=4))
    assert result_of(way(engine, request())).exit_code == 3


def test_a_command_running_on_after_closing_its_output_times_out(way: Way) -> None:
    host = FakeSandboxHost(procs={100: 0})
    run = FakeExec([[chunk(OUT, b"bye")], None], pid=8, exits_at_eof=False)
    engine, _ = make(run, host)
    result = result_of(way(engine, request(timeout=3)))
    assert (result.exit_code, result.timed_out, result.stdout) == (124, True, b"bye")
    assert host.kill_calls == [8]
    assert 3 <= result.duration < 4


OCI = b'OCI runtime exec failed: exec failed: unable to start container process: exec: "nope": '


@pytest.mark.parametrize(
    ("stdout", "code", "explained"),
    [
        (OCI + b"executable file not found in $PATH: unknown\r\n", 126, 127),
        (b'OCI runtime exec failed: chdir to cwd ("/x") failed: unknown\r\n', 126, 126),
        (b"OCI runtime exec failed, says my program", 1, None),
        (b"plain output", 126, None),
    ],
)
def test_start_failures_are_moved_to_stderr(
    way: Way, stdout: bytes, code: int, explained: int | None
) -> None:
    run = FakeExec([[chunk(OUT, stdout)], None], exit_code=code)
    engine, _ = make(run)
    result = result_of(way(engine, request()))
    if explained is None:
        assert (result.stdout, result.exit_code) == (stdout, code)
    else:
        assert (result.stdout, result.exit_code) == (b"", explained)
        assert result.stderr == stdout.replace(b"\r\n", b"\n")


PAUSED = (
    b"OCI runtime exec failed: exec failed: cannot exec in a paused container "
    b"(use --ignore-paused to override): unknown\r\n"
)


PODMAN_PAUSED = [
    b"Error: runc: exec failed: cannot exec in a paused container (use --ignore-paused to "
    b"override): OCI runtime error\n",
    b"Error: read unixpacket @->/proc/self/fd/13/attach: read: connection reset by peer\n",
]


class FrozenAtFirst(FakeExecApi):
    """An engine's API as it answers while another exec's kill has the scope frozen for a
    moment: the first ``refusals`` execs never start (runc's refusal: through Docker on stdout
    with 126, through Podman on stderr with 125)."""

    def __init__(
        self,
        clock: FakeClock,
        run: FakeExec,
        refusals: int,
        podman: bool,
        late: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(clock, FakeSandboxHost(), run)
        self.wanted = run
        self.refusals = refusals
        self.podman = podman
        self.late = late  # silent reads before the refusal, and between it and the stream's end
        self.created = 0

    def make_exec(
        self, container_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        self.created += 1
        if self.created > self.refusals:
            self.run = self.wanted
        else:
            said = (
                [[chunk(ERR, line)] for line in PODMAN_PAUSED]
                if self.podman
                else [[chunk(OUT, PAUSED)]]
            )
            before, after = self.late
            self.run = FakeExec(
                [*said, *[[]] * after, None],
                exit_code=125 if self.podman else 126,
                pid=90 + self.created,
                silent_reads=before,
                never_starts=True,
            )
        super().make_exec(container_id, request, streamed_stdin)
        return f"exec-{self.created}"


def frozen_at_first(
    run: FakeExec, refusals: int, podman: bool = False, late: tuple[int, int] = (0, 0)
) -> tuple[ExecEngine, FrozenAtFirst]:
    clock = FakeClock()
    api = FrozenAtFirst(clock, run, refusals, podman, late)
    return ExecEngine(api, api.host, clock=clock, asleep=clock.asleep), api


@pytest.mark.parametrize("podman", [False, True], ids=["docker", "podman"])
def test_an_exec_refused_by_a_moment_s_freeze_runs_again_and_its_refusal_is_never_seen(
    way: Way, podman: bool
) -> None:
    """A kill freezes the sandbox's scope for milliseconds (host.procs); runc refuses an exec
    of the same sandbox starting then. The command never ran, so the engine runs it again: the
    caller sees only its real output, stdin given whole each time."""
    run = FakeExec([[chunk(OUT, b"real")], None], exit_code=0)
    engine, api = frozen_at_first(run, refusals=2, podman=podman)
    events = way(engine, request(stdin=b"in"))
    assert [e for e in events if isinstance(e, StreamChunk)] == [chunk(OUT, b"real")]
    result = result_of(events)
    assert (result.stdout, result.stderr, result.exit_code) == (b"real", b"", 0)
    assert (api.created, run.stdin) == (3, b"in")


@pytest.mark.parametrize("podman", [False, True], ids=["docker", "podman"])
@pytest.mark.parametrize(
    "late", [(20, 0), (0, 10), (4, 30)], ids=["refused-late", "ends-late", "both"]
)
def test_a_refusal_that_comes_late_on_a_busy_host_is_still_run_again(
    way: Way, podman: bool, late: tuple[int, int]
) -> None:
    """On a busy host the runtime may take many seconds to refuse, and as many again to end the
    stream after its words (a CI guest on one emulated CPU under five users' load): the refusal
    is known for what it is however late it comes, never streamed as the command's output.
    Before, the engine held output only for the first two seconds after the start."""
    run = FakeExec([[chunk(OUT, b"real")], None], exit_code=0)
    engine, api = frozen_at_first(run, refusals=2, podman=podman, late=late)
    events = way(engine, request(timeout=120))  # two late refusals take up to 34 s
    assert [e for e in events if isinstance(e, StreamChunk)] == [chunk(OUT, b"real")]
    result = result_of(events)
    assert (result.stdout, result.stderr, result.exit_code) == (b"real", b"", 0)
    assert api.created == 3


def test_a_sandbox_that_stays_paused_answers_runc_s_refusal_after_a_few_tries(way: Way) -> None:
    """A sandbox paused on purpose (docker pause) stays so: after the bounded re-runs the
    caller gets runc's words, moved to stderr as any start failure."""
    engine, api = frozen_at_first(FakeExec([None]), refusals=100)
    result = result_of(way(engine, request()))
    assert (result.exit_code, result.stdout, result.stderr) == (
        126,
        b"",
        PAUSED.replace(b"\r\n", b"\n"),
    )
    assert api.created == 1 + len(PAUSED_RETRIES)


@pytest.mark.parametrize(
    ("said", "code"),
    [
        # runc's words, then the command's own
        ([[chunk(OUT, PAUSED)], [chunk(OUT, b"more")]], 126),
        ([[chunk(OUT, PAUSED)], [chunk(ERR, b"more")]], 126),
        # a command's own "Error: " lines, and its own exit code
        ([[chunk(ERR, b"Error: no such thing\n")]], 1),
        ([[chunk(ERR, PODMAN_PAUSED[0])], [chunk(ERR, b"and my own line\n")]], 125),
    ],
)
def test_output_that_only_looks_like_the_refusal_is_not_run_again(
    way: Way, said: list[list[StreamChunk]], code: int
) -> None:
    run = FakeExec([*said, None], exit_code=code)
    engine, api = frozen_at_first(run, refusals=0)
    events = way(engine, request())
    assert [e for e in events if isinstance(e, StreamChunk)] == [c for cs in said for c in cs]
    assert (api.created, result_of(events).exit_code) == (1, code)


def test_output_held_as_a_possible_refusal_is_let_go_within_the_wait() -> None:
    """A command whose first line looks like Podman's refusal and then runs on silent: the line
    is streamed once REFUSAL_WAIT has passed, not at its end."""
    run = FakeExec([[chunk(ERR, b"Error: retrying\n")]], exit_code=0, exits_at_eof=False)
    engine, api = make(run)
    started = api.clock.now
    seen: list[float] = []

    async def main() -> None:
        async with pooled() as blocking:
            events = engine.stream("box", request(timeout=30), blocking)
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, StreamChunk):
                        seen.append(api.clock.now - started)
                        return

    asyncio.run(main())
    assert len(seen) == 1
    assert REFUSAL_WAIT <= seen[0] <= REFUSAL_WAIT + 1


PODMAN = b"Error: runc: exec failed: unable to start container process: "
PODMAN_TAIL = b": OCI runtime attempted to invoke a command that was not found\n"


@pytest.mark.parametrize(
    ("stderr", "explained"),
    [
        # Podman says 127 for both; a cwd that is not there is 126 as under Docker.
        (
            PODMAN + b'chdir to cwd ("/x") set in config.json failed: no such file' + PODMAN_TAIL,
            126,
        ),
        (b"Error: crun: chdir to `/x`: No such file or directory" + PODMAN_TAIL, 126),
        (PODMAN + b'exec: "nope": executable file not found in $PATH' + PODMAN_TAIL, 127),
        (b"Error: chdir to my dir failed, says my program\n", 127),
    ],
)
def test_podman_s_start_failures_answer_as_docker_s(
    way: Way, stderr: bytes, explained: int
) -> None:
    run = FakeExec([[chunk(ERR, stderr)], None], exit_code=127)
    engine, _ = make(run)
    result = result_of(way(engine, request()))
    assert (result.stdout, result.stderr, result.exit_code) == (b"", stderr, explained)


def test_unknown_sandbox_is_not_found(way: Way) -> None:
    engine, _ = make(FakeExec([None]))
    with pytest.raises(SandboxNotFound):
        way(engine, request(), "nope")


def test_run_answers_the_result_in_the_calling_thread() -> None:
    engine, _ = make(FakeExec([[chunk(ERR, b"e")], None], exit_code=1))
    result = engine.run("box", request())
    assert (result.stderr, result.exit_code) == (b"e", 1)


# --- leaving early ---------------------------------------------------------------------------


def endless(pid: int) -> tuple[ExecEngine, FakeExec, FakeSandboxHost]:
    """An exec that prints a chunk per read until it is killed."""
    host = FakeSandboxHost(procs={100: 0, pid: 100})
    run = FakeExec([[chunk(OUT, b"y")]] * 1000, pid=pid)
    engine, _ = make(run, host)
    return engine, run, host


def test_abandoning_the_stream_kills_the_exec() -> None:
    engine, run, host = endless(9)

    async def first(blocking: Blocking) -> ExecEvent:
        events = engine.stream("box", request(), blocking)
        event = await anext(events)
        await events.aclose()
        return event

    assert from_thread(first) == chunk(OUT, b"y")
    assert host.kill_calls == [9]
    assert run.closed


def test_closing_the_async_stream_kills_the_exec() -> None:
    engine, run, host = endless(9)

    async def main() -> None:
        async with pooled() as blocking:
            events = engine.stream("box", request(), blocking)
            assert await anext(events) == chunk(OUT, b"y")
            await events.aclose()

    asyncio.run(main())
    assert host.kill_calls == [9]
    assert run.closed
    assert 9 not in host.procs


def test_cancelling_the_reader_of_the_async_stream_kills_the_exec() -> None:
    """The agent stopping cancels what still reads an exec: its processes are killed too."""
    engine, run, host = endless(10)

    async def main() -> None:
        async with pooled() as blocking:
            began = asyncio.Event()

            async def read() -> None:
                async with aclosing(engine.stream("box", request(), blocking)) as events:
                    async for _ in events:
                        began.set()

            task = asyncio.create_task(read())
            await began.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert host.kill_calls == [10]
    assert run.closed


# --- on a real clock: the loop is free while an exec waits -----------------------------------


class SilentAttachment:
    """Output that never comes, waited for in real time until the exec's process is killed."""

    def __init__(self, run: FakeExec, host: FakeSandboxHost) -> None:
        self._run, self._host = run, host

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        if self._run.pid not in self._host.procs:
            return None
        await asyncio.sleep(timeout)
        return []

    def close(self) -> None:
        self._run.closed = True


class SilentExecs(FakeExecApi):
    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> SilentAttachment:
        self.attach_run(exec_id, b"")
        return SilentAttachment(self.run, self.host)


def test_an_exec_that_waits_holds_no_thread_and_times_out_on_the_real_clock() -> None:
    host = FakeSandboxHost(procs={100: 0})
    run = FakeExec([], pid=31)
    engine = ExecEngine(SilentExecs(FakeClock(), host, run), host)  # time.monotonic

    async def main() -> tuple[ExecResult, float, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        async with pooled() as blocking:
            began = time.monotonic()
            events = [e async for e in engine.stream("box", request(timeout=0.3), blocking)]
            took = time.monotonic() - began
        ticker.cancel()
        return result_of(events), took, ticks

    result, took, ticks = asyncio.run(main())
    assert (result.exit_code, result.timed_out) == (124, True)
    assert host.kill_calls == [31]
    assert 0.3 <= took < 2
    assert ticks >= 10, "the loop ran other tasks while the exec waited"
