"""A one-shot command handed to the sandbox's waiter (core.launch): the line, run by this
machine's real ``sh`` as the waiter (``tests.fakes.local_exec``), read back as an exec's result;
and the cutting of each stream at its marker, chunk boundaries anywhere."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from slicebox.core.blocking import inline
from slicebox.core.execution import ExecEngine, result_of
from slicebox.core.launch import Launched, can_launch, launch_line
from slicebox.model.exec import ExecRequest, ExecResult, OutputStream, StreamChunk
from tests.fakes.local_exec import LocalExecs, LocalHost

NONCE = "0123456789abcdef0123456789abcdef"


def launched(tmp_path: Path, request: ExecRequest) -> tuple[ExecResult, LocalHost]:
    host = LocalHost()
    engine = ExecEngine(LocalExecs(tmp_path, host), host)
    return asyncio.run(result_of(engine.launch("box", request, inline))), host


def test_argv_env_cwd_and_stdin_reach_the_command_as_given(tmp_path: Path) -> None:
    script = 'printf "%s|" "$@"; echo "$GREETING"; pwd; cat; echo err >&2; exit 3'
    words = ("a b", "it's", "$HOME", "x\ny", "", "*", "back\\slash \\n \\c %b")
    request = ExecRequest(
        argv=("sh", "-c", script, "sh", *words),
        env={"GREETING": "hello 'you' $USER"},
        cwd=str(tmp_path),
        stdin=b"data\x00\xff",
    )
    result, _ = launched(tmp_path, request)
    printed = b"a b|it's|$HOME|x\ny||*|back\\slash \\n \\c %b|"
    assert result.stdout == printed + b"hello 'you' $USER\n%s\ndata\x00\xff" % (
        str(tmp_path).encode()
    )
    assert (result.stderr, result.exit_code, result.timed_out) == (b"err\n", 3, False)


def test_a_missing_working_directory_is_126_and_a_missing_program_127(tmp_path: Path) -> None:
    missing_cwd, _ = launched(tmp_path, ExecRequest(argv=("true",), cwd=str(tmp_path / "no")))
    assert missing_cwd.exit_code == 126
    assert b"no" in missing_cwd.stderr
    missing, _ = launched(tmp_path, ExecRequest(argv=("no-such-program",), cwd=str(tmp_path)))
    assert missing.exit_code == 127
    assert b"no-such-program" in missing.stderr


def test_what_a_left_behind_process_prints_after_the_command_is_not_the_run_s(
    tmp_path: Path,
) -> None:
    request = ExecRequest(argv=("sh", "-c", "(sleep 0.5; echo late) & echo now"), cwd="/")
    result, _ = launched(tmp_path, request)
    assert (result.stdout, result.exit_code) == (b"now\n", 0)


def test_output_past_the_cap_is_counted_not_kept(tmp_path: Path) -> None:
    request = ExecRequest(argv=("head", "-c", "100000", "/dev/zero"), cwd="/", output_cap=10)
    result, _ = launched(tmp_path, request)
    assert (result.stdout, result.stdout_truncated, result.stdout_dropped_bytes) == (
        b"\0" * 10,
        True,
        99990,
    )
    assert result.exit_code == 0


def test_a_command_past_its_timeout_is_killed_and_answers_124(tmp_path: Path) -> None:
    started = time.monotonic()
    result, host = launched(tmp_path, ExecRequest(argv=("sleep", "30"), cwd="/", timeout=0.5))
    assert (result.exit_code, result.timed_out) == (124, True)
    assert host.killed, "the run's processes were killed"
    assert time.monotonic() - started < 10


def test_the_line_quotes_every_word() -> None:
    """One line whatever the words hold: newlines and backslashes escaped for printf %b."""
    request = ExecRequest(argv=("echo", "a;b", "$(x)", "1\n2\\n"), env={"K": "v w"}, cwd="/d")
    assert launch_line(request, NONCE) == (
        b"(cd /d || exit 126; export 'K=v w'; exec echo 'a;b' '$(x)' '1\\n2\\\\n'); s=$?; "
        b"printf '%s %s\\\\n' " + NONCE.encode() + b' "$s"; '
        b"printf '%s %s\\\\n' " + NONCE.encode() + b' "$s" >&2; exec sleep infinity\n'
    )


@pytest.mark.parametrize(
    ("env", "can"),
    [({}, True), ({"A_1": "x", "_b": ""}, True), ({"a-b": "1"}, False), ({"1A": "x"}, False)],
)
def test_env_names_a_shell_cannot_export_go_by_docker_exec(env: dict[str, str], can: bool) -> None:
    assert can_launch(ExecRequest(argv=("x",), env=env)) is can


class Scripted:
    """An attachment that returns its chunks one read at a time, then ends."""

    def __init__(self, chunks: list[StreamChunk]) -> None:
        self.chunks = chunks
        self.closed = False

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        return [self.chunks.pop(0)] if self.chunks else None

    def close(self) -> None:
        self.closed = True


def read_all(attachment: Launched) -> dict[OutputStream, bytes]:
    async def main() -> dict[OutputStream, bytes]:
        got = dict.fromkeys(OutputStream, b"")
        while (chunks := await attachment.read(1.0)) is not None:
            for chunk in chunks:
                got[chunk.stream] += chunk.data
        return got

    return asyncio.run(main())


def byte_by_byte(stream: OutputStream, data: bytes) -> list[StreamChunk]:
    return [StreamChunk(stream=stream, data=data[i : i + 1]) for i in range(len(data))]


def test_each_stream_ends_at_its_marker_wherever_the_chunks_split_it() -> None:
    out, err = OutputStream.STDOUT, OutputStream.STDERR
    marker = f"{NONCE} 7\n".encode()
    chunks = [
        *byte_by_byte(err, b"oops " + NONCE[:5].encode() + b" not it\n" + marker),
        *byte_by_byte(out, b"0123" + marker + b"after"),
    ]
    attachment = Launched(Scripted(chunks), NONCE)
    assert read_all(attachment) == {out: b"0123", err: b"oops " + NONCE[:5].encode() + b" not it\n"}
    assert (attachment.state().running, attachment.state().exit_code) == (False, 7)


def test_a_stream_that_ends_without_its_markers_keeps_all_it_held_and_has_no_code() -> None:
    out = OutputStream.STDOUT
    attachment = Launched(Scripted([StreamChunk(stream=out, data=b"short")]), NONCE)
    assert read_all(attachment)[out] == b"short"
    assert (attachment.state().running, attachment.state().exit_code) == (False, None)
