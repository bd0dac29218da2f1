"""The ``wasm`` backend: Extism plugins run in a native sandbox's slice, bounded by the kernel.

A wasm sandbox is a native sandbox (``backends.native``: its own slice under the project
slice with the sandbox's memory, cpu and pids limits, a dynamic user, no capability) whose
request carries a :class:`~slicebox.model.wasm.WasmRun`, and whose anchor, its main process,
is the worker (``backends.wasmrun``): it loads Extism once, when the sandbox is made, and
answers calls on a unix socket in its runtime directory. The agent sends it the module (from
its store, ``host.plugins``) once, as the sandbox is made, and the worker compiles it then.
Each exec in the sandbox is one call: ``argv`` is ``[function]``, stdin the input, and the
worker instantiates the compiled module afresh for it. So the
plugins' host process sits in the sandbox's slice: the kernel's ceilings bound it, its memory
shows in the level tree, a stop of the sandbox ends it. Inside it Extism bounds the plugin
itself: ``max_pages`` from the sandbox's memory limit, ``timeout_ms`` from the exec's timeout,
``allowed_hosts`` from its network (none: no host), the sandbox's workspace as the one path.

Seen from above, a wasm exec is an exec: caps, truncation, streaming, audit; its timeout
answers 124 and ``timed_out``, a plugin past its pages ``oom_killed`` (the worker's exit status
says which: the exec's verdict). A killed exec (a timeout, an abandoned stream) is the call's
connection closed: the worker cancels the call.
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from slicebox.backends import wasmrun
from slicebox.backends.base import Availability
from slicebox.model.errors import InvalidRequest
from slicebox.model.exec import ExecRequest, ExecState, OutputStream, StreamChunk
from slicebox.model.spec import Backend
from slicebox.model.wasm import EXIT_OOM, EXIT_TIMEOUT, FUNCTION, WasmRun

WORKER = "slicebox.backends.wasmrun"
EXIT_LOST = 1  # the worker did not answer (the sandbox stopped, or its worker was killed)
# The modules the worker imports, besides the standard library: their directories make its
# PYTHONPATH, wherever the agent found them (Debian's dist-packages, /usr/local, a venv).
IMPORTED = ("slicebox", "extism", "extism_sys", "cffi", "_cffi_backend")


def function_of(request: ExecRequest) -> str:
    """The exported function an exec in a wasm sandbox calls; ``wasm_invalid`` otherwise."""
    if request.shell or len(request.argv) != 1 or not FUNCTION.fullmatch(request.argv[0]):
        raise InvalidRequest(
            "an exec in a wasm sandbox calls one exported function: give argv as [function] "
            "(a name like count_vowels) and the input as its stdin",
            code="wasm_invalid",
            field="argv",
        )
    return request.argv[0]


def python_path() -> str:
    """Where the worker finds what it imports: the directories the agent found them in."""
    found: list[str] = []
    for name in IMPORTED:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        where = origin.parents[1] if origin.name == "__init__.py" else origin.parent
        if str(where) not in found:
            found.append(str(where))
    return ":".join(found)


def verdict(exit_status: int) -> str | None:
    """What a worker's exit status for a call says beyond its code."""
    return {EXIT_TIMEOUT: "timeout", EXIT_OOM: "oom"}.get(exit_status)


def availability(native: Availability) -> Availability:
    """The wasm backend runs where the native one does and the Extism SDK imports."""
    if not native.available:
        return Availability(kind=Backend.WASM, available=False, detail=native.detail)
    if importlib.util.find_spec("extism") is None:
        return Availability(
            kind=Backend.WASM,
            available=False,
            detail="the Extism SDK is not installed: install slicebox[wasm] (pip install extism)",
        )
    return Availability(
        kind=Backend.WASM,
        available=True,
        detail="Extism plugins in native sandbox slices (max_pages, timeout_ms, allowed_hosts)",
    )


SOCKET_NAME = "worker.sock"
RUNTIME = "slicebox/wasm"  # below /run: each wasm sandbox's anchor's own runtime directory
MAX_INPUT = 64 * 1024 * 1024  # a call's input, held whole (a plugin takes its input whole)
CONNECT_TIMEOUT = 10.0


def socket_path(runtime: Path, name: str) -> Path:
    return runtime / name / SOCKET_NAME


def anchor_argv(path: Path, workspace: str) -> list[str]:
    return [sys.executable, "-B", "-m", WORKER, "--serve", str(path), "--workspace", workspace]


def call_request(run: WasmRun, request: ExecRequest, data: bytes) -> bytes:
    """An exec's call: no module (its worker compiled it as the sandbox was made)."""
    timeout_ms = max(1, int(request.timeout * 1000))
    return _request(run, function_of(request), b"", data, timeout_ms)


def prepare_request(run: WasmRun, module: bytes) -> bytes:
    """A request that only compiles the module (no function), sent as the sandbox is made."""
    return _request(run, "", module, b"", 1)


def _request(run: WasmRun, function: str, module: bytes, data: bytes, timeout_ms: int) -> bytes:
    return wasmrun.request_bytes(
        function,
        module,
        data,
        sha256=run.sha256,
        max_pages=run.max_pages,
        timeout_ms=timeout_ms,
        hosts=list(run.allowed_hosts),
    )


def state_of(status: int) -> ExecState:
    return ExecState(pid=0, running=False, exit_code=status, verdict=verdict(status))


def chunks_of(output: bytes, message: str) -> list[StreamChunk]:
    """A call's answer as an exec's output: the output on stdout, the message on stderr."""
    chunks = [StreamChunk(stream=OutputStream.STDOUT, data=output)] if output else []
    if message:
        chunks.append(StreamChunk(stream=OutputStream.STDERR, data=message.encode() + b"\n"))
    return chunks


class Call:
    """One call's connection, read to its end on the event loop (``AsyncExecAttachment``):
    the output as stdout and the message as stderr, once the worker answers. ``close`` hangs
    up, which cancels the call in the worker."""

    def __init__(self, path: Path, payload: bytes, ended: Callable[[ExecState], None]) -> None:
        self._task = asyncio.get_running_loop().create_task(self._call(path, payload))
        self._ended = ended
        self._given = False

    async def _call(self, path: Path, payload: bytes) -> tuple[int, bytes, str]:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(path)), CONNECT_TIMEOUT
        )
        try:
            writer.write(payload)
            await writer.drain()
            answer = await reader.read()
        finally:
            writer.close()
        return wasmrun.answer_of(answer)

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        if self._given:
            return None
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        if not done:
            return []
        self._given = True
        try:
            status, output, message = self._task.result()
        except (OSError, ValueError, asyncio.CancelledError) as exc:
            status, output = EXIT_LOST, b""
            message = f"the sandbox's worker did not answer: {exc}"
        self._ended(state_of(status))
        return chunks_of(output, message)

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()  # its connection closes: the worker cancels the call


def call_blocking(path: Path, payload: bytes) -> tuple[int, bytes, str]:
    """One call, its connection read in the calling thread."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(CONNECT_TIMEOUT)
        conn.connect(str(path))
        conn.settimeout(None)
        conn.sendall(payload)
        chunks = []
        while chunk := conn.recv(1 << 20):
            chunks.append(chunk)
    return wasmrun.answer_of(b"".join(chunks))
