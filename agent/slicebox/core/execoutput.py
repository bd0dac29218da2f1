"""What becomes of an exec's output, and what the runtime's own words in it mean.

:class:`OutputCapture` keeps the head of each stream (the first ``output_cap`` bytes) and counts
what it drops, so memory is bounded whatever a command prints. A command that could not start
is reported by Docker (runc) on stdout with exit code 126, and by Podman on stderr:
:func:`explain_start_failure` answers as a shell would (127 for a missing program). An exec
made while the sandbox's scope is frozen for a moment (another exec's kill) is refused with
the runtime's words; ``may_be_paused_refusal``/``is_paused_refusal`` tell that refusal from a
command's own output, so the engine runs the command again.
"""

from __future__ import annotations

from typing import Protocol

from slicebox.model.exec import ExecResult, OutputStream, StreamChunk

START_FAILED = 126
NOT_FOUND_EXIT_CODE = 127
OCI_START_FAILURE = b"OCI runtime exec failed"
# runc's refusal of an exec into a frozen scope (under Docker and Podman); the engine's own kill
# freezes a scope for milliseconds, so an exec starting then is made again after these pauses.
PAUSED_REFUSAL = b"cannot exec in a paused container"
PODMAN_ERROR = b"Error: "
PODMAN_EXEC_FAILED = 125  # Podman's exit code for an exec its runtime did not start
REFUSAL_MAX = 4096
PODMAN_START_FAILURE = b"OCI runtime attempted to invoke a command that was not found"


class Capture(Protocol):
    """What becomes of an exec's output: what is streamed, and what its result keeps."""

    def add(self, chunk: StreamChunk) -> StreamChunk | None:
        """Record a chunk; return what is streamed of it (None: nothing). An error raised here
        ends the exec, whose processes are killed."""

    def result(
        self, *, exit_code: int, timed_out: bool, oom_killed: bool, duration: float
    ) -> ExecResult: ...


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


def explain_start_failure(result: ExecResult) -> ExecResult:
    """Docker reports a command that could not start (no such program, no such cwd) as exit
    code 126 with runc's message on stdout; move the message to stderr, and answer 127 for a
    missing program, as a shell would. Podman says either with 127 and its message on stderr:
    a cwd that is not there is 126 there too."""
    if result.exit_code == NOT_FOUND_EXIT_CODE and _podman_no_cwd(result.stderr):
        return result.model_copy(update={"exit_code": START_FAILED})
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


def may_be_paused_refusal(held: list[StreamChunk]) -> bool:
    """Whether the output so far may be (the start of) the runtime's refusal to start: runc's
    words on stdout through Docker; Podman's "Error: " lines on stderr. A command's own output
    that only looks like it is held back (a few KiB at most) for ``execution.REFUSAL_WAIT``,
    then only until the backend says the command runs."""
    first = held[0]
    return (
        first.data.startswith(_refusal_prefix(first.stream))
        and all(chunk.stream is first.stream for chunk in held)
        and sum(len(chunk.data) for chunk in held) <= REFUSAL_MAX
    )


def is_paused_refusal(held: list[StreamChunk]) -> bool:
    """Whether the whole output was the runtime's refusal to exec into a frozen scope: every
    line its words, one of them saying so."""
    data = b"".join(chunk.data for chunk in held)
    prefix = _refusal_prefix(held[0].stream)
    lines = data.replace(b"\r\n", b"\n").rstrip(b"\n").split(b"\n")
    return PAUSED_REFUSAL in data and all(line.startswith(prefix) for line in lines)


def _refusal_prefix(stream: OutputStream) -> bytes:
    return OCI_START_FAILURE if stream is OutputStream.STDOUT else PODMAN_ERROR


def _podman_no_cwd(stderr: bytes) -> bool:
    """Podman's words for an exec whose cwd is not there (runc's or crun's, after "Error: ")."""
    head = stderr[:4096]
    return head.startswith(PODMAN_ERROR) and PODMAN_START_FAILURE in head and b"chdir to" in head
