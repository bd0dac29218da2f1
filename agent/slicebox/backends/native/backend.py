"""The native backend itself: :class:`NativeBackend`, what it asks of systemd, and its state.

It creates, lists and removes a sandbox's slice and anchor, runs each exec through the
sandbox's init with fresh pipes, in a scope of its own (or, in a wasm sandbox, as a call to
the sandbox's worker), and remembers what an exec's inspect after its end asks. What the
units are made of is ``units``, the wire to the init ``initwire``; the package's docstring
says what a native sandbox is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from slicebox.backends import wasm
from slicebox.backends.base import (
    START_FAILED_CODE,
    UNSUPPORTED,
    AsyncExecAttachment,
    Availability,
    NoVolumes,
    SandboxInfo,
    SandboxRequest,
    SandboxState,
    StdinSource,
    resolve_own,
)
from slicebox.backends.native import initwire
from slicebox.backends.native.claims import Claims, ProcClaims
from slicebox.backends.native.envfiles import ENV_DIR, EnvFiles
from slicebox.backends.native.initexec import InitExec
from slicebox.backends.native.names import (
    ANCHOR_PREFIX,
    EXEC_PREFIX,
    INIT_RUNTIME,
    INIT_SOCKET,
    anchor_unit,
    exec_scope,
    glob_literal,
    is_native_id,
    name_of,
    sandbox_name,
    sandbox_slice,
    unit_cgroup,
)
from slicebox.backends.native.pipes import read_whole
from slicebox.backends.native.units import (
    SHELL,
    RunAs,
    anchor_properties,
    describe,
    how_it_ended,
    labels_of,
    refusal,
    run_as_described,
    run_as_of,
    scope_properties,
    slice_properties,
)
from slicebox.host.plugins import PluginStore
from slicebox.host.systemd import ListedUnit, ServiceStatus
from slicebox.model.errors import (
    HostError,
    InvalidRequest,
    SandboxNotFound,
    SandboxNotRunning,
    SliceboxError,
)
from slicebox.model.exec import ExecRequest, ExecState
from slicebox.model.labels import PREFIX
from slicebox.model.limits import Property
from slicebox.model.names import escape
from slicebox.model.spec import Backend
from slicebox.model.wasm import WasmRun

T = TypeVar("T")


class NativeSystemd(Protocol):
    """What the native backend asks of systemd (``host.systemd.PystemdSystemd``)."""

    def start_transient(
        self, unit: str, properties: Sequence[Property], description: str
    ) -> None: ...

    def start_service(self, unit: str, properties: Mapping[str, Any], *, wait: bool) -> None: ...

    def service_status(self, unit: str) -> ServiceStatus | None: ...

    def listed(self, patterns: Sequence[str]) -> list[ListedUnit]: ...

    def stop(self, unit: str) -> None: ...

    def reset_failed(self, unit: str) -> None: ...

    def is_active(self, unit: str) -> bool: ...


class NativeBackend(NoVolumes):
    """:class:`~slicebox.backends.base.SandboxBackend` on systemd alone."""

    def __init__(
        self,
        systemd: NativeSystemd,
        *,
        env_dir: Path = ENV_DIR,
        which: Callable[[str], str | None] = shutil.which,
        workers: int = 4,
        plugins: PluginStore | None = None,
        wasm_runtime: Path = Path("/run") / wasm.RUNTIME,
        init_runtime: Path = Path("/run") / INIT_RUNTIME,
        claims: Claims | None = None,
    ) -> None:
        self._systemd = systemd
        self.plugins = plugins or PluginStore()
        self._wasm_runtime = wasm_runtime  # where each wasm sandbox's worker listens
        self._init_runtime = init_runtime  # where each native sandbox's init listens
        self._claims = claims or ProcClaims()
        self._calls: dict[str, wasm.Call] = {}  # wasm calls not ended
        self._running: dict[str, InitExec] = {}  # execs started, not ended
        self._starting: set[str] = set()  # execs whose process is not yet in its scope
        self._killed: set[str] = set()  # of those, the ones killed meanwhile
        self._env = EnvFiles(env_dir)
        self._which = which
        self._pending: dict[str, tuple[str, ExecRequest]] = {}  # created, not started
        self._ended: dict[str, ExecState] = {}
        self._run_as: dict[str, RunAs] = {}  # sandbox slice -> how its units run
        self._lock = threading.Lock()
        # D-Bus calls block (briefly): on threads of the backend's own, each with its bus.
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "native")

    @property
    def kind(self) -> Backend:
        return Backend.NATIVE

    def resolve(self, kind: Backend, *, fallback: bool) -> Backend:
        return resolve_own(self.kind, kind)

    @property
    def wasm_plugins(self) -> PluginStore | None:
        return self.plugins

    def has_host(self, backend_id: str) -> bool:
        return True

    def availability(self) -> Availability:
        if self._which("sleep") is None or not Path(SHELL).exists():
            detail = f"no `sleep` on PATH or no {SHELL}: a native sandbox runs the host's own"
            return Availability(kind=self.kind, available=False, detail=detail)
        try:
            self._systemd.is_active("slicebox.slice")
        except (SliceboxError, OSError) as exc:
            detail = f"systemd does not answer on the system bus: {exc}"
            return Availability(kind=self.kind, available=False, detail=detail)
        return Availability(
            kind=self.kind,
            available=True,
            detail="systemd transient units (DynamicUser, no network, ProtectSystem=strict)",
        )

    def prepare(self, image: str) -> None:
        """Nothing to prepare: a native sandbox runs the host's own programs, read-only."""

    # --- lifecycle ---------------------------------------------------------------------------

    def create(self, request: SandboxRequest) -> SandboxInfo:
        refused = refusal(request)
        if refused is not None:
            raise InvalidRequest(f"the native backend cannot give {refused}", code=UNSUPPORTED)
        name, unit = request.name, sandbox_slice(request.slice, request.name)
        anchor, run_as = anchor_unit(name), run_as_of(request)
        self._env.write(self._env.of_sandbox(name), request.env)
        try:
            described = describe(request.labels, run_as)
            self._systemd.start_transient(unit, slice_properties(request), described)
            env_file = self._env.of_sandbox(name)
            runtime = self._wasm_runtime if run_as.wasm is not None else self._init_runtime
            properties = anchor_properties(request, unit, run_as, env_file, runtime)
            self._systemd.start_service(anchor, properties, wait=True)
            status = self._systemd.service_status(anchor)
            if status is None or status.active_state not in ("active", "activating"):
                raise InvalidRequest(
                    f"the sandbox could not start: its command ended at once "
                    f"({how_it_ended(status)}); see `journalctl -u {anchor}`",
                    code=START_FAILED_CODE,
                )
            if run_as.wasm is not None:  # its first call finds the module compiled
                self._prepare(request.name, request.labels[f"{PREFIX}user"], run_as.wasm)
        except BaseException:
            self._discard(unit, name)
            raise
        with self._lock:
            self._run_as[unit] = run_as
        return SandboxInfo(id=unit, name=name, labels=request.labels, state=SandboxState.RUNNING)

    def _prepare(self, name: str, user: str, run: WasmRun) -> None:
        """Have a new wasm sandbox's worker compile its module; ``wasm_invalid`` when the
        runtime refuses it (nothing of the sandbox is left then)."""
        payload = wasm.prepare_request(run, self.plugins.get(user, run.sha256))
        status, _, message = wasm.call_blocking(wasm.socket_path(self._wasm_runtime, name), payload)
        if status != 0:
            raise InvalidRequest(f"the plugin cannot be run: {message}", code="wasm_invalid")

    def _inspect(self, backend_id: str) -> SandboxInfo | None:
        if is_native_id(backend_id):
            patterns = [glob_literal(backend_id), glob_literal(anchor_unit(name_of(backend_id)))]
            name = name_of(backend_id)
        else:
            name = backend_id
            patterns = [f"slicebox-*-{glob_literal(escape(name))}.slice"]
            patterns.append(glob_literal(anchor_unit(name)))
        found = [info for info in self._listed(patterns) if info.name == name]
        return found[0] if found else None

    async def inspect(self, backend_id: str) -> SandboxInfo | None:
        return await self._off_loop(self._inspect, backend_id)

    def find(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        found = self._listed(["slicebox-*.slice", f"{ANCHOR_PREFIX}*.service"])
        return [
            info
            for info in found
            if all(info.labels.get(key) == value for key, value in labels.items())
        ]

    def _listed(self, patterns: Sequence[str]) -> list[SandboxInfo]:
        units = self._systemd.listed(patterns)
        anchors = {unit.name: unit for unit in units if unit.name.startswith(ANCHOR_PREFIX)}
        found = []
        for unit in units:
            labels = labels_of(unit.description) if unit.name.endswith(".slice") else None
            if labels is None or unit.active_state not in ("active", "activating"):
                continue
            name = name_of(unit.name)
            anchor = anchors.get(anchor_unit(name))
            running = anchor is not None and anchor.active_state in ("active", "activating")
            state = SandboxState.RUNNING if running else SandboxState.EXITED
            found.append(SandboxInfo(id=unit.name, name=name, labels=labels, state=state))
        return found

    def remove(self, backend_id: str) -> bool:
        if not is_native_id(backend_id):
            return False
        name = name_of(backend_id)
        there = self._systemd.is_active(backend_id)
        self._discard(backend_id, name)
        return there

    def _discard(self, unit: str, name: str) -> None:
        """Stop the sandbox slice (every unit in it, its anchor's workspace with it) and forget
        what failed in it; nothing of the sandbox is left, whatever was made of it."""
        try:
            self._systemd.stop(unit)
        except HostError as exc:
            if exc.code != "no_such_unit":
                raise
        execs = f"{EXEC_PREFIX}{glob_literal(name)}-*"
        leftovers = self._systemd.listed(
            [glob_literal(anchor_unit(name)), f"{execs}.service", f"{execs}.scope"]
        )
        for listed in leftovers:  # what failed stays loaded until forgotten; the rest is gone
            if listed.active_state == "failed":
                self._systemd.reset_failed(listed.name)
        self._env.forget(name)
        with self._lock:
            self._run_as.pop(unit, None)

    # --- exec ----------------------------------------------------------------------------------

    def sandbox_pid(self, backend_id: str) -> int:
        name = sandbox_name(backend_id)
        status = self._systemd.service_status(anchor_unit(name))
        if status is None:
            raise SandboxNotFound(f"no native sandbox {name}")
        if status.active_state != "active" or status.main_pid <= 0:
            raise SandboxNotRunning(f"native sandbox {name} is not running")
        return status.main_pid

    def _exec_create(self, backend_id: str, request: ExecRequest) -> str:
        self.sandbox_pid(backend_id)  # SandboxNotFound / SandboxNotRunning, as Docker's
        if self._run_as_of(backend_id).wasm is not None:
            wasm.function_of(request)  # wasm_invalid before anything starts
        exec_id = exec_scope(sandbox_name(backend_id), secrets.token_hex(6))
        with self._lock:
            self._pending[exec_id] = (backend_id, request)
        return exec_id

    async def exec_create(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        return await self._off_loop(self._exec_create, backend_id, request)

    async def _start(self, exec_id: str, stdin: bool) -> tuple[int | None, int, int, socket.socket]:
        """Have the sandbox's init start the exec with fresh pipes, its process moved into
        the exec's scope before it runs the command; (stdin's write end, stdout's and stderr's
        read ends, the connection on which the init reports the end). The wire to the init is
        awaited on the loop (``initwire.handshake``): only the scope's start takes a thread."""
        with self._lock:
            backend_id, request = self._pending.pop(exec_id)
            self._starting.add(exec_id)
        ours: list[int] = []
        theirs: list[int] = []
        try:
            stdin_read, stdin_write = os.pipe() if stdin else (-1, -1)
            out_read, out_write = os.pipe()
            err_read, err_write = os.pipe()
            ours += [fd for fd in (stdin_write, out_read, err_read) if fd >= 0]
            theirs += [fd for fd in (stdin_read, out_write, err_write) if fd >= 0]
            order = initwire.Order(argv=request.argv, cwd=request.cwd, env=request.env, stdin=stdin)
            conn, pid = await self._handshake(backend_id, order, theirs)
        except BaseException:
            self._started(exec_id)
            for fd in ours + theirs:
                os.close(fd)
            raise
        for fd in theirs:
            os.close(fd)
        try:
            await self._off_loop(self._hand_over, backend_id, exec_id, pid)
            conn.send(initwire.GO)
        except BaseException:
            self._started(exec_id)  # a no-op where the hand-over ended the start itself
            for fd in ours:
                os.close(fd)
            conn.close()
            raise
        return (stdin_write if stdin else None), out_read, err_read, conn

    def _started(self, exec_id: str) -> bool:
        """The exec's start is over; whether it was killed meanwhile."""
        with self._lock:
            self._starting.discard(exec_id)
            killed = exec_id in self._killed
            self._killed.discard(exec_id)
        return killed

    async def _handshake(
        self, backend_id: str, order: initwire.Order, fds: list[int]
    ) -> tuple[socket.socket, int]:
        name = sandbox_name(backend_id)
        try:
            return await initwire.handshake(self._init_runtime, name, INIT_SOCKET, order, fds)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise SandboxNotRunning(
                f"native sandbox {name} has no init answering ({exc.strerror}): it was made by "
                "an older slicebox, or its init was killed; destroy it and create another"
            ) from exc
        except OSError as exc:
            raise HostError(f"native sandbox {name}'s init cannot be reached: {exc}") from exc

    def _hand_over(self, backend_id: str, exec_id: str, pid: int) -> None:
        """Move the child the kernel named into the exec's scope, if it is one of the
        sandbox's (``claims``); an exec killed meanwhile never gets its go."""
        anchor = unit_cgroup(backend_id, anchor_unit(sandbox_name(backend_id)))
        pidfd = self._claims.claim(pid, anchor)
        try:
            properties = scope_properties(backend_id, sandbox_name(backend_id), pidfd)
            self._systemd.start_service(exec_id, properties, wait=True)
        finally:
            os.close(pidfd)
        if self._started(exec_id):
            self._stop_exec(exec_id)
            raise initwire.InitError(f"exec {exec_id} was killed before it ran")

    def _run_as_of(self, backend_id: str) -> RunAs:
        """How the sandbox's units run: remembered from its create, else read from its slice
        (an agent restarted since)."""
        with self._lock:
            known = self._run_as.get(backend_id)
        if known is not None:
            return known
        listed = self._systemd.listed([glob_literal(backend_id)])
        found = run_as_described(listed[0].description) if listed else RunAs()
        with self._lock:
            self._run_as[backend_id] = found
        return found

    def _call_of(self, exec_id: str) -> WasmRun | None:
        """The plugin a pending exec calls (an exec in a wasm sandbox), else None."""
        with self._lock:
            backend_id = self._pending[exec_id][0]
        return self._run_as_of(backend_id).wasm

    def _wasm_request(self, exec_id: str, data: bytes) -> tuple[Path, bytes]:
        """The call's socket and what is sent on it: the request and the input."""
        with self._lock:
            backend_id, request = self._pending.pop(exec_id)
        run = self._run_as_of(backend_id).wasm
        assert run is not None
        payload = wasm.call_request(run, request, data)
        return wasm.socket_path(self._wasm_runtime, sandbox_name(backend_id)), payload

    def _ended_call(self, exec_id: str) -> Callable[[ExecState], None]:
        def ended(state: ExecState) -> None:
            self._end(exec_id, state)

        return ended

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> AsyncExecAttachment:
        if await self._off_loop(self._call_of, exec_id) is not None:
            data = stdin if isinstance(stdin, bytes) else await read_whole(stdin, wasm.MAX_INPUT)
            path, payload = await self._off_loop(self._wasm_request, exec_id, data)
            call = wasm.Call(path, payload, self._ended_call(exec_id))
            with self._lock:
                self._calls[exec_id] = call
            return call
        wants_stdin = not isinstance(stdin, bytes) or bool(stdin)
        stdin_fd, out_fd, err_fd, conn = await self._start(exec_id, wants_stdin)
        attachment = InitExec(asyncio.get_running_loop(), out_fd, err_fd, conn)
        with self._lock:
            self._running[exec_id] = attachment
        if stdin_fd is not None:
            attachment.feed(stdin_fd, stdin)
        return attachment

    def _exec_state(self, exec_id: str) -> ExecState:
        with self._lock:
            ended = self._ended.get(exec_id)
            calling = exec_id in self._calls
            running = self._running.get(exec_id)
        if ended is not None:
            return ended
        if calling:  # a wasm call, answered by the sandbox's worker
            return ExecState(pid=0, running=True, exit_code=None)
        if running is None:  # not this agent's, or forgotten long ago: no code to give
            return ExecState(pid=0, running=False, exit_code=None)
        report = running.report
        if report is None:
            return ExecState(pid=0, running=True, exit_code=None)
        return self._end(exec_id, ExecState(pid=0, running=False, exit_code=report.exit_code))

    async def exec_inspect(self, exec_id: str) -> ExecState:
        return await self._off_loop(self._exec_state, exec_id)

    def _stop_exec(self, exec_id: str) -> bool:
        """Stop the exec's scope: systemd kills every process in its cgroup (a fork bomb's
        included, SIGKILL to the cgroup) and returns once they are gone; what other execs
        left running is in their own scopes and lives on. A wasm call's connection is closed
        instead: its worker cancels the call."""
        with self._lock:
            call = self._calls.get(exec_id)
            if exec_id in self._starting:
                self._killed.add(exec_id)
        if call is not None:
            call.close()
            self._end(exec_id, ExecState(pid=0, running=False, exit_code=137))
            return True
        try:
            self._systemd.stop(exec_id)
        except HostError as exc:
            if exc.code != "no_such_unit":
                raise
        self._systemd.reset_failed(exec_id)
        self._end(exec_id, ExecState(pid=0, running=False, exit_code=137))
        return True

    async def exec_kill(self, exec_id: str) -> bool:
        with self._lock:
            calling = exec_id in self._calls
        if calling:  # closing a call's connection is the loop's to do
            return self._stop_exec(exec_id)
        return await self._off_loop(self._stop_exec, exec_id)

    def _end(self, exec_id: str, state: ExecState) -> ExecState:
        with self._lock:
            self._calls.pop(exec_id, None)
            running = self._running.pop(exec_id, None)
        if running is not None:
            running.hang_up_soon()
        with self._lock:
            if exec_id in self._ended:
                return self._ended[exec_id]  # the first end stands (a kill's, then its read)
            self._ended[exec_id] = state
            while len(self._ended) > 1024:  # what an inspect soon after the end asks
                del self._ended[next(iter(self._ended))]
        return state

    async def launch_async(self, backend_id: str, stdin: bytes) -> AsyncExecAttachment:
        raise InvalidRequest("a native sandbox has no waiter to launch into", code=UNSUPPORTED)

    async def release(self, backend_id: str, line: bytes) -> None:
        raise InvalidRequest("a native sandbox has no waiter to release", code=UNSUPPORTED)

    async def _off_loop(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
