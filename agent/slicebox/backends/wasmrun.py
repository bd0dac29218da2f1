"""The worker of a wasm exec: one Extism plugin call, in a process the kernel bounds.

A wasm sandbox's exec is a transient service in the sandbox's slice (``backends.native``) that
runs ``python3 -m slicebox.backends.wasmrun``: the sandbox's memory, cpu and pids ceilings hold
for the plugin's host process as for any exec, its memory shows in the level tree, and a kill
of the unit ends it. The module comes on stdin ahead of the call's input, framed as
``SBXW`` + its length (8 bytes, big-endian) + its bytes, so the worker needs no file of the
agent's; the rest of stdin is the input. The output is written to stdout; a failed call's
message to stderr, with an exit status that tells what happened:

- 0: the function returned 0; 1: it failed (its error on stderr);
- 124: it ran past ``--timeout-ms`` (Extism stopped it);
- 137: it asked for more memory than ``--max-pages`` (Extism's ``oom``);
- 127: the plugin exports no such function; 2: a bad frame or arguments.

Only the standard library and ``extism`` are imported: this runs once per call.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, BinaryIO

MAGIC = b"SBXW"
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # slicebox.model.wasm keeps these in step
EXIT_NO_FUNCTION = 127
EXIT_OOM = 137


def frame(module: bytes) -> bytes:
    """The header and module the worker reads ahead of the input."""
    return MAGIC + len(module).to_bytes(8, "big") + module


def read_frame(stream: BinaryIO) -> bytes:
    head = stream.read(12)
    if len(head) != 12 or head[:4] != MAGIC:
        raise ValueError("stdin does not start with a plugin frame")
    size = int.from_bytes(head[4:], "big")
    module = stream.read(size)
    if len(module) != size:
        raise ValueError(f"the plugin frame ends early ({len(module)} of {size} bytes)")
    return module


def manifest(module: bytes, max_pages: int, timeout_ms: int, hosts: list[str]) -> dict[str, Any]:
    return {
        "wasm": [{"data": module}],
        "memory": {"max_pages": max_pages},
        "timeout_ms": timeout_ms,
        "allowed_hosts": hosts,  # empty: no host at all
        "allowed_paths": {},  # no file of the host's
    }


def call(
    module: bytes, function: str, data: bytes, *, max_pages: int, timeout_ms: int, hosts: list[str]
) -> tuple[int, bytes, str]:
    """(exit status, output, message) of one call."""
    import extism

    try:
        plugin = extism.Plugin(manifest(module, max_pages, timeout_ms, hosts), wasi=True)
    except extism.Error as exc:
        return EXIT_FAILED, b"", f"the plugin could not be loaded: {exc}"
    if not plugin.function_exists(function):
        return EXIT_NO_FUNCTION, b"", f"the plugin exports no function {function!r}"
    try:
        return 0, bytes(plugin.call(function, data)), ""
    except extism.Error as exc:
        said = str(exc)
        if said == "timeout":
            return EXIT_TIMEOUT, b"", f"the call ran past its timeout ({timeout_ms} ms)"
        if said == "oom":
            return EXIT_OOM, b"", f"the plugin asked for more than {max_pages} pages of memory"
        return EXIT_FAILED, b"", f"the call failed: {said}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wasmrun", description=__doc__.splitlines()[0])
    parser.add_argument("--function", required=True)
    parser.add_argument("--timeout-ms", type=int, required=True)
    parser.add_argument("--max-pages", type=int, required=True)
    parser.add_argument("--allow-host", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        module = read_frame(sys.stdin.buffer)
    except ValueError as exc:
        print(f"wasmrun: {exc}", file=sys.stderr)
        return EXIT_USAGE
    data = sys.stdin.buffer.read()
    status, output, message = call(
        module,
        args.function,
        data,
        max_pages=args.max_pages,
        timeout_ms=args.timeout_ms,
        hosts=args.allow_host,
    )
    sys.stdout.buffer.write(output)
    sys.stdout.buffer.flush()
    if message:
        print(message, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
