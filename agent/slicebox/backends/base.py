"""The backend interface: what the core asks of whatever runs a sandbox.

Everything above this interface (placement, policy, lineage, deadlines, telemetry, audit) is
backend-neutral; a backend only turns a :class:`SandboxRequest` into a running sandbox inside
the project slice it is given, runs execs in it, lists sandboxes by their labels and removes
them. ``docker`` (:mod:`slicebox.backends.docker`, Podman's compatible API too), ``native``
and ``wasm`` (systemd units on the host) and ``daytona`` (a remote API) implement the same
:class:`SandboxBackend`, each with its own :class:`~slicebox.model.spec.Backend` kind, and
:mod:`slicebox.backends.router` puts them behind one.

Errors are the slicebox tree (:mod:`slicebox.model.errors`), mapped inside each backend: a
backend that cannot be reached raises ``Unavailable``, an image that is neither present nor
obtainable ``ImageUnavailable``, a sandbox that cannot start ``InvalidRequest`` with code
``container_start_failed``, an exec on a missing or stopped sandbox ``SandboxNotFound`` /
``SandboxNotRunning``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

from pydantic import ConfigDict

from slicebox.model.base import Model
from slicebox.model.errors import InvalidRequest, Unavailable
from slicebox.model.exec import ExecRequest, ExecState, StreamChunk
from slicebox.model.limits import Limits
from slicebox.model.spec import Backend, Mount
from slicebox.model.wasm import WasmRun

if TYPE_CHECKING:
    from slicebox.host.plugins import PluginStore

T = TypeVar("T")

# The default exec cwd (``ExecRequest.cwd``): every backend makes it exist and writable.
WORKSPACE = "/workspace"
# The error code of a request for what the backend that runs it cannot give.
UNSUPPORTED = "backend_unsupported"
# The error code of a sandbox its backend made but could not start (nothing of it is left).
START_FAILED_CODE = "container_start_failed"


def mounts_workspace(mounts: Iterable[Mount]) -> bool:
    """Whether one of ``mounts`` is at /workspace (``/workspace/`` too)."""
    return any(m.target.rstrip("/") == WORKSPACE for m in mounts)


class Portal(Protocol):
    """How a backend that is async inside answers the blocking calls of
    :class:`SandboxBackend` (a create, a listing), which come from worker threads: it awaits
    ``make()`` on the agent's core loop and returns its result (``core.blocking.on_core_loop``,
    given by the composition root)."""

    def __call__(self, make: Callable[[], Awaitable[T]], /) -> T: ...


class Availability(Model):
    """Whether a backend can run sandboxes now and, when it cannot, why and what to do."""

    model_config = ConfigDict(frozen=True)

    kind: Backend
    available: bool
    detail: str  # what was found (a version, an endpoint) or what is wrong and the fix


class SandboxRequest(Model):
    """A sandbox to create and start, in backend-neutral terms (no backend's flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str  # the sandbox id; backends name their container/unit after it where they can
    image: str
    command: tuple[str, ...]
    labels: dict[str, str]
    slice: str  # the project slice unit the sandbox is placed in
    limits: Limits
    network: str = "none"
    # On the egress network (core.egress): its fixed address there, and its DNS servers.
    address: str | None = None
    dns: tuple[str, ...] = ()
    env: dict[str, str] = {}
    user: str | None = None
    workdir: str | None = None
    mounts: tuple[Mount, ...] = ()
    cap_add: tuple[str, ...] = ()  # capability names without CAP_, upper case
    # The main process's stdin stays open for one attach, closed when that attach closes its
    # side (a waiter's, ``core.launch``).
    open_stdin: bool = False
    backend: Backend = Backend.DOCKER  # the kind that runs it (backends.router)
    allow_jit: bool = False  # native: no MemoryDenyWriteExecute (config native_allow_jit)
    wasm: WasmRun | None = None  # backend wasm: the plugin its execs call (backends.wasm)
    # A fork's: /workspace is the image's own (a snapshot's, copy-on-write), not a tmpfs.
    workspace_in_image: bool = False


class SandboxState(StrEnum):
    """A sandbox's run state; Docker's own words, which the other backends map onto."""

    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    RESTARTING = "restarting"
    REMOVING = "removing"
    EXITED = "exited"
    DEAD = "dead"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, value: object) -> SandboxState:
        try:
            return cls(str(value))
        except ValueError:
            return cls.UNKNOWN


class SandboxInfo(Model):
    """One sandbox as its backend lists it: its backend id, name, labels and state."""

    model_config = ConfigDict(frozen=True)

    id: str  # the backend's id (Docker: the container id)
    name: str
    labels: dict[str, str]
    state: SandboxState
    image_id: str = ""  # the image it runs, where its backend says (Docker's ImageID)


class VolumeInfo(Model):
    """A named volume: its name, labels, and where its data lives on the host."""

    model_config = ConfigDict(frozen=True)

    name: str
    labels: dict[str, str]
    mountpoint: str  # the host directory (a local volume's); "" when the driver has none


class AsyncExecAttachment(Protocol):
    """One exec's attached output, already demultiplexed: a read waits on the event loop,
    holding no thread."""

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        """Output that arrived within ``timeout`` seconds ([] if none); None at end of stream."""

    def close(self) -> None:
        """Never blocks: it is called on the event loop."""


class StdinSource(Protocol):
    """An exec's stdin as it arrives (an upload's request body): the attachment asks for the
    next chunk only once the socket has taken the last, so a slow command slows the sender
    instead of filling the agent's memory."""

    async def read(self) -> bytes:
        """The next chunk (tens of KiB at most); b"" at the end."""


class ExecApi(Protocol):
    """The exec primitives :class:`slicebox.core.execution.ExecEngine` drives, each awaited on
    the running event loop: none holds a thread while it waits, and none waits for the command.
    A backend whose own calls block runs them off the loop behind these methods."""

    def sandbox_pid(self, backend_id: str) -> int:
        """Host pid of the running sandbox's init; SandboxNotFound / SandboxNotRunning."""

    async def exec_create(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        """Create an exec (not started) and return its id; ``streamed_stdin``: attach its stdin
        although ``request.stdin`` is empty, for a :class:`StdinSource` given at the start."""

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> AsyncExecAttachment:
        """Start the exec created by ``exec_create``, feed ``stdin`` (then EOF) and return its
        attached output. A :class:`StdinSource` is read as the command takes its stdin; its
        failure ends the attachment's next read with that error."""

    async def exec_inspect(self, exec_id: str) -> ExecState: ...

    async def launch_async(self, backend_id: str, stdin: bytes) -> AsyncExecAttachment:
        """Attach to the running sandbox's main process (a waiter, ``core.launch``), write
        ``stdin`` to it and close it, and return its output as an exec's attachment."""

    def has_host(self, backend_id: str) -> bool:
        """Whether the sandbox runs on this host (a cgroup, processes): a remote one does not,
        and nothing of it is looked for here (its cgroup, its deadline's timer)."""

    async def exec_kill(self, exec_id: str) -> bool:
        """Kill the exec, if this backend kills its own (a unit stopped, a remote call): True.
        False: it cannot (Docker cannot kill an exec), and the engine kills its processes in
        the sandbox's cgroup through the host."""


class SandboxBackend(ExecApi, Protocol):
    """A kind of sandbox: its lifecycle and listing, plus the exec primitives."""

    @property
    def kind(self) -> Backend: ...

    def availability(self) -> Availability:
        """Can this backend run sandboxes now (never raises)."""

    def resolve(self, kind: Backend, *, fallback: bool) -> Backend:
        """The kind of backend a create asking for ``kind`` runs on; ``backend_unavailable``
        when none can. ``fallback``: native in Docker's place when Docker is unavailable."""

    @property
    def wasm_plugins(self) -> PluginStore | None:
        """The wasm plugins the agent holds, when it runs wasm sandboxes; else None."""

    async def release(self, backend_id: str, line: bytes) -> None:
        """Write ``line`` to the running sandbox's waiter (``core.launch``) and close its
        stdin, reading none of its output (its logs keep it): a sandbox whose own command
        waits there until its mounts were verified (``core.creation``)."""

    def prepare(self, image: str) -> None:
        """Make ``image`` usable (present, or pulled); ImageUnavailable when it cannot be."""

    def create(self, request: SandboxRequest) -> SandboxInfo:
        """Create and start the sandbox; on failure nothing of it is left and the error is
        raised. An image that is not present is ``ImageUnavailable``: the core calls
        ``prepare`` only for an image it has not seen present, and again when a create says
        the image is gone."""

    async def inspect(self, backend_id: str) -> SandboxInfo | None:
        """A sandbox by backend id or name; None when there is none. Awaited on the loop: an
        exec looks its sandbox up first, and holds no thread for it."""

    def find(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        """Every sandbox (running or not) carrying all of ``labels``, in one listing call."""

    def remove(self, backend_id: str) -> bool:
        """Kill and remove; False when it was gone already or another removal has it."""

    def volume(self, name: str) -> VolumeInfo | None:
        """A named volume; None when there is none."""

    def create_volume(self, name: str, labels: Mapping[str, str]) -> VolumeInfo:
        """Make a local named volume with ``labels``."""

    def remove_volume(self, name: str) -> bool:
        """Remove a volume; False when it is gone already or a container still uses it."""

    def volumes(self, labels: Mapping[str, str]) -> list[VolumeInfo]:
        """Every volume carrying all of ``labels``, in one listing call."""


class NoVolumes:
    """The volume calls of a backend that has no named volumes: none is found, listed or
    removed, and a create is refused (``backend_unsupported``)."""

    @property
    def kind(self) -> Backend:
        raise NotImplementedError

    def volume(self, name: str) -> VolumeInfo | None:
        return None

    def create_volume(self, name: str, labels: Mapping[str, str]) -> VolumeInfo:
        raise InvalidRequest(f"the {self.kind.value} backend has no volumes", code=UNSUPPORTED)

    def remove_volume(self, name: str) -> bool:
        return False

    def volumes(self, labels: Mapping[str, str]) -> list[VolumeInfo]:
        return []


def resolve_own(own: Backend, kind: Backend) -> Backend:
    """``SandboxBackend.resolve`` of a backend that runs one kind only: ``own``."""
    if kind is not own:
        raise Unavailable(
            f"backend {kind.value!r} is not available on this host; use {own.value!r}",
            code="backend_unavailable",
        )
    return own


class Removal(StrEnum):
    """What the engine did with an image asked to go (``SnapshotEngine.remove_image``)."""

    REMOVED = "removed"  # the reference is gone, and the image with it when it was its last
    GONE = "gone"  # the engine has no such image
    # The engine refused (409) and keeps reference and image: a container uses the image (or,
    # asked by id, other references still name it).
    KEPT = "kept"


class SnapshotEngine(Protocol):
    """What pause, snapshots and forks ask of the engine (a fake in tests/fakes)."""

    def paused(self, container_id: str) -> bool: ...

    def pause(self, container_id: str) -> None: ...

    def unpause(self, container_id: str) -> None: ...

    def container(self, container_id: str) -> Mapping[str, Any]: ...

    def image_config(self, image: str) -> Mapping[str, Any]: ...

    def images(self, labels: Mapping[str, str]) -> list[Mapping[str, Any]]:
        """Every image carrying all of ``labels`` (untagged ones too), as the engine lists
        them: each an ``Id``, ``RepoTags``, ``Labels`` and ``Size``."""

    def tag_image(self, image_id: str, reference: str) -> None:
        """Give the image ``image_id`` the reference ``reference`` (repo:tag) too."""

    def remove_image(self, image: str) -> Removal:
        """Remove the reference ``image`` (or, by id, an untagged image), never by force:
        a reference that is its image's last, and a container runs that image, is kept."""

    def export(self, container_id: str, read: Callable[[BinaryIO], None]) -> None: ...

    def import_image(self, image: str, changes: list[str], body: Iterable[bytes]) -> None: ...
