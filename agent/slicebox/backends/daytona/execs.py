"""The daytona backend's execs on this side: the table of those it minted (each one's sandbox
and request, then how it is doing) and an exec's answer as an ``AsyncExecAttachment``."""

from __future__ import annotations

import asyncio
import math
import secrets
import threading
from collections.abc import AsyncIterator
from typing import Any

from slicebox.backends.base import StdinSource
from slicebox.backends.daytona.client import kind_of, status
from slicebox.backends.daytona.terms import EXEC_PREFIX
from slicebox.model.errors import InvalidRequest, SandboxNotFound
from slicebox.model.exec import TIMEOUT_EXIT_CODE, ExecRequest, ExecState, OutputStream, StreamChunk

# Daytona's own timeout of an exec runs this much past the request's: the engine's deadline
# (and its kill, exit code 124) comes first; Daytona's is the backstop of an exec the agent lost.
EXEC_BACKSTOP = 10
KEEP_ENDED = 1024  # ended execs whose state an inspect may still ask for


class Exec:
    """One exec: where it runs and, once started, how it is doing."""

    def __init__(self, daytona_id: str, request: ExecRequest, sandbox: Any) -> None:
        self.daytona_id = daytona_id
        self.request = request
        self.sandbox = sandbox  # the SDK's AsyncSandbox its create found running
        self.started = False
        self.running = False
        self.exit_code: int | None = None
        self.verdict: str | None = None

    @property
    def timeout(self) -> int:
        """Daytona's timeout of it, in whole seconds (see :data:`EXEC_BACKSTOP`)."""
        return math.ceil(self.request.timeout) + EXEC_BACKSTOP


class Execs:
    """The execs minted, by id, from any thread or loop; the last :data:`KEEP_ENDED` that
    ended stay for an inspect."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, Exec] = {}

    def mint(self, sandbox: Any, request: ExecRequest) -> str:
        """A new exec's id, for ``request`` in ``sandbox`` (running)."""
        exec_id = f"{EXEC_PREFIX}{secrets.token_hex(8)}"
        with self._lock:
            self._known[exec_id] = Exec(str(sandbox.id), request, sandbox)
        return exec_id

    def start(self, exec_id: str) -> Exec:
        """The exec, marked running; an exec starts once."""
        with self._lock:
            run = self._known_run(exec_id)
            if run.started:
                raise InvalidRequest(f"daytona exec {exec_id} was started already")
            run.started = run.running = True
        return run

    def end(self, run: Exec, exit_code: int | None, verdict: str | None = None) -> None:
        with self._lock:
            run.running = False
            run.exit_code = exit_code
            run.verdict = verdict
            ended = [
                key for key, known in self._known.items() if known.started and not known.running
            ]
            for key in ended[: max(0, len(ended) - KEEP_ENDED)]:
                del self._known[key]

    def answered(self, run: Exec, answer: Any) -> bytes:
        """The exec ended with Daytona's answer: its code kept, its output returned."""
        code = answer.exit_code
        self.end(run, code if isinstance(code, int) else None)
        return str(answer.result or "").encode()

    def timed_out(self, run: Exec, exc: BaseException) -> bool:
        """Whether ``exc`` is Daytona's timeout of the exec, which then ends as timed out."""
        if kind_of(exc, "DaytonaTimeoutError") or status(exc) == 408:
            self.end(run, TIMEOUT_EXIT_CODE, "timeout")
            return True
        return False

    def state(self, exec_id: str) -> ExecState:
        with self._lock:
            run = self._known_run(exec_id)
            return ExecState(
                pid=0, running=run.running, exit_code=run.exit_code, verdict=run.verdict
            )

    def _known_run(self, exec_id: str) -> Exec:
        """The exec this backend made (the caller holds the lock); SandboxNotFound else."""
        run = self._known.get(exec_id)
        if run is None:
            raise SandboxNotFound(f"no daytona exec {exec_id}")
        return run

    def killable(self, exec_id: str) -> Exec | None:
        """The exec when it is running; None otherwise."""
        with self._lock:
            run = self._known.get(exec_id)
        return run if run is not None and run.running else None


async def chunks(source: StdinSource) -> AsyncIterator[bytes]:
    """A :class:`StdinSource` as the async iterable the SDK's streamed upload takes."""
    while chunk := await source.read():
        yield chunk


class TaskRun:
    """An exec's answer awaited on the loop (``AsyncExecAttachment``): no output until the
    command has ended, then all of it, then the end."""

    def __init__(self, task: asyncio.Task[bytes]) -> None:
        self._task = task
        self._ended = False

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        if self._ended:
            return None
        done, _ = await asyncio.wait({self._task}, timeout=max(timeout, 0))
        if not done:
            return []
        self._ended = True
        output = self._task.result()  # the exec's failure, raised here
        return [StreamChunk(stream=OutputStream.STDOUT, data=output)] if output else None

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
