"""The ``wasm`` backend: Extism plugins run in a native sandbox's slice, bounded by the kernel.

A wasm sandbox is a native sandbox (``backends.native``: its own slice under the project
slice with the sandbox's memory, cpu and pids limits, an anchor, a dynamic user, no
capability) whose request carries a :class:`~slicebox.model.wasm.WasmRun`. Each exec in it is
one plugin call: ``argv`` is ``[function]``, stdin the input. The exec's unit runs the worker
(``backends.wasmrun``) instead of a command, with the module framed ahead of the input on its
stdin, so the plugin's host process sits in the sandbox's slice: the kernel's ceilings bound
it, its memory shows in the level tree, a stop of the unit ends it. Inside it Extism bounds
the plugin itself: ``max_pages`` from the sandbox's memory limit, ``timeout_ms`` from the
exec's timeout, ``allowed_hosts`` from its network (none: no host), no path of the host's.

Seen from above, a wasm exec is an exec: caps, truncation, streaming, audit; its timeout
answers 124 and ``timed_out``, a plugin past its pages ``oom_killed`` (the worker's exit status
says which, and the native backend turns it into the exec's verdict).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from slicebox.backends.base import Availability
from slicebox.model.errors import InvalidRequest
from slicebox.model.exec import ExecRequest
from slicebox.model.spec import Backend
from slicebox.model.wasm import EXIT_OOM, EXIT_TIMEOUT, FUNCTION, WasmRun

WORKER = "slicebox.backends.wasmrun"
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


def worker_argv(run: WasmRun, request: ExecRequest) -> list[str]:
    timeout_ms = max(1, int(request.timeout * 1000))
    argv = [sys.executable, "-B", "-m", WORKER, "--function", function_of(request)]
    argv += ["--timeout-ms", str(timeout_ms), "--max-pages", str(run.max_pages)]
    for host in run.allowed_hosts:
        argv += ["--allow-host", host]
    return argv


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
    """What a worker's own exit status says (its unit exited; not a kill by signal)."""
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
