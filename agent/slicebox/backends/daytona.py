"""The daytona backend: a sandbox that runs remotely, on a Daytona API, through its own SDK.

A daytona sandbox is a Daytona sandbox made from the request's image, with the request's
labels as its Daytona labels (plus ``slicebox.name``, the sandbox's name, which is how a look-up
by name finds it), its environment, cpus and memory rounded up to Daytona's whole CPUs and GiB,
and no network at all (``network_block_all``: the one network mode this backend gives). Its
backend id is ``daytona-`` then Daytona's id; an exec's id is ``daytona-exec-`` then a token
(:func:`is_daytona_id`, :func:`is_daytona_exec`), so a router tells them from the others by id.
There is no host pid, no waiter and no volume: those calls say ``backend_unsupported``.

**Execs** are Daytona's process execute, one HTTP call that answers with the exit code and the
command's output once it has ended, stdout and stderr combined as text (so it all arrives on
stdout, in one chunk, at the end; bytes that are not UTF-8 do not survive). The argv is run by a
small ``sh -c`` wrapper, started in ``/`` and quoted with :func:`shlex.join`, that

- takes its **stdin** from a file that the SDK's file API uploaded before (``/tmp/.slicebox-
  stdin-<token>``, streamed from a :class:`StdinSource` without holding it in memory), opened
  and unlinked before the command starts (deleted through the file API when the execute fails
  or is abandoned), or ``/dev/null`` when there is none;
- enters the request's **cwd** (``cd``, a path relative to ``/``), answering 126 with the
  shell's words when it is not there, as a native or Docker exec does;
- marks the command's environment with ``SLICEBOX_EXEC=<exec id>``, which its children
  inherit, so that a kill (another exec) finds and kills every process of the exec by it;
- ``exec``\\ s the argv with the request's env (Daytona's ``envs``).

Every path the wrapper names is relative to the ``/`` it starts in, so what it does depends
on Daytona's ``cwd`` alone (the local stand-in, ``tests.fakes.daytona``, maps that to a
directory of its own). ``/workspace``, the default cwd, is made at create by one such exec.

The SDK is imported when first needed: without it, :meth:`DaytonaBackend.availability` says
what to install and every other call is ``backend_unavailable``. The API key is a secret: it
is in no log line, message or repr of this module (what the SDK says is scrubbed of it).

Every call is written once, async, over the SDK's asyncio client: one per event loop, as its
HTTP session belongs to its loop. The awaited calls (inspect, the execs) use the running loop's;
the blocking ones of :class:`~slicebox.backends.base.SandboxBackend` (availability, create,
find, remove, usage), which worker threads call, await theirs through the
:class:`~slicebox.backends.base.Portal` the backend is given, on the agent's core loop, so
nothing waits on the agent's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import secrets
import shlex
import threading
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from slicebox.backends.base import (
    WORKSPACE,
    AsyncExecAttachment,
    Availability,
    Portal,
    SandboxInfo,
    SandboxRequest,
    SandboxState,
    StdinSource,
    VolumeInfo,
    resolve_own,
)
from slicebox.model.errors import (
    HostError,
    InvalidRequest,
    SandboxNotFound,
    SandboxNotRunning,
    SliceboxError,
    Unavailable,
)
from slicebox.model.exec import TIMEOUT_EXIT_CODE, ExecRequest, ExecState, OutputStream, StreamChunk
from slicebox.model.limits import INFINITY, Limits
from slicebox.model.spec import Backend

if TYPE_CHECKING:
    from slicebox.host.plugins import PluginStore

log = logging.getLogger(__name__)

ID_PREFIX = "daytona-"
EXEC_PREFIX = "daytona-exec-"
NAME_LABEL = "slicebox.name"
SDK_LABELS = frozenset({"code-toolbox-language", NAME_LABEL})  # bookkeeping, not the caller's
UNSUPPORTED = "backend_unsupported"
UNAVAILABLE = "backend_unavailable"
START_FAILED_CODE = "container_start_failed"
NO_SDK = "the daytona SDK is not installed: install slicebox[daytona]"
MARK = "SLICEBOX_EXEC"
STDIN_DIR = "/tmp"
GIB = 2**30
CREATE_TIMEOUT = 180.0  # seconds for Daytona to build (pull) the image and start the sandbox
CALL_TIMEOUT = 30.0  # seconds for one API call that is not an exec
SETUP_TIMEOUT = 30  # seconds for the exec that makes /workspace
KILL_TIMEOUT = 15  # seconds for the exec that kills another
# Daytona's own timeout of an exec runs this much past the request's: the engine's deadline
# (and its kill, exit code 124) comes first; Daytona's is the backstop of an exec the agent lost.
EXEC_BACKSTOP = 10
KEEP_ENDED = 1024  # ended execs whose state an inspect may still ask for
KILLED_EXIT_CODE = 137

# Daytona's states, as slicebox's (Docker's words); any other is unknown.
_STATES = {
    "started": SandboxState.RUNNING,
    "stopped": SandboxState.EXITED,
    "archived": SandboxState.EXITED,
    "error": SandboxState.DEAD,
    "build_failed": SandboxState.DEAD,
    "creating": SandboxState.CREATED,
    "starting": SandboxState.CREATED,
    "restoring": SandboxState.CREATED,
    "pending_build": SandboxState.CREATED,
    "building_snapshot": SandboxState.CREATED,
    "pulling_snapshot": SandboxState.CREATED,
    "pausing": SandboxState.PAUSED,
    "paused": SandboxState.PAUSED,
    "destroying": SandboxState.REMOVING,
    "destroyed": SandboxState.REMOVING,
    "unknown": SandboxState.UNKNOWN,
}

# Made at create, in "/": the default exec cwd, writable by the sandbox's user (who may need
# sudo to make it in "/").
WORKSPACE_SETUP = (
    "d=" + shlex.quote("." + WORKSPACE) + "; "
    'mkdir -p -- "$d" 2>/dev/null || sudo -n mkdir -p -- "$d"; '
    '[ -w "$d" ] || sudo -n chown "$(id -u):$(id -g)" -- "$d"; '
    '[ -d "$d" ] && [ -w "$d" ]'
)


def import_sdk() -> Any:
    """The daytona SDK's module, imported now; ImportError when it is not installed."""
    return importlib.import_module("daytona")


def is_daytona_id(backend_id: str) -> bool:
    """Whether a backend id is a daytona sandbox's (``daytona-<Daytona's id>``)."""
    return backend_id.startswith(ID_PREFIX) and not is_daytona_exec(backend_id)


def is_daytona_exec(exec_id: str) -> bool:
    """Whether an exec id is one this backend minted (``daytona-exec-<token>``)."""
    return exec_id.startswith(EXEC_PREFIX)


def daytona_id(backend_id: str) -> str:
    """Daytona's own id behind a daytona backend id."""
    return backend_id.removeprefix(ID_PREFIX)


def state_of(value: object) -> SandboxState:
    """A Daytona state (its enum or its word) as a :class:`SandboxState`."""
    word = getattr(value, "value", value)
    return _STATES.get(str(word), SandboxState.UNKNOWN)


def resources_of(limits: Limits) -> dict[str, int]:
    """Daytona's ``cpu`` (whole CPUs) and ``memory`` (GiB), each rounded up; a limit that is not
    set is left out, for Daytona's default."""
    resources: dict[str, int] = {}
    if limits.cpus > 0:
        resources["cpu"] = math.ceil(limits.cpus)
    if 0 < limits.memory_bytes < INFINITY:
        resources["memory"] = -(-limits.memory_bytes // GIB)
    return resources


def refusal(request: SandboxRequest) -> str | None:
    """What a daytona sandbox cannot give that ``request`` asks for; None when nothing."""
    if request.network != "none":
        return (
            f'network {request.network!r}: the daytona backend only supports network "none" '
            "(the sandbox has no network at all)"
        )
    if request.mounts:
        return "mounts, workspace volumes and credentials (a remote sandbox has no host paths)"
    if request.cap_add:
        return "cap_add"
    if request.open_stdin:
        return "a launched one-shot (its waiter)"
    if request.wasm is not None:
        return "a wasm plugin (ask for backend wasm)"
    return None


def exec_script(exec_id: str, request: ExecRequest, stdin_file: str | None) -> str:
    """The command line Daytona runs, in ``/``, for ``request`` (see the module docstring)."""
    steps = []
    if stdin_file is None:
        steps.append("exec </dev/null")
    else:
        here = shlex.quote("." + stdin_file)
        steps.append(f"exec <{here} || exit 126; rm -f -- {here}")
    steps.append(f"cd -- {shlex.quote('.' + request.cwd)} || exit 126")
    steps.append(f"{MARK}={shlex.quote(exec_id)}; export {MARK}")
    steps.append('exec "$@"')
    return shlex.join(["sh", "-c", "; ".join(steps), "sh", *request.argv])


def kill_script(exec_id: str) -> str:
    """Kill (SIGKILL) every process whose environment carries the exec's mark; exit 0."""
    mark = shlex.quote(f"{MARK}={exec_id}")
    return shlex.join(
        [
            "sh",
            "-c",
            "for d in /proc/[0-9]*; do "
            f"tr '\\0' '\\n' <\"$d/environ\" 2>/dev/null | grep -qx {mark} && "
            'kill -9 "${d#/proc/}" 2>/dev/null; '
            "done; exit 0",
        ]
    )


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def _kind_of(exc: BaseException, *names: str) -> bool:
    """Whether ``exc`` is one of the SDK's error classes named (matched by name: this module
    holds no import of the SDK)."""
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def _is_transport(exc: BaseException) -> bool:
    """A connection that failed or timed out, here or anywhere down the error's chain (the
    SDK wraps urllib3's and aiohttp's errors in a plain ``DaytonaError``)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        names = ("DaytonaConnectionError", "DaytonaTimeoutError", "MaxRetryError")
        if _kind_of(cause, *names) or isinstance(cause, OSError | TimeoutError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class ClientFactory(Protocol):
    """Makes the SDK's asyncio client, ``daytona.AsyncDaytona`` (what the backend does
    without one)."""

    def __call__(self, *, api_url: str, api_key: str, target: str | None) -> Any: ...


class _Key:
    """The API key, which no repr, str or log line shows."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__


class _Exec:
    """One exec: where it runs and, once started, how it is doing."""

    def __init__(self, daytona_id: str, request: ExecRequest, sandbox: Any) -> None:
        self.daytona_id = daytona_id
        self.request = request
        self.sandbox = sandbox  # the SDK's AsyncSandbox its create found running
        self.started = False
        self.running = False
        self.exit_code: int | None = None
        self.verdict: str | None = None


class DaytonaBackend:
    """:class:`~slicebox.backends.base.SandboxBackend` on a Daytona API; ``portal`` awaits
    the blocking calls' coroutines on the agent's core loop."""

    def __init__(
        self,
        api_url: str,
        api_key: str,
        target: str | None = None,
        *,
        portal: Portal,
        client_factory: ClientFactory | None = None,
    ) -> None:
        self._api_url = api_url
        self._key = _Key(api_key)
        self._target = target
        self._portal = portal
        self._factory = client_factory
        self._lock = threading.Lock()
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]
        self._clients = weakref.WeakKeyDictionary()
        self._execs: dict[str, _Exec] = {}

    def __repr__(self) -> str:
        return f"DaytonaBackend(api_url={self._api_url!r}, target={self._target!r})"

    @property
    def kind(self) -> Backend:
        return Backend.DAYTONA

    # --- the SDK and its client -----------------------------------------------------------------

    def _sdk(self) -> Any:
        try:
            return import_sdk()
        except ImportError:
            raise Unavailable(NO_SDK, code=UNAVAILABLE) from None

    def _make(self) -> Any:
        sdk = self._sdk()
        try:
            if self._factory is not None:
                return self._factory(
                    api_url=self._api_url, api_key=self._key.value, target=self._target
                )
            config = sdk.DaytonaConfig(
                api_key=self._key.value, api_url=self._api_url, target=self._target
            )
            return sdk.AsyncDaytona(config)
        except SliceboxError:
            raise
        except Exception as exc:
            raise self._failure(exc, "making its client") from None

    def _client(self) -> Any:
        """The running loop's asyncio client, made at its first call there (its HTTP session
        belongs to that loop)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.get(loop)
            if client is None:
                client = self._clients[loop] = self._make()
            return client

    def _scrub(self, text: str) -> str:
        return text.replace(self._key.value, "***") if self._key.value else text

    def _failure(self, exc: BaseException, what: str) -> SliceboxError:
        """An SDK error as the slicebox error it means, its text scrubbed of the key (one of
        slicebox's own, such as the SDK missing, as it is)."""
        if isinstance(exc, SliceboxError):
            return exc
        text = self._scrub(str(exc)) or type(exc).__name__
        status = _status(exc)
        if status == 404:
            return SandboxNotFound(f"no such Daytona sandbox ({what}): {text}")
        if status in (401, 403):
            return Unavailable(
                f"the Daytona API at {self._api_url} refused the API key on {what}: {text}; "
                "check the key and its organization",
                code=UNAVAILABLE,
            )
        if _is_transport(exc) or (status is not None and (status >= 500 or status == 429)):
            return Unavailable(
                f"the Daytona API at {self._api_url} did not answer {what}: {text}; "
                "check the API URL and the network to it",
                code=UNAVAILABLE,
            )
        where = f" (HTTP {status})" if status is not None else ""
        return HostError(f"the Daytona API failed on {what}{where}: {text}")

    # --- availability ---------------------------------------------------------------------------

    def resolve(self, kind: Backend, *, fallback: bool) -> Backend:
        return resolve_own(self.kind, kind)

    @property
    def wasm_plugins(self) -> PluginStore | None:
        return None

    def has_host(self, backend_id: str) -> bool:
        """A remote sandbox: no cgroup, no process, no timer of it on this host."""
        return False

    def availability(self) -> Availability:
        try:
            sdk = import_sdk()
        except ImportError:
            return Availability(kind=self.kind, available=False, detail=NO_SDK)
        return self._portal(lambda: self._availability(sdk))

    async def _availability(self, sdk: Any) -> Availability:
        try:
            query = sdk.ListSandboxesQuery(limit=1)
            listing = self._client().list(query, request_timeout=CALL_TIMEOUT)
            async with contextlib.aclosing(listing):
                async for _ in listing:
                    break
        except Exception as exc:  # never raises: what is wrong, and what to check
            detail = self._scrub(str(exc)) or type(exc).__name__
            return Availability(
                kind=self.kind,
                available=False,
                detail=f"the Daytona API at {self._api_url} does not answer a listing: {detail}; "
                "check the API URL, the API key and the network to it",
            )
        target = f", target {self._target}" if self._target else ""
        return Availability(
            kind=self.kind, available=True, detail=f"Daytona API at {self._api_url}{target}"
        )

    def prepare(self, image: str) -> None:
        """Nothing to prepare here: Daytona pulls the image (builds its snapshot) at create."""

    # --- lifecycle ------------------------------------------------------------------------------

    def create(self, request: SandboxRequest) -> SandboxInfo:
        return self._portal(lambda: self._create(request))

    async def _create(self, request: SandboxRequest) -> SandboxInfo:
        refused = refusal(request)
        if refused is not None:
            raise InvalidRequest(f"the daytona backend cannot give {refused}", code=UNSUPPORTED)
        sdk = self._sdk()
        client = self._client()
        resources = resources_of(request.limits)
        params = sdk.CreateSandboxFromImageParams(
            name=request.name,
            image=request.image,
            env_vars=dict(request.env) or None,
            labels={**request.labels, NAME_LABEL: request.name},
            network_block_all=True,
            resources=sdk.Resources(**resources) if resources else None,
        )
        try:
            sandbox = await client.create(params, timeout=CREATE_TIMEOUT)
        except Exception as exc:
            # The SDK may have made it before it failed (a start that failed, a wait that
            # timed out): whatever carries its name goes.
            await self._discard_named(request.name)
            error = self._failure(exc, f"the create of {request.name}")
            if isinstance(error, HostError | SandboxNotFound):
                error = InvalidRequest(
                    f"Daytona could not create the sandbox from image {request.image!r}: "
                    f"{error.message}",
                    code=START_FAILED_CODE,
                )
            raise error from None
        try:
            await self._make_workspace(sandbox)
            return self._info(sandbox)
        except BaseException:
            await self._discard(sandbox)
            raise

    async def _make_workspace(self, sandbox: Any) -> None:
        try:
            answer = await sandbox.process.exec(WORKSPACE_SETUP, cwd="/", timeout=SETUP_TIMEOUT)
        except Exception as exc:
            raise self._failure(exc, "making /workspace") from None
        if answer.exit_code != 0:
            said = self._scrub(str(answer.result or "")).strip()[-500:]
            raise InvalidRequest(
                f"the sandbox started but could not make {WORKSPACE} writable "
                f"(exit code {answer.exit_code}: {said or 'no output'}); "
                "its image needs a user that may, or sudo",
                code=START_FAILED_CODE,
            )

    async def _discard(self, sandbox: Any) -> None:
        try:
            await sandbox.delete(timeout=CALL_TIMEOUT)
        except Exception as exc:
            if _status(exc) != 404:
                log.warning(
                    "daytona sandbox %s could not be deleted: %s", sandbox.id, self._scrub(str(exc))
                )

    async def _discard_named(self, name: str) -> None:
        try:
            for sandbox in await self._listed({NAME_LABEL: name}):
                await self._discard(sandbox)
        except Exception as exc:
            log.warning(
                "daytona sandboxes named %s could not be listed for deletion: %s",
                name,
                self._scrub(str(exc)),
            )

    def _info(self, sandbox: Any) -> SandboxInfo:
        labels = {str(k): str(v) for k, v in (getattr(sandbox, "labels", None) or {}).items()}
        return SandboxInfo(
            id=ID_PREFIX + str(sandbox.id),
            name=labels.get(NAME_LABEL) or str(sandbox.name),
            labels={k: v for k, v in labels.items() if k not in SDK_LABELS},
            state=state_of(getattr(sandbox, "state", None)),
        )

    async def _get(self, backend_id: str) -> Any | None:
        """The SDK's AsyncSandbox behind a backend id (or a name); None when there is none."""
        client = self._client()
        try:
            if is_daytona_id(backend_id):
                return await client.get(daytona_id(backend_id), request_timeout=CALL_TIMEOUT)
            query = self._sdk().ListSandboxesQuery(labels={NAME_LABEL: backend_id})
            listing = client.list(query, request_timeout=CALL_TIMEOUT)
            async with contextlib.aclosing(listing):
                async for sandbox in listing:
                    if (sandbox.labels or {}).get(NAME_LABEL) == backend_id:
                        return sandbox
            return None
        except Exception as exc:
            if _status(exc) == 404:
                return None
            raise self._failure(exc, f"a look-up of {backend_id}") from None

    async def inspect(self, backend_id: str) -> SandboxInfo | None:
        sandbox = await self._get(backend_id)
        return None if sandbox is None else self._info(sandbox)

    async def _listed(self, labels: Mapping[str, str]) -> list[Any]:
        query = self._sdk().ListSandboxesQuery(labels=dict(labels) or None)
        try:
            listing = self._client().list(query, request_timeout=CALL_TIMEOUT)
            found = [sandbox async for sandbox in listing]
        except Exception as exc:
            raise self._failure(exc, "a listing") from None
        # Daytona filters by the labels already; this only guards against an API that did not.
        return [
            sandbox
            for sandbox in found
            if all((sandbox.labels or {}).get(key) == value for key, value in labels.items())
        ]

    def find(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        return self._portal(lambda: self._find(labels))

    async def _find(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        return [self._info(sandbox) for sandbox in await self._listed(labels)]

    def remove(self, backend_id: str) -> bool:
        return self._portal(lambda: self._remove(backend_id))

    async def _remove(self, backend_id: str) -> bool:
        sandbox = await self._get(backend_id)
        if sandbox is None:
            return False
        try:
            await sandbox.delete(timeout=CALL_TIMEOUT)
        except Exception as exc:
            if _status(exc) == 404:
                return False
            raise self._failure(exc, f"the removal of {backend_id}") from None
        return True

    def usage(self, backend_id: str) -> dict[str, float | None]:
        """What Daytona allocated the sandbox (not what it uses now): ``cpus``, and
        ``memory_bytes`` and ``disk_bytes`` from its GiB; None for what it does not say."""
        return self._portal(lambda: self._usage(backend_id))

    async def _usage(self, backend_id: str) -> dict[str, float | None]:
        sandbox = await self._get(backend_id)
        if sandbox is None:
            raise SandboxNotFound(f"no daytona sandbox {backend_id}")

        def figure(name: str, unit: int) -> float | None:
            value = getattr(sandbox, name, None)
            if isinstance(value, bool) or not isinstance(value, int | float):
                return None
            return float(value * unit)

        return {
            "cpus": figure("cpu", 1),
            "memory_bytes": figure("memory", GIB),
            "disk_bytes": figure("disk", GIB),
        }

    # --- volumes: none --------------------------------------------------------------------------

    def volume(self, name: str) -> VolumeInfo | None:
        return None

    def create_volume(self, name: str, labels: Mapping[str, str]) -> VolumeInfo:
        raise InvalidRequest("the daytona backend has no volumes", code=UNSUPPORTED)

    def remove_volume(self, name: str) -> bool:
        return False

    def volumes(self, labels: Mapping[str, str]) -> list[VolumeInfo]:
        return []

    # --- exec -----------------------------------------------------------------------------------

    def sandbox_pid(self, backend_id: str) -> int:
        raise InvalidRequest(
            "a daytona sandbox runs remotely: it has no host pid", code=UNSUPPORTED
        )

    async def launch_async(self, backend_id: str, stdin: bytes) -> AsyncExecAttachment:
        raise InvalidRequest("a daytona sandbox has no waiter to launch into", code=UNSUPPORTED)

    async def release(self, backend_id: str, line: bytes) -> None:
        raise InvalidRequest("a daytona sandbox has no waiter to release", code=UNSUPPORTED)

    def _running(self, backend_id: str, sandbox: Any | None) -> Any:
        if sandbox is None:
            raise SandboxNotFound(f"no daytona sandbox {backend_id}")
        if state_of(sandbox.state) is not SandboxState.RUNNING:
            raise SandboxNotRunning(f"daytona sandbox {backend_id} is not running")
        return sandbox

    def _mint(self, sandbox: Any, request: ExecRequest) -> str:
        exec_id = f"{EXEC_PREFIX}{secrets.token_hex(8)}"
        with self._lock:
            self._execs[exec_id] = _Exec(str(sandbox.id), request, sandbox)
        return exec_id

    async def exec_create(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        return self._mint(self._running(backend_id, await self._get(backend_id)), request)

    def _start(self, exec_id: str) -> _Exec:
        with self._lock:
            run = self._execs.get(exec_id)
            if run is None:
                raise SandboxNotFound(f"no daytona exec {exec_id}")
            if run.started:
                raise InvalidRequest(f"daytona exec {exec_id} was started already")
            run.started = run.running = True
        return run

    def _end(self, run: _Exec, exit_code: int | None, verdict: str | None = None) -> None:
        with self._lock:
            run.running = False
            run.exit_code = exit_code
            run.verdict = verdict
            ended = [
                key for key, known in self._execs.items() if known.started and not known.running
            ]
            for key in ended[: max(0, len(ended) - KEEP_ENDED)]:
                del self._execs[key]

    def _answer(self, run: _Exec, answer: Any) -> bytes:
        code = answer.exit_code
        self._end(run, code if isinstance(code, int) else None)
        return str(answer.result or "").encode()

    def _timed_out(self, run: _Exec, exc: BaseException) -> bool:
        if _kind_of(exc, "DaytonaTimeoutError") or _status(exc) == 408:
            self._end(run, TIMEOUT_EXIT_CODE, "timeout")
            return True
        return False

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> AsyncExecAttachment:
        run = self._start(exec_id)
        sandbox = run.sandbox

        async def attempt() -> bytes:
            """Upload and execute; the stdin file removed again when it fails (or is cancelled)."""
            stdin_file = None
            if not isinstance(stdin, bytes) or stdin:
                stdin_file = f"{STDIN_DIR}/.slicebox-stdin-{secrets.token_hex(8)}"
            try:
                if stdin_file is not None:
                    if isinstance(stdin, bytes):
                        await sandbox.fs.upload_file(stdin, stdin_file)
                    else:
                        await sandbox.fs.upload_file_stream(_chunks(stdin), stdin_file)
                script = exec_script(exec_id, run.request, stdin_file)
                answer = await sandbox.process.exec(
                    script, cwd="/", env=run.request.env or None, timeout=_exec_timeout(run)
                )
                return self._answer(run, answer)
            except BaseException:
                if stdin_file is not None:  # the command may never have read (and removed) it
                    with contextlib.suppress(Exception):
                        await sandbox.fs.delete_file(stdin_file)
                raise

        async def work() -> bytes:
            try:
                return await attempt()
            except asyncio.CancelledError:
                self._end(run, None)
                raise
            except SliceboxError:
                self._end(run, None)
                raise
            except Exception as exc:
                if self._timed_out(run, exc):
                    return b""
                self._end(run, None)
                raise self._failure(exc, f"exec {exec_id}") from None

        return _TaskRun(asyncio.get_running_loop().create_task(work()))

    def _state(self, exec_id: str) -> ExecState:
        with self._lock:
            run = self._execs.get(exec_id)
            if run is None:
                raise SandboxNotFound(f"no daytona exec {exec_id}")
            return ExecState(
                pid=0, running=run.running, exit_code=run.exit_code, verdict=run.verdict
            )

    async def exec_inspect(self, exec_id: str) -> ExecState:
        return self._state(exec_id)

    def _killable(self, exec_id: str) -> _Exec | None:
        with self._lock:
            run = self._execs.get(exec_id)
        return run if run is not None and run.running else None

    async def exec_kill(self, exec_id: str) -> bool:
        """Best effort: another exec kills every process carrying the exec's mark; the exec's
        own call then answers with the killed command's code. False when that could not run."""
        run = self._killable(exec_id)
        if run is None:
            return False
        try:
            client = self._client()
            sandbox = await client.get(run.daytona_id, request_timeout=CALL_TIMEOUT)
            answer = await sandbox.process.exec(kill_script(exec_id), cwd="/", timeout=KILL_TIMEOUT)
        except Exception as exc:
            log.warning("daytona exec %s could not be killed: %s", exec_id, self._scrub(str(exc)))
            return False
        return bool(answer.exit_code == 0)

    # --- closing --------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close every client this backend made (their HTTP sessions), each on its own loop:
        the running loop's here, the core loop's handed to it. A client of a loop that has
        ended is dropped with it; the next call makes a new one."""
        here = asyncio.get_running_loop()
        with self._lock:
            held = list(self._clients.items())
            self._clients.clear()
        for loop, client in held:
            if loop is here:
                await client.close()
            elif loop.is_running():
                closed = asyncio.run_coroutine_threadsafe(client.close(), loop)
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(CALL_TIMEOUT):
                        await asyncio.wrap_future(closed)


def _exec_timeout(run: _Exec) -> int:
    return math.ceil(run.request.timeout) + EXEC_BACKSTOP


async def _chunks(source: StdinSource) -> AsyncIterator[bytes]:
    """A :class:`StdinSource` as the async iterable the SDK's streamed upload takes."""
    while chunk := await source.read():
        yield chunk


def _output(data: bytes) -> list[StreamChunk]:
    return [StreamChunk(stream=OutputStream.STDOUT, data=data)] if data else []


class _TaskRun:
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
        return _output(output) or None

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
