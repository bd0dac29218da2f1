"""The backends of one agent behind the one interface the core asks of a backend.

The core (placement, lineage, the reaper, telemetry, exec) talks to one
:class:`~slicebox.backends.base.SandboxBackend`; :class:`Backends` is that, in front of Docker
the native backend (which runs wasm sandboxes too), and a Daytona API when one is configured.
What a call is for tells where it goes: a create by the kind its request names, anything else
by the id it carries (a native sandbox's id is its slice unit, ``….slice``, a native exec's
its scope, ``slicebox-exec-….scope``; a remote one's ``daytona-…``; a Docker container's
and exec's are hex). A look-up by name asks Docker, then systemd, then Daytona. A listing is
all of them; a Daytona that does not answer is left out of it, with a warning.

**Fallback, as the seeds do it**: a create for Docker while Docker does not answer runs on the
native backend instead, unless the configuration says ``allow_native_fallback = false``, in
which case it is refused ``backend_unavailable``. Docker's answer is remembered for a few
seconds, so a host without Docker does not pay a failed connection per create.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from slicebox.backends import wasm
from slicebox.backends.base import (
    AsyncExecAttachment,
    Availability,
    SandboxBackend,
    SandboxInfo,
    SandboxRequest,
    StdinSource,
    VolumeInfo,
)
from slicebox.backends.daytona import DaytonaBackend, is_daytona_exec, is_daytona_id
from slicebox.backends.native.backend import NativeBackend
from slicebox.backends.native.names import is_native_exec, is_native_id
from slicebox.host.plugins import PluginStore
from slicebox.model.errors import Unavailable
from slicebox.model.exec import ExecRequest, ExecState
from slicebox.model.spec import Backend

log = logging.getLogger(__name__)

AVAILABILITY_TTL = 5.0  # seconds an availability answer is kept


class Backends:
    """Docker and the native backend as one :class:`SandboxBackend`."""

    def __init__(
        self,
        docker: SandboxBackend,
        native: NativeBackend | None,
        clock: Callable[[], float] = time.monotonic,
        daytona: DaytonaBackend | None = None,
    ) -> None:
        self.docker = docker
        self.native = native
        self.daytona = daytona
        self._clock = clock
        self._lock = threading.Lock()
        self._known: dict[Backend, tuple[float, Availability]] = {}

    @property
    def kind(self) -> Backend:
        return self.docker.kind

    # --- which backend runs a create -----------------------------------------------------------

    def availabilities(self) -> list[Availability]:
        """Each backend's availability now, asked once as the agent starts: the engine's and
        Daytona's questions while systemd is asked, each a round trip to a service of its own,
        so the start waits for the slowest answer, not for their sum (docs/benchmarks.md)."""
        with ThreadPoolExecutor(2, thread_name_prefix="availability") as asking:
            docker = asking.submit(self._available, Backend.DOCKER, fresh=True)
            daytona = asking.submit(self._available, Backend.DAYTONA, fresh=True)
            local = []
            if self.native is not None:
                native = self._available(Backend.NATIVE, fresh=True)
                # wasm runs where native does: its answer is derived from the one just asked
                local = [native, self._available(Backend.WASM, fresh=True, native=native)]
            return [docker.result(), *local, daytona.result()]

    def resolve(self, kind: Backend, *, fallback: bool) -> Backend:
        """The backend a create asking for ``kind`` runs on; ``backend_unavailable`` when none
        can. ``fallback``: Docker unavailable -> native (the seeds' default)."""
        answer = self._available(kind)
        if answer.available:
            return kind
        if kind is Backend.DOCKER and fallback and self.native is not None:
            native = self._available(Backend.NATIVE)
            if native.available:
                log.warning("Docker is unavailable (%s): the sandbox runs native", answer.detail)
                return Backend.NATIVE
        hint = (
            "; set allow_native_fallback = true to run it native instead"
            if kind is Backend.DOCKER and not fallback and self.native is not None
            else ""
        )
        raise Unavailable(
            f"backend {kind.value!r} is not available on this host: {answer.detail}{hint}",
            code="backend_unavailable",
        )

    def _available(
        self, kind: Backend, *, fresh: bool = False, native: Availability | None = None
    ) -> Availability:
        if kind is Backend.DAYTONA and self.daytona is None:
            detail = "not configured on this agent: an operator sets [daytona] in its config"
            return Availability(kind=kind, available=False, detail=detail)
        if kind in (Backend.NATIVE, Backend.WASM) and self.native is None:
            return Availability(kind=kind, available=False, detail="not enabled on this agent")
        with self._lock:
            kept = self._known.get(kind)
        if kept is not None and not fresh and self._clock() - kept[0] < AVAILABILITY_TTL:
            return kept[1]
        if kind is Backend.DOCKER:
            answer = self.docker.availability()
        elif kind is Backend.DAYTONA:
            assert self.daytona is not None
            answer = self.daytona.availability()
        else:
            assert self.native is not None
            answer = self.native.availability() if native is None else native
            if kind is Backend.WASM:  # a wasm sandbox is a native one running the worker
                answer = wasm.availability(answer)
        with self._lock:
            self._known[kind] = (self._clock(), answer)
        return answer

    def _forget(self, kind: Backend) -> None:
        with self._lock:
            self._known.pop(kind, None)

    # --- SandboxBackend ------------------------------------------------------------------------

    def availability(self) -> Availability:
        return self._available(Backend.DOCKER, fresh=True)

    def prepare(self, image: str) -> None:
        self.docker.prepare(image)

    def create(self, request: SandboxRequest) -> SandboxInfo:
        if request.backend in (Backend.NATIVE, Backend.WASM):
            return self._native().create(request)
        if request.backend is Backend.DAYTONA:
            return self._daytona().create(request)
        try:
            return self.docker.create(request)
        except Unavailable:
            self._forget(Backend.DOCKER)
            raise

    def _native(self) -> NativeBackend:
        if self.native is None:
            raise Unavailable("the native backend is not enabled", code="backend_unavailable")
        return self.native

    def _daytona(self) -> DaytonaBackend:
        if self.daytona is None:
            raise Unavailable(
                "the daytona backend is not configured on this agent", code="backend_unavailable"
            )
        return self.daytona

    def _of(self, backend_id: str) -> SandboxBackend:
        if is_daytona_id(backend_id):
            return self._daytona()
        return self._native() if is_native_id(backend_id) else self.docker

    def _of_exec(self, exec_id: str) -> SandboxBackend:
        if is_daytona_exec(exec_id):
            return self._daytona()
        return self._native() if is_native_exec(exec_id) else self.docker

    @property
    def wasm_plugins(self) -> PluginStore | None:
        return self.native.plugins if self.native is not None else None

    def has_host(self, backend_id: str) -> bool:
        """Whether the sandbox runs on this host (a cgroup, processes): a remote one does not."""
        return not is_daytona_id(backend_id)

    async def inspect(self, backend_id: str) -> SandboxInfo | None:
        if is_daytona_id(backend_id):
            return await self._daytona().inspect(backend_id)
        if is_native_id(backend_id):
            return await self._native().inspect(backend_id)
        try:
            found = await self.docker.inspect(backend_id)
        except Unavailable:
            if self.native is None:
                raise
            found = None
        if found is None and self.native is not None:
            found = await self.native.inspect(backend_id)
        if found is None and self.daytona is not None:
            try:
                found = await self.daytona.inspect(backend_id)
            except Unavailable as exc:
                log.warning(
                    "Daytona is unavailable, %s is not looked for there: %s", backend_id, exc
                )
        return found

    def find(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        native = self.native.find(labels) if self.native is not None else []
        native += self._remote(labels)
        try:
            return self.docker.find(labels) + native
        except Unavailable as exc:
            if self.native is None:
                raise
            log.warning("Docker is unavailable, only native sandboxes are listed: %s", exc)
            return native

    def _remote(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        """Daytona's sandboxes with ``labels``; none (and a warning) while it does not answer:
        its sandboxes are listed again, and reaped, once it does."""
        if self.daytona is None:
            return []
        try:
            return self.daytona.find(labels)
        except Unavailable as exc:
            log.warning("Daytona is unavailable, its sandboxes are not listed: %s", exc)
            return []

    def remove(self, backend_id: str) -> bool:
        return self._of(backend_id).remove(backend_id)

    def volume(self, name: str) -> VolumeInfo | None:
        return self.docker.volume(name)

    def create_volume(self, name: str, labels: Mapping[str, str]) -> VolumeInfo:
        return self.docker.create_volume(name, labels)

    def remove_volume(self, name: str) -> bool:
        return self.docker.remove_volume(name)

    def volumes(self, labels: Mapping[str, str]) -> list[VolumeInfo]:
        try:
            return self.docker.volumes(labels)
        except Unavailable:
            if self.native is None:
                raise
            return []

    # --- ExecApi -------------------------------------------------------------------------------

    def sandbox_pid(self, backend_id: str) -> int:
        return self._of(backend_id).sandbox_pid(backend_id)

    async def exec_create(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        return await self._of(backend_id).exec_create(backend_id, request, streamed_stdin)

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> AsyncExecAttachment:
        return await self._of_exec(exec_id).exec_start(exec_id, stdin)

    async def exec_inspect(self, exec_id: str) -> ExecState:
        return await self._of_exec(exec_id).exec_inspect(exec_id)

    async def exec_kill(self, exec_id: str) -> bool:
        """A native or remote exec is killed by its backend; a Docker exec by the engine,
        through the host (``False``)."""
        if is_daytona_exec(exec_id):
            return await self._daytona().exec_kill(exec_id)
        return is_native_exec(exec_id) and await self._native().exec_kill(exec_id)

    async def launch_async(self, backend_id: str, stdin: bytes) -> AsyncExecAttachment:
        return await self._of(backend_id).launch_async(backend_id, stdin)

    async def release(self, backend_id: str, line: bytes) -> None:
        await self._of(backend_id).release(backend_id, line)
