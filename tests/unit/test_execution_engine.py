"""The exec engine's logic against fakes: caps, streaming, timeout, OOM verdict, exit codes."""

from __future__ import annotations

import asyncio

import pytest

from slicebox.core.execution import KILL_GRACE, ExecEngine, OutputCapture
from slicebox.model.errors import SandboxNotFound
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult, OutputStream, StreamChunk
from tests.fakes.exec_fakes import FakeClock, FakeExec, FakeExecApi, FakeSandboxHost

OUT, ERR = OutputStream.STDOUT, OutputStream.STDERR


def chunk(stream: OutputStream, data: bytes) -> StreamChunk:
    return StreamChunk(stream=stream, data=data)


def make(run: FakeExec, host: FakeSandboxHost | None = None) -> tuple[ExecEngine, FakeExecApi]:
    clock = FakeClock()
    api = FakeExecApi(clock, host or FakeSandboxHost(), run)
    return ExecEngine(api, api.host, clock=clock, sleep=clock.sleep), api


def request(**fields: object) -> ExecRequest:
    return ExecRequest.parse({"argv": ["cmd"], **fields})


def test_output_and_exit_code_pass_through_with_stdin() -> None:
    run = FakeExec([[chunk(OUT, b"a"), chunk(ERR, b"b")], [chunk(OUT, b"c")], None], exit_code=7)
    engine, _ = make(run)
    result = engine.run("box", request(stdin=b"hi"))
    assert (result.stdout, result.stderr, result.exit_code) == (b"ac", b"b", 7)
    assert not result.timed_out
    assert not result.stdout_truncated
    assert run.stdin == b"hi"
    assert run.closed


def test_each_stream_keeps_its_head_and_counts_what_it_drops() -> None:
    run = FakeExec([[chunk(OUT, b"12345"), chunk(ERR, b"xy")], [chunk(OUT, b"678")], None])
    engine, _ = make(run)
    events = list(engine.stream("box", request(output_cap=4)))
    result = events[-1]
    assert isinstance(result, ExecResult)
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


def test_timeout_kills_the_exec_tree_and_answers_124() -> None:
    host = FakeSandboxHost(procs={100: 0, 101: 100})
    run = FakeExec([[chunk(OUT, b"started")]], pid=4242)
    host.procs[4243] = 4242  # a child of the exec
    engine, _ = make(run, host)
    result = engine.run("box", request(timeout=2))
    assert (result.exit_code, result.timed_out) == (124, True)
    assert result.stdout == b"started"
    assert host.kill_calls == [4242]
    assert host.procs == {100: 0, 101: 100}, "the sandbox's own processes survive"
    assert 2 <= result.duration < 3


def test_timeout_waits_for_docker_to_report_the_exec_pid() -> None:
    host = FakeSandboxHost(procs={100: 0})
    run = FakeExec([], pid=77, pid_after_inspects=3)
    engine, _ = make(run, host)
    result = engine.run("box", request(timeout=1))
    assert result.timed_out
    assert host.kill_calls == [77]


def test_a_stream_that_stays_open_after_the_kill_is_given_up() -> None:
    host = FakeSandboxHost(procs={100: 0})
    run = FakeExec([], pid=55)
    engine, _ = make(run, host)
    host.kill_exec = lambda cgroup, pid, since: 0  # type: ignore[method-assign]
    result = engine.run("box", request(timeout=1))
    assert result.timed_out
    assert result.duration == pytest.approx(1 + KILL_GRACE, abs=1)


def test_oom_killed_when_the_sandbox_counter_grew_during_the_exec() -> None:
    host = FakeSandboxHost(oom_kill_count=3, oom_kills_during_exec=1)
    engine, _ = make(FakeExec([None], exit_code=137), host)
    assert engine.run("box", request()).oom_killed


@pytest.mark.parametrize(("count", "during"), [(3, 0), (None, 1)])
def test_not_oom_killed_when_the_counter_is_unchanged_or_unreadable(
    count: int | None, during: int
) -> None:
    host = FakeSandboxHost(oom_kill_count=count, oom_kills_during_exec=during)
    engine, _ = make(FakeExec([None]), host)
    assert not engine.run("box", request()).oom_killed


def test_exit_code_waits_until_docker_marks_the_exec_finished() -> None:
    engine, _ = make(FakeExec([None], exit_code=3, running_after_exit=4))
    assert engine.run("box", request()).exit_code == 3


def test_a_command_running_on_after_closing_its_output_times_out() -> None:
    host = FakeSandboxHost(procs={100: 0})
    run = FakeExec([[chunk(OUT, b"bye")], None], pid=8, exits_at_eof=False)
    engine, _ = make(run, host)
    result = engine.run("box", request(timeout=3))
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
    stdout: bytes, code: int, explained: int | None
) -> None:
    run = FakeExec([[chunk(OUT, stdout)], None], exit_code=code)
    engine, _ = make(run)
    result = engine.run("box", request())
    if explained is None:
        assert (result.stdout, result.exit_code) == (stdout, code)
    else:
        assert (result.stdout, result.exit_code) == (b"", explained)
        assert result.stderr == stdout.replace(b"\r\n", b"\n")


def test_abandoning_the_stream_kills_the_exec() -> None:
    host = FakeSandboxHost(procs={100: 0})
    run = FakeExec([[chunk(OUT, b"x")], [chunk(OUT, b"y")]], pid=9)
    engine, _ = make(run, host)
    events = engine.stream("box", request())
    assert next(events) == chunk(OUT, b"x")
    events.close()
    assert host.kill_calls == [9]
    assert run.closed


def test_unknown_sandbox_is_not_found() -> None:
    engine, _ = make(FakeExec([None]))
    with pytest.raises(SandboxNotFound):
        engine.run("nope", request())


def test_async_stream_yields_the_same_events() -> None:
    run = FakeExec([[chunk(ERR, b"e")], None], exit_code=1)
    engine, _ = make(run)

    async def collect() -> list[ExecEvent]:
        return [event async for event in engine.astream("box", request())]

    events = asyncio.run(collect())
    assert events[0] == chunk(ERR, b"e")
    assert isinstance(events[-1], ExecResult)
    assert events[-1].exit_code == 1
