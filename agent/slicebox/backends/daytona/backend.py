"""The daytona backend itself: :class:`DaytonaBackend`, every call written once, async, over
the SDK's asyncio client (see the package's docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from slicebox.backends.base import (
    START_FAILED_CODE,
    UNSUPPORTED,
    WORKSPACE,
    AsyncExecAttachment,
    Availability,
    NoVolumes,
    Portal,
    SandboxInfo,
    SandboxRequest,
    SandboxState,
    StdinSource,
    resolve_own,
)
from slicebox.backends.daytona.client import (
    CALL_TIMEOUT,
    NO_SDK,
    ClientFactory,
    DaytonaApi,
    import_sdk,
    status,
)
from slicebox.backends.daytona.execs import Execs, TaskRun, chunks
from slicebox.backends.daytona.scripts import STDIN_DIR, WORKSPACE_SETUP, exec_script, kill_script
from slicebox.backends.daytona.terms import (
    GIB,
    ID_PREFIX,
    NAME_LABEL,
    SDK_LABELS,
    daytona_id,
    is_daytona_id,
    refusal,
    resources_of,
    state_of,
)
from slicebox.model.errors import (
    HostError,
    InvalidRequest,
    SandboxNotFound,
    SandboxNotRunning,
    SliceboxError,
)
from slicebox.model.exec import ExecRequest, ExecState
from slicebox.model.spec import Backend

if TYPE_CHECKING:
    from slicebox.host.plugins import PluginStore

log = logging.getLogger(__name__)

CREATE_TIMEOUT = 180.0  # seconds for Daytona to build (pull) the image and start the sandbox
SETUP_TIMEOUT = 30  # seconds for the exec that makes /workspace
KILL_TIMEOUT = 15  # seconds for the exec that kills another


class DaytonaBackend(NoVolumes):
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
        self._api = DaytonaApi(api_url, api_key, target, client_factory)
        self._portal = portal
        self._execs = Execs()

    def __repr__(self) -> str:
        return f"DaytonaBackend(api_url={self._api.api_url!r}, target={self._api.target!r})"

    @property
    def kind(self) -> Backend:
        return Backend.DAYTONA

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
            listing = self._api.client().list(query, request_timeout=CALL_TIMEOUT)
            async with contextlib.aclosing(listing):
                async for _ in listing:
                    break
        except Exception as exc:  # never raises: what is wrong, and what to check
            detail = self._api.scrub(str(exc)) or type(exc).__name__
            return Availability(
                kind=self.kind,
                available=False,
                detail=f"the Daytona API at {self._api.api_url} does not answer a listing: "
                f"{detail}; check the API URL, the API key and the network to it",
            )
        target = f", target {self._api.target}" if self._api.target else ""
        return Availability(
            kind=self.kind, available=True, detail=f"Daytona API at {self._api.api_url}{target}"
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
        sdk = self._api.sdk()
        client = self._api.client()
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
            error = self._api.failure(exc, f"the create of {request.name}")
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
            raise self._api.failure(exc, "making /workspace") from None
        if answer.exit_code != 0:
            said = self._api.scrub(str(answer.result or "")).strip()[-500:]
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
            if status(exc) != 404:
                log.warning(
                    "daytona sandbox %s could not be deleted: %s",
                    sandbox.id,
                    self._api.scrub(str(exc)),
                )

    async def _discard_named(self, name: str) -> None:
        try:
            for sandbox in await self._listed({NAME_LABEL: name}):
                await self._discard(sandbox)
        except Exception as exc:
            log.warning(
                "daytona sandboxes named %s could not be listed for deletion: %s",
                name,
                self._api.scrub(str(exc)),
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
        client = self._api.client()
        try:
            if is_daytona_id(backend_id):
                return await client.get(daytona_id(backend_id), request_timeout=CALL_TIMEOUT)
            query = self._api.sdk().ListSandboxesQuery(labels={NAME_LABEL: backend_id})
            listing = client.list(query, request_timeout=CALL_TIMEOUT)
            async with contextlib.aclosing(listing):
                async for sandbox in listing:
                    if (sandbox.labels or {}).get(NAME_LABEL) == backend_id:
                        return sandbox
            return None
        except Exception as exc:
            if status(exc) == 404:
                return None
            raise self._api.failure(exc, f"a look-up of {backend_id}") from None

    async def inspect(self, backend_id: str) -> SandboxInfo | None:
        sandbox = await self._get(backend_id)
        return None if sandbox is None else self._info(sandbox)

    async def _listed(self, labels: Mapping[str, str]) -> list[Any]:
        query = self._api.sdk().ListSandboxesQuery(labels=dict(labels) or None)
        try:
            listing = self._api.client().list(query, request_timeout=CALL_TIMEOUT)
            found = [sandbox async for sandbox in listing]
        except Exception as exc:
            raise self._api.failure(exc, "a listing") from None
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
            if status(exc) == 404:
                return False
            raise self._api.failure(exc, f"the removal of {backend_id}") from None
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

    async def exec_create(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        return self._execs.mint(self._running(backend_id, await self._get(backend_id)), request)

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> AsyncExecAttachment:
        run = self._execs.start(exec_id)
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
                        await sandbox.fs.upload_file_stream(chunks(stdin), stdin_file)
                script = exec_script(exec_id, run.request, stdin_file)
                answer = await sandbox.process.exec(
                    script, cwd="/", env=run.request.env or None, timeout=run.timeout
                )
                return self._execs.answered(run, answer)
            except BaseException:
                if stdin_file is not None:  # the command may never have read (and removed) it
                    with contextlib.suppress(Exception):
                        await sandbox.fs.delete_file(stdin_file)
                raise

        async def work() -> bytes:
            try:
                return await attempt()
            except asyncio.CancelledError:
                self._execs.end(run, None)
                raise
            except SliceboxError:
                self._execs.end(run, None)
                raise
            except Exception as exc:
                if self._execs.timed_out(run, exc):
                    return b""
                self._execs.end(run, None)
                raise self._api.failure(exc, f"exec {exec_id}") from None

        return TaskRun(asyncio.get_running_loop().create_task(work()))

    async def exec_inspect(self, exec_id: str) -> ExecState:
        return self._execs.state(exec_id)

    async def exec_kill(self, exec_id: str) -> bool:
        """Best effort: another exec kills every process carrying the exec's mark; the exec's
        own call then answers with the killed command's code. False when that could not run."""
        run = self._execs.killable(exec_id)
        if run is None:
            return False
        try:
            client = self._api.client()
            sandbox = await client.get(run.daytona_id, request_timeout=CALL_TIMEOUT)
            answer = await sandbox.process.exec(kill_script(exec_id), cwd="/", timeout=KILL_TIMEOUT)
        except Exception as exc:
            log.warning(
                "daytona exec %s could not be killed: %s", exec_id, self._api.scrub(str(exc))
            )
            return False
        return bool(answer.exit_code == 0)

    # --- closing --------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the clients made (their HTTP sessions), each on its own loop: the agent's
        shutdown, or a test's end."""
        await self._api.aclose()
