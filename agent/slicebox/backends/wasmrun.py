"""The worker of a wasm sandbox: its main process, which calls Extism plugins for the agent.

A wasm sandbox's anchor (``backends.native``) runs ``python3 -m slicebox.backends.wasmrun
--serve PATH`` in the sandbox's slice, so the sandbox's memory, cpu and pids ceilings hold for
the plugins' host process, its memory shows in the level tree, and a stop of the sandbox ends
it. It pays Python's start and Extism's load once, when the sandbox is made (it tells systemd
it is ready, ``Type=notify``, once it listens), not at every call. Each call is one connection
to its unix socket (``PATH``, in the anchor's runtime directory, reachable by root and the
sandbox's own user alone):

- the agent sends a request: a header (4-byte big-endian length, then JSON: function,
  timeout_ms, max_pages, allowed hosts, sha256, the module's and the input's sizes), the
  module (only in the request that makes the sandbox ready: a call names it by sha256), the
  input;
- the worker compiles the module once per (sha256, limits), with the sandbox's workspace as
  the one path its WASI sees (``--workspace``), and makes a fresh instance for every call, so
  nothing of one call's memory reaches the next; a request naming no function only compiles
  (the agent sends one as it makes the sandbox: its first call finds the module ready); the
  call runs on a thread of its own while the connection is watched: the agent closing it (an
  exec killed, a stream abandoned) cancels the call, and so does its timeout;
- the answer: the exit status (4 bytes), the output's length (8 bytes), the output, then the
  message (UTF-8) to the end.

What the exit status says: 0 the function returned 0; 1 it failed (the message says why); 124
it ran past its ``timeout_ms``; 137 it asked for more memory than ``max_pages``; 127 the plugin
exports no such function; 2 a bad request.

Only the standard library and ``extism`` are imported here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # slicebox.model.wasm keeps these in step
EXIT_NO_FUNCTION = 127
EXIT_OOM = 137
MAX_HEADER = 64 * 1024
WATCH = 0.05  # seconds between looks at a connection while its call runs
COMPILED_KEPT = 8  # compiled modules kept


def manifest(
    module: bytes, max_pages: int, hosts: list[str], workspace: str = ""
) -> dict[str, Any]:
    """The plugin's manifest; its timeout is the worker's to enforce, per call."""
    return {
        "wasm": [{"data": module}],
        "memory": {"max_pages": max_pages},
        "allowed_hosts": hosts,  # empty: no host at all
        # The sandbox's own workspace (WASI) and no other path.
        "allowed_paths": {workspace: "/workspace"} if workspace else {},
    }


def request_bytes(
    function: str,
    module: bytes,
    data: bytes,
    *,
    sha256: str,
    max_pages: int,
    timeout_ms: int,
    hosts: list[str],
) -> bytes:
    """One call as the agent sends it."""
    header = {
        "function": function,
        "sha256": sha256,
        "max_pages": max_pages,
        "timeout_ms": timeout_ms,
        "hosts": hosts,
        "module_size": len(module),
        "input_size": len(data),
    }
    head = json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + module + data


def answer_of(buffer: bytes) -> tuple[int, bytes, str]:
    """(exit status, output, message) from the worker's answer; ValueError if cut short."""
    if len(buffer) < 12:
        raise ValueError("the worker's answer ended early (did the sandbox stop?)")
    status = int.from_bytes(buffer[:4], "big")
    size = int.from_bytes(buffer[4:12], "big")
    if len(buffer) < 12 + size:
        raise ValueError("the worker's answer ended early (did the sandbox stop?)")
    return status, buffer[12 : 12 + size], buffer[12 + size :].decode(errors="replace")


def answer_bytes(status: int, output: bytes, message: str) -> bytes:
    return status.to_bytes(4, "big") + len(output).to_bytes(8, "big") + output + message.encode()


class Worker:
    """Calls plugins: compiled once per (sha256, limits), instantiated once per call."""

    def __init__(self, workspace: str = "") -> None:
        import extism
        import extism.extism

        self._extism = extism
        self._workspace = workspace
        # Not exported by the package (1.1), but there: compile once, instantiate per call.
        # An SDK without it compiles at every call.
        self._compile: Callable[..., Any] = getattr(
            extism.extism, "CompiledPlugin", lambda plan, wasi: plan
        )
        self._compiled: dict[tuple[str, int, tuple[str, ...]], Any] = {}
        self._lock = threading.Lock()

    def call(
        self,
        header: dict[str, Any],
        module: bytes,
        data: bytes,
        hung_up: Callable[[], bool] = lambda: False,
    ) -> tuple[int, bytes, str]:
        """One call; a function named "" only compiles the module (a sandbox made ready)."""
        extism = self._extism
        function = str(header["function"])
        max_pages = int(header["max_pages"])
        hosts = [str(host) for host in header["hosts"]]
        key = (str(header["sha256"]), max_pages, tuple(hosts))
        try:
            with self._lock:
                compiled = self._compiled.get(key)
                if compiled is None and not module:
                    return EXIT_USAGE, b"", "wasmrun: the module was not sent and is not compiled"
                if compiled is None:
                    plan = manifest(module, max_pages, hosts, self._workspace)
                    compiled = self._compile(plan, wasi=True)
                    self._compiled[key] = compiled
                    while len(self._compiled) > COMPILED_KEPT:  # the oldest go first
                        del self._compiled[next(iter(self._compiled))]
            plugin = extism.Plugin(compiled, wasi=True)
        except extism.Error as exc:
            return EXIT_FAILED, b"", f"the plugin could not be loaded: {exc}"
        if not function:
            return 0, b"", ""
        if not plugin.function_exists(function):
            return EXIT_NO_FUNCTION, b"", f"the plugin exports no function {function!r}"
        return self._watched(plugin, function, data, header, hung_up)

    def _watched(
        self,
        plugin: Any,
        function: str,
        data: bytes,
        header: dict[str, Any],
        hung_up: Callable[[], bool],
    ) -> tuple[int, bytes, str]:
        """The call on a thread of its own, cancelled at its timeout (one compiled module
        serves every timeout) or when the agent hangs up."""
        outcome: list[tuple[int, bytes, str]] = []
        runner = threading.Thread(
            target=lambda: outcome.append(self._run(plugin, function, data, header)), daemon=True
        )
        cancel = plugin.cancel_handle()
        deadline = time.monotonic() + int(header["timeout_ms"]) / 1000
        runner.start()
        while runner.is_alive():
            runner.join(min(WATCH, max(0.0, deadline - time.monotonic())))
            if not runner.is_alive():
                break
            if time.monotonic() >= deadline:
                header = {**header, "timed_out": True}
                cancel.cancel()
            elif hung_up():
                cancel.cancel()  # the agent has gone: the plugin stops at its next check
            else:
                continue
            runner.join()
        status, output, message = outcome[0]
        if header.get("timed_out") and status == EXIT_FAILED:
            limit = header["timeout_ms"]
            return EXIT_TIMEOUT, b"", f"the call ran past its timeout ({limit} ms)"
        return status, output, message

    def _run(
        self, plugin: Any, function: str, data: bytes, header: dict[str, Any]
    ) -> tuple[int, bytes, str]:
        try:
            return 0, bytes(plugin.call(function, data)), ""
        except self._extism.Error as exc:
            said = str(exc)
            if said == "oom":
                pages = header["max_pages"]
                return EXIT_OOM, b"", f"the plugin asked for more than {pages} pages of memory"
            return EXIT_FAILED, b"", f"the call failed: {said}"


def call(
    module: bytes, function: str, data: bytes, *, max_pages: int, timeout_ms: int, hosts: list[str]
) -> tuple[int, bytes, str]:
    """One call in this process (what a connection to the worker does)."""
    header = {
        "function": function,
        "sha256": str(hash(module)),
        "max_pages": max_pages,
        "timeout_ms": timeout_ms,
        "hosts": hosts,
    }
    return Worker().call(header, module, data)


def _read(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ValueError(f"the request ended early ({size - left} of {size} bytes)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _hung_up(conn: socket.socket) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    return check


def handle(worker: Worker, conn: socket.socket) -> None:
    with conn:
        try:
            size = int.from_bytes(_read(conn, 4), "big")
            if size > MAX_HEADER:
                raise ValueError("the request's header is too long")
            header = json.loads(_read(conn, size))
            module = _read(conn, int(header["module_size"]))
            data = _read(conn, int(header["input_size"]))
        except (ValueError, KeyError, TypeError) as exc:
            conn.sendall(answer_bytes(EXIT_USAGE, b"", f"wasmrun: a bad request: {exc}"))
            return
        status, output, message = worker.call(header, module, data, _hung_up(conn))
        with contextlib.suppress(OSError):  # the agent went away: nothing to tell
            conn.sendall(answer_bytes(status, output, message))


def notify(state: str) -> None:
    """Tell systemd (``Type=notify``), when it asked to be told."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(state.encode(), address)


def serve(path: str, workspace: str = "") -> int:
    worker = Worker(workspace)  # Extism's library is loaded before the sandbox is called ready
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    # Its directory, the anchor's runtime directory (0700), is what guards it.
    os.chmod(path, 0o666)  # noqa: S103
    server.listen(64)
    notify("READY=1")
    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(worker, conn), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wasmrun", description=__doc__.splitlines()[0])
    parser.add_argument("--serve", required=True, metavar="PATH", help="the unix socket")
    parser.add_argument("--workspace", default="", help="the directory plugins see (WASI)")
    args = parser.parse_args(argv)
    return serve(args.serve, args.workspace)


if __name__ == "__main__":
    sys.exit(main())
