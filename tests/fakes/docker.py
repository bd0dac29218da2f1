"""An in-memory :class:`slicebox.backends.base.SandboxBackend` that fails the way Docker does.

- an image of its ``registry`` is pulled on the event loop with progress (``pull``); one
  that is not there raises ``image_unavailable``, a ``pull_error`` is a registry's failure;
- a create whose name is taken raises what the adapter maps Docker's 409 to
  (``sandbox_name_conflict``); an image that is not present raises ``image_unavailable``;
- a start that fails (``fail_start``) removes the container and raises ``container_start_failed``;
- removing a missing container answers False; removing one another removal holds
  (:meth:`FakeDocker.begin_removal`) answers False too (Docker's 409 "removal ... already in
  progress"), and the container stays until that removal finishes;
- a volume a container still mounts is not removed (False, as Docker's 409 "in use" maps);
- exec on a missing container raises ``sandbox_not_found``, on a stopped one
  ``sandbox_not_running``; the exec itself is scripted by a ``FakeExecApi``.

Running containers get a scope in FakeSystemd below their slice, as Docker's systemd cgroup
driver makes one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from slicebox.backends.base import (
    AsyncExecAttachment,
    Availability,
    SandboxInfo,
    SandboxRequest,
    SandboxState,
    StdinSource,
    VolumeInfo,
    resolve_own,
)
from slicebox.host.plugins import PluginStore
from slicebox.model.errors import (
    HostError,
    ImageUnavailable,
    InvalidRequest,
    SandboxNotFound,
    SandboxNotRunning,
    Unavailable,
)
from slicebox.model.exec import ExecRequest, ExecState
from slicebox.model.labels import VolumeLineage
from slicebox.model.names import scope_name
from slicebox.model.progress import LayerProgress, Phase, ProgressEvent
from slicebox.model.pulls import RegistryCredential
from slicebox.model.spec import Backend, MountKind
from tests.fakes.exec_fakes import FakeExecApi
from tests.fakes.onloop import ExecCallsOnLoop
from tests.fakes.systemd import FakeSystemd

LAYER = 24 << 20  # bytes of a pulled image's one layer
PULL_STEPS = 3


class FakeDocker(ExecCallsOnLoop):
    kind = Backend.DOCKER

    def __init__(
        self,
        systemd: FakeSystemd,
        images: set[str] | None = None,
        execs: FakeExecApi | None = None,
    ) -> None:
        self.systemd = systemd
        self.execs = execs
        self.images = images if images is not None else {"alpine:3.19"}
        self.registry: set[str] = set()  # what a pull can get
        self.pulls: list[str] = []  # what was pulled
        self.grants: list[RegistryCredential | None] = []  # the credentials each pull sent
        self.pull_gate: asyncio.Event | None = None
        self.pull_error: Exception | None = None
        self.containers: dict[str, SandboxInfo] = {}
        self.requests: dict[str, SandboxRequest] = {}
        self.released: list[tuple[str, bytes]] = []  # lines written to waiters (release)
        self.removed: list[str] = []
        self.fail_start = False
        self.down: str | None = None  # why the daemon is unreachable, when it is
        self.created = 0
        self.volume_table: dict[str, VolumeInfo] = {}
        self.volume_root = ""  # where volumes' data is said to live; "": no local directory

    def resolve(self, kind: Backend, *, fallback: bool) -> Backend:
        return resolve_own(self.kind, kind)

    @property
    def wasm_plugins(self) -> PluginStore | None:
        return None

    def availability(self) -> Availability:
        if self.down is not None:
            return Availability(kind=self.kind, available=False, detail=self.down)
        return Availability(kind=self.kind, available=True, detail="fake Docker")

    def prepare(self, image: str) -> None:
        if self._to_pull(image):
            self.images.add(image)

    def _to_pull(self, image: str) -> bool:
        """Whether ``image`` is to be pulled: not when present; unavailable when nowhere."""
        self._reachable()
        if image in self.images:
            return False
        if image not in self.registry:
            raise ImageUnavailable(f"image {image!r} cannot be pulled")
        return True

    async def pull(
        self,
        image: str,
        report: Callable[[ProgressEvent], None],
        timeout: float,
        grant: RegistryCredential | None = None,
    ) -> None:
        """``prepare`` as the real backend pulls, on the loop: an image of the registry is
        pulled in ``PULL_STEPS`` reports of its one layer (``LAYER`` bytes), ``pull_gate``
        (when set) held open until it is set; ``pull_error`` is a registry failing. The
        credentials each pull sent are in ``grants``."""
        if not self._to_pull(image):
            return
        self.pulls.append(image)
        self.grants.append(grant)
        for step in range(1, PULL_STEPS + 1):
            if step == 2 and self.pull_gate is not None:
                await self.pull_gate.wait()
            current = LAYER * step // PULL_STEPS
            layer = LayerProgress(id="l1", status="Downloading", current=current, total=LAYER)
            report(
                ProgressEvent(
                    phase=Phase.PULLING, subject=image, done=current, total=LAYER, layers=(layer,)
                )
            )
        if self.pull_error is not None:
            raise self.pull_error
        self.images.add(image)

    def create(self, request: SandboxRequest) -> SandboxInfo:
        self._reachable()
        if request.image not in self.images:
            raise ImageUnavailable(f"image of {request.name} not found")
        if any(info.name == request.name for info in self.containers.values()):
            raise HostError(f"a sandbox named {request.name} exists", code="sandbox_name_conflict")
        self.created += 1
        container_id = f"{self.created:064x}"
        self.requests[container_id] = request
        self.containers[container_id] = SandboxInfo(
            id=container_id, name=request.name, labels=request.labels, state=SandboxState.CREATED
        )
        if self.fail_start:
            self.remove(container_id)
            raise InvalidRequest("cannot start", code="container_start_failed")
        self._set_state(container_id, SandboxState.RUNNING)
        self.systemd.children.setdefault(request.slice, set()).add(scope_name(container_id))
        return self.containers[container_id]

    def look(self, backend_id: str) -> SandboxInfo | None:
        """``inspect``'s answer, at once (the fake's own look-ups and the tests')."""
        self._reachable()
        if backend_id in self.containers:
            return self.containers[backend_id]
        return next((i for i in self.containers.values() if i.name == backend_id), None)

    def find(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        self._reachable()
        return [
            info
            for info in self.containers.values()
            if all(info.labels.get(k) == v for k, v in labels.items())
        ]

    def remove(self, backend_id: str) -> bool:
        self._reachable()
        info = self.containers.get(backend_id)
        if info is None or info.state is SandboxState.REMOVING:
            return False
        self.finish_removal(backend_id)
        return True

    def begin_removal(self, backend_id: str) -> None:
        """Another caller starts removing the container (Docker marks it ``removing``)."""
        self._set_state(backend_id, SandboxState.REMOVING)

    def finish_removal(self, backend_id: str) -> None:
        self.containers.pop(backend_id)
        self.removed.append(backend_id)
        self._scope_stopped(backend_id)

    def stop(self, backend_id: str) -> None:
        """The container's main process exited (say, killed at its deadline)."""
        self._set_state(backend_id, SandboxState.EXITED)
        self._scope_stopped(backend_id)

    def _scope_stopped(self, backend_id: str) -> None:
        parent = self.requests[backend_id].slice
        self.systemd.children.get(parent, set()).discard(scope_name(backend_id))
        self.systemd.scope_stopped(scope_name(backend_id))

    # --- volumes ----------------------------------------------------------------------------

    def volume(self, name: str) -> VolumeInfo | None:
        self._reachable()
        return self.volume_table.get(name)

    def create_volume(self, name: str, labels: Mapping[str, str]) -> VolumeInfo:
        self._reachable()
        mountpoint = f"{self.volume_root}/{name}" if self.volume_root else ""
        made = VolumeInfo(name=name, labels=dict(labels), mountpoint=mountpoint)
        return self.volume_table.setdefault(name, made)

    def remove_volume(self, name: str) -> bool:
        self._reachable()
        users = [
            container_id
            for container_id in self.containers
            if any(
                m.kind is MountKind.VOLUME and m.source == name
                for m in self.requests[container_id].mounts
            )
        ]
        if users or name not in self.volume_table:
            return False
        del self.volume_table[name]
        return True

    def volumes(self, labels: Mapping[str, str]) -> list[VolumeInfo]:
        self._reachable()
        return [
            v
            for v in self.volume_table.values()
            if all(v.labels.get(k) == want for k, want in labels.items())
        ]

    # --- exec primitives ------------------------------------------------------------------

    def sandbox_pid(self, backend_id: str) -> int:
        info = self.look(backend_id)
        if info is None:
            raise SandboxNotFound(f"no sandbox {backend_id}: check the id")
        if info.state is not SandboxState.RUNNING:
            raise SandboxNotRunning(f"sandbox {backend_id} is not running ({info.state})")
        return 100

    def make_exec(self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False) -> str:
        self.sandbox_pid(backend_id)
        return self._execs().make_exec(backend_id, request, streamed_stdin)

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> AsyncExecAttachment:
        return await self._execs().exec_start(exec_id, stdin)

    def exec_state(self, exec_id: str) -> ExecState:
        return self._execs().exec_state(exec_id)

    async def release(self, backend_id: str, line: bytes) -> None:
        self.sandbox_pid(backend_id)
        if not self.requests[backend_id].open_stdin:
            raise HostError(f"sandbox {backend_id} has no stdin to attach to (not a waiter)")
        self.released.append((backend_id, line))

    async def launch_async(self, backend_id: str, stdin: bytes) -> AsyncExecAttachment:
        self.sandbox_pid(backend_id)
        if not self.requests[backend_id].open_stdin:
            raise HostError(f"sandbox {backend_id} has no stdin to attach to (not a waiter)")
        return await self._execs().launch_async(backend_id, stdin)

    async def inspect(self, backend_id: str) -> SandboxInfo | None:
        return self.look(backend_id)

    def _execs(self) -> FakeExecApi:
        if self.execs is None:
            raise HostError("this fake Docker has no exec script; pass execs=FakeExecApi(...)")
        return self.execs

    def _set_state(self, backend_id: str, state: SandboxState) -> None:
        info = self.containers[backend_id]
        self.containers[backend_id] = info.model_copy(update={"state": state})

    def _reachable(self) -> None:
        if self.down is not None:
            raise Unavailable(f"the Docker daemon is not reachable ({self.down})")


def volume_labels(user: str, root_task_id: str = "t0", *, keep: bool = False) -> dict[str, str]:
    """The labels of a workspace volume of ``user``'s (project ``p``)."""
    return VolumeLineage(
        user=user,
        project="p",
        root_task_id=root_task_id,
        sandbox_id="sbx-0",
        keep=keep,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    ).to_labels()
