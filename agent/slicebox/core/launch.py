"""A one-shot command handed to a waiting sandbox on its stdin, instead of a Docker exec.

A one-shot run's sandbox is used for one command and removed. Starting that command with a
Docker exec costs a ``runc exec`` (a new runtime process that enters the container's
namespaces), which was most of a pooled run, far more than all its other steps together (see
docs/benchmarks.md). So a sandbox made for a one-shot run (cold, or a warm pool's member,
whose request cannot know whether a run or a create will take it) starts with a *waiter* as its
main process, under Docker's init, with its stdin open (``OpenStdin``, ``StdinOnce``):

    sh -c 'IFS= read -r line || exec sleep infinity; eval "$(printf %b "$line")"'

It reads one line and runs it (backslash escapes in it undone: a word's newline is sent as
``\\n``, and a backslash as two); until then it only waits (a sandbox a ``create`` took keeps it
waiting forever, as ``sleep infinity`` would, and is exec'd in as any other). The run attaches
to the container (Docker's attach: no runtime process, no namespace entry) and writes
:func:`launch_line` then the command's stdin, then closes its side (``StdinOnce``: the command
reads EOF, as an exec's does). The line runs the command in a subshell, in its working
directory, with its environment, stdin and output being the container's; then it prints
``<nonce> <exit code>`` on stdout and on stderr, and the waiter becomes ``sleep infinity``, so
the container, its scope and its counters are still there for the run's final usage.

:class:`Launched` reads that attachment as an exec's: each stream ends at its marker (within
one pipe the command's output comes before the waiter's marker; between the two pipes Docker
keeps no order, hence a marker on each), the exit code is the markers', and what any process
left behind prints after them is not the run's. The nonce is random per run: nothing the
command prints can end its stream early by chance. A command that wants to lie about its own
exit code could simply exit with another: the marker guards against accidents, not against the
command.

A run launches only when the line can say all its request says: env names must be shell names
(``can_launch``); any other request is run with a Docker exec, as before, on the same sandbox.
The exec engine kills a launched command's processes as it kills an exec's, at its timeout or
when its reader goes: every process of the sandbox's cgroup started since the line was sent
(the init and the waiter are older).
"""

from __future__ import annotations

import re
import secrets
import shlex

from slicebox.backends.base import AsyncExecAttachment
from slicebox.model.exec import ExecRequest, ExecState, OutputStream, StreamChunk

# The label value of a sandbox whose main process is the waiter (``slicebox.launcher``).
LAUNCHER = "sh"
WAITER = 'IFS= read -r line || exec sleep infinity; eval "$(printf %b "$line")"'
WAITER_COMMAND = ("sh", "-c", WAITER)
MISSING_CWD_EXIT_CODE = 126  # what a Docker exec into a missing working directory answers
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NONCE_HEX = 32


def can_launch(request: ExecRequest) -> bool:
    """Whether the waiter's line can carry ``request``: its env names are shell names."""
    return all(_SHELL_NAME.fullmatch(name) for name in request.env)


def new_nonce() -> str:
    return secrets.token_hex(_NONCE_HEX // 2)


def launch_line(request: ExecRequest, nonce: str) -> bytes:
    """The one line the waiter evaluates for ``request`` (every word single-quoted)."""
    exports = "".join(
        f"export {shlex.quote(f'{name}={value}')}; " for name, value in request.env.items()
    )
    command = " ".join(shlex.quote(word) for word in request.argv)
    marker = f'{shlex.quote(nonce)} "$s"'
    script = (
        f"(cd {shlex.quote(request.cwd)} || exit {MISSING_CWD_EXIT_CODE}; {exports}"
        f"exec {command}); s=$?; printf '%s %s\\n' {marker}; printf '%s %s\\n' {marker} >&2; "
        "exec sleep infinity"
    )
    # One line: a word's newlines travel as \n, which the waiter's printf %b turns back.
    return script.replace("\\", "\\\\").replace("\n", "\\n").encode() + b"\n"


def exec_line(argv: tuple[str, ...]) -> bytes:
    """The line that makes the waiter become ``argv`` (a sandbox's own command, released
    once its mounts were verified: ``core.creation``)."""
    script = "exec " + " ".join(shlex.quote(word) for word in argv)
    return script.replace("\\", "\\\\").replace("\n", "\\n").encode() + b"\n"


class _Cut:
    """One stream up to its marker: what may be released, holding back a tail that could be
    the marker's beginning; then the exit code the marker carries (`` <code>\\n``)."""

    def __init__(self, nonce: bytes) -> None:
        self._nonce = nonce
        self._held = b""
        self._marked = False  # the nonce was seen; its exit code may still be arriving
        self.ended = False  # the marker was read whole
        self.exit_code: int | None = None

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` is the command's output (now certain not to be the marker)."""
        held = self._held + data
        if self._marked:
            self._held = held
            self._read_code()
            return b""
        at = held.find(self._nonce)
        if at >= 0:
            self._marked = True
            self._held = held[at + len(self._nonce) :]
            self._read_code()
            return held[:at]
        cut = max(len(held) - (len(self._nonce) - 1), 0)
        self._held = held[cut:]
        return held[:cut]

    def _read_code(self) -> None:
        line, newline, _ = self._held.partition(b"\n")
        if newline or len(self._held) > 16:  # a code is a few digits: past that, none came
            self.ended = True
            code = line.strip()
            self.exit_code = int(code) if code.isdigit() else None
            self._held = b""

    def rest(self) -> bytes:
        """At the end of the stream without a marker: all that was held back."""
        held, self._held = (b"" if self._marked else self._held), b""
        return held


class Launched:
    """A launched command's attachment read as an exec's: see the module."""

    def __init__(self, attachment: AsyncExecAttachment, nonce: str) -> None:
        self._attachment = attachment
        self._cuts = {stream: _Cut(nonce.encode()) for stream in OutputStream}
        self._closed = False  # the stream ended before both markers (the container went)

    @property
    def done(self) -> bool:
        return self._closed or all(cut.ended for cut in self._cuts.values())

    def state(self) -> ExecState:
        """As Docker's exec inspect would say it; no exit code when the markers never came."""
        codes = {cut.exit_code for cut in self._cuts.values()}
        code = codes.pop() if len(codes) == 1 else None
        return ExecState(pid=0, running=not self.done, exit_code=code if self.done else None)

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        if self.done:
            return None
        chunks = await self._attachment.read(timeout)
        if chunks is None:
            self._closed = True
            rests = ((stream, cut.rest()) for stream, cut in self._cuts.items())
            return [StreamChunk(stream=stream, data=data) for stream, data in rests if data]
        kept = ((chunk.stream, self._cuts[chunk.stream].feed(chunk.data)) for chunk in chunks)
        return [StreamChunk(stream=stream, data=data) for stream, data in kept if data]

    def close(self) -> None:
        self._attachment.close()
