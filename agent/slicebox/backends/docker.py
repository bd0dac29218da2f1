"""The Docker backend: the one adapter between slicebox and the Docker Engine.

:class:`DockerBackend` makes the Engine API calls: a sandbox's create and start, lookups and
removal (the heavy ones a few at once, see :data:`HEAVY_CALLS` and :data:`REMOVALS`), slicebox's
own bridge networks (inter-container traffic off), volumes, an exec's calls on the event loop,
and image pulls on the event loop (:mod:`slicebox.backends.dockerpull`).

What a request asks of Docker and what its answers say, as data, is
:mod:`slicebox.backends.dockerbody`'s; what the answers mean as slicebox errors is
:mod:`slicebox.backends.dockererrors`'s; exec output is read off the daemon's socket by
:mod:`slicebox.backends.dockerstream`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from ipaddress import IPv4Address, IPv4Network, ip_network
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from slicebox.backends.base import (
    START_FAILED_CODE,
    Availability,
    SandboxInfo,
    SandboxRequest,
    SandboxState,
    StdinSource,
    VolumeInfo,
    resolve_own,
)
from slicebox.backends.dockerapi import EngineApi, answer_json, message_of
from slicebox.backends.dockerbody import (
    BRIDGE,
    BRIDGE_NETWORK,
    create_body,
    exec_body,
    exec_state,
    inspected,
    label_filter,
    listed,
    segment,
    volume_info,
)
from slicebox.backends.dockerendpoint import DockerEndpoint
from slicebox.backends.dockererrors import (
    RemovalInProgress,
    engine_overrun,
    map_status,
    unpullable,
)
from slicebox.backends.dockerjson import DockerJsonApi
from slicebox.backends.dockerpull import Report, pull
from slicebox.backends.dockerstream import (
    AsyncRawExecAttachment,
    StartRefused,
    attach,
    attach_request,
    release,
)
from slicebox.backends.engines import FoundEngine, discover
from slicebox.model.errors import (
    HostError,
    ImageUnavailable,
    InvalidRequest,
    SandboxNotFound,
    SandboxNotRunning,
    SliceboxError,
)
from slicebox.model.exec import ExecRequest, ExecState
from slicebox.model.labels import MANAGED
from slicebox.model.names import DOCKER_SCOPES, PODMAN_SCOPES
from slicebox.model.pulls import RegistryCredential
from slicebox.model.spec import Backend

if TYPE_CHECKING:
    from slicebox.host.plugins import PluginStore

log = logging.getLogger(__name__)

# A busy daemon answers slowly, not never: docker-py's 60 s made a loaded host's creates fail
# as `unavailable` while Docker went on to make the container.
DOCKER_TIMEOUT = 300
# Container starts at once: beyond a few, Docker only gets slower at each (runc, the shim,
# systemd's scope); further callers wait their turn in the agent instead.
HEAVY_CALLS = 4
# Removals at once: as many as the agent's request threads (server.pools). A removal mostly
# waits (for the kill, the shim, the scope's stop), so fewer at once leave the CPUs idle that
# as many callers of Docker's own API would keep busy (docs/benchmarks.md).
REMOVALS = 8
# The pauses before a removal or a create is tried again after containerd ran out of its own
# time (dockererrors.engine_overrun): a host that busy needs seconds, not milliseconds.
OVERRUN_PAUSES = (1.0, 3.0, 9.0)


class DockerBackend:
    """:class:`slicebox.backends.base.SandboxBackend` over the Docker Engine API.

    Its threads' calls go through :class:`~slicebox.backends.dockerapi.EngineApi`, the event
    loop's through :class:`~slicebox.backends.dockerjson.DockerJsonApi`, both at the one API
    version the daemon said (``version`` presets it); images are pulled on the loop
    (``pull``; ``prepare`` runs it for a thread).
    """

    kind = Backend.DOCKER

    def __init__(
        self,
        endpoint: DockerEndpoint,
        version: str | None = None,
        found: FoundEngine | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._found = found or FoundEngine(endpoint=endpoint, source="given")
        self._podman = False  # Podman's Docker-compatible API, as its /version says
        self._engine = EngineApi(endpoint, map_status, DOCKER_TIMEOUT, version)
        self._json = DockerJsonApi(endpoint, map_status)  # an exec's calls, on the event loop
        self._heavy = threading.BoundedSemaphore(HEAVY_CALLS)
        self._removals = threading.BoundedSemaphore(REMOVALS)
        # Between tries on an overrun engine (tests set their own).
        self._sleep: Callable[[float], None] = time.sleep

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DockerBackend:
        """The engine :func:`~slicebox.backends.engines.discover` finds: DOCKER_HOST, the
        Docker context, else the first known socket that answers; TLS is refused."""
        found = discover(env)
        return cls(found.endpoint, found=found)

    @property
    def endpoint(self) -> DockerEndpoint:
        return self._endpoint

    @property
    def scope_prefix(self) -> str:
        """How the engine names a container's scope: Docker's ``docker``, Podman's ``libpod``
        (known once ``availability`` has asked the daemon)."""
        return PODMAN_SCOPES if self._podman else DOCKER_SCOPES

    @property
    def found(self) -> FoundEngine:
        """The engine in use and how it was found."""
        return self._found

    def resolve(self, kind: Backend, *, fallback: bool) -> Backend:
        return resolve_own(self.kind, kind)

    @property
    def wasm_plugins(self) -> PluginStore | None:
        return None

    def has_host(self, backend_id: str) -> bool:
        return True

    async def exec_kill(self, exec_id: str) -> bool:
        """Docker cannot kill an exec: the engine kills its processes through the host."""
        return False

    def availability(self) -> Availability:
        try:
            version = self._engine.daemon_version()
        except SliceboxError as exc:
            detail = f"{exc.message} (the engine: {self._found.describe()})"
            return Availability(kind=self.kind, available=False, detail=detail)
        # The API version calls use, from this same answer (else the first call asks again).
        if version.get("ApiVersion"):
            self._engine.settle(str(version["ApiVersion"]))
        components = version.get("Components") or []
        self._podman = any(str(part.get("Name", "")).startswith("Podman") for part in components)
        engine = "Podman" if self._podman else "Docker"
        detail = f"{engine} {version.get('Version')} (API {version.get('ApiVersion')})"
        where = self._found.describe()
        return Availability(kind=self.kind, available=True, detail=f"{detail} at {where}")

    def prepare(self, image: str) -> None:
        """``pull`` for a thread without a loop (the core pulls on its loop: ``core.pulls``),
        on a loop of its own for this call, its progress dropped."""

        async def pulled() -> None:
            try:
                await self.pull(image, lambda _: None, DOCKER_TIMEOUT)
            finally:
                await self._json.aclose()

        asyncio.run(pulled())

    async def pull(
        self, image: str, report: Report, timeout: float, grant: RegistryCredential | None = None
    ) -> None:
        """``prepare`` on the running loop, holding no thread: the pull's progress goes to
        ``report`` (:mod:`slicebox.backends.dockerpull`), for at most ``timeout`` seconds,
        sending ``grant``'s credentials (``model.pulls``) or none."""
        version = await self._api_version()
        if await self._has_image(version, image):
            return
        log.info("pulling %s", image)
        await pull(self._json, f"/v{version}/images/create", image, report, timeout, grant=grant)
        if not await self._has_image(version, image):
            raise unpullable(image, "the pull did not produce it")

    def create(self, request: SandboxRequest) -> SandboxInfo:
        if request.network == "bridge":
            self._ensure_isolated(BRIDGE_NETWORK, {"com.docker.network.bridge.name": BRIDGE})
        container_id, status, text = self._create_and_start(request)
        if status >= 300 and engine_overrun(text):
            log.warning("Docker ran out of its own time starting %s: once more", request.name)
            self._sleep(OVERRUN_PAUSES[0])
            container_id, status, text = self._create_and_start(request)
        if status < 300:
            state = SandboxState.RUNNING
            return SandboxInfo(
                id=container_id, name=request.name, labels=request.labels, state=state
            )
        if engine_overrun(text):
            raise HostError(
                f"Docker could not start the sandbox in its own time, twice ({message_of(text)}):"
                " the host is overloaded; retry the create later"
            )
        # The engine answers 400 or 500 alike when the request cannot run (no such user,
        # workdir or program): the caller's request is what needs changing.
        raise InvalidRequest(
            f"the sandbox could not start: {message_of(text)}; check image, command, user",
            code=START_FAILED_CODE,
        )

    def _create_and_start(self, request: SandboxRequest) -> tuple[str, int, str]:
        """The container made and started, a few at once: its id and the start's answer; one
        that did not start is removed again."""
        with self._heavy:
            container_id = str(self._create(request)["Id"])
            try:
                status, text = self._engine.request(
                    "POST", self._engine.versioned(f"/containers/{segment(container_id)}/start")
                )
            except BaseException:
                self._remove(container_id)
                raise
            if status >= 300:
                self._remove(container_id)
        return container_id, status, text

    def _create(self, request: SandboxRequest) -> Any:
        path = self._engine.versioned("/containers/create")
        query = {"name": request.name}
        status, text = self._engine.request("POST", path, query=query, body=create_body(request))
        if status == 404:  # the one thing a create can miss is its image
            raise ImageUnavailable(
                f"image of {request.name} not found ({message_of(text)}); "
                "pull or load it, or choose another"
            )
        return answer_json(status, text, request.name, map_status)

    def find(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        found = self._engine.call(
            "GET", "/containers/json", "the list", query={"all": 1, "filters": label_filter(labels)}
        )
        return [listed(entry) for entry in found or []]

    def remove(self, backend_id: str) -> bool:
        with self._removals:
            return self._remove(backend_id)

    def _remove(self, backend_id: str) -> bool:
        """Remove the container, tried again while containerd runs out of its own time; True
        when this call removed it (a try that finds it gone after one that overran did)."""
        for tried, pause in enumerate(OVERRUN_PAUSES):
            try:
                return self._delete(backend_id, tried)
            except HostError as exc:
                if not engine_overrun(exc.message):
                    raise
            log.warning("Docker ran out of its own time removing %s: again", backend_id)
            self._sleep(pause)
        return self._delete(backend_id, len(OVERRUN_PAUSES))

    def _delete(self, backend_id: str, tried: int) -> bool:
        """One removal, the ``tried``-th: whether it (or an earlier try's) removed it."""
        try:
            self._engine.call(
                "DELETE",
                f"/containers/{segment(backend_id)}",
                backend_id,
                query={"force": 1, "v": 1},
            )
        except (SandboxNotFound, RemovalInProgress):
            return tried > 0
        return True

    # --- networks ---------------------------------------------------------------------------

    def ensure_network(
        self, name: str, subnet: IPv4Network, gateway: IPv4Address, bridge: str
    ) -> None:
        """slicebox's bridge network for egress sandboxes (core.egress), made if missing.
        Containers on it cannot talk to each other (ICC off) whatever the rules say."""
        ipam: dict[str, object] = {"Config": [{"Subnet": str(subnet), "Gateway": str(gateway)}]}
        self._ensure_isolated(name, {"com.docker.network.bridge.name": bridge}, ipam)

    def _ensure_isolated(
        self, name: str, options: dict[str, str], ipam: dict[str, object] | None = None
    ) -> None:
        """A bridge network of slicebox's with inter-container traffic off, made if missing."""
        query = {"filters": json.dumps({"name": [name]})}
        found = self._engine.call("GET", "/networks", "the networks", query=query)
        if any(entry.get("Name") == name for entry in found or []):
            return
        body: dict[str, object] = {
            "Name": name,
            "Driver": "bridge",
            "CheckDuplicate": True,
            "Options": {**options, "com.docker.network.bridge.enable_icc": "false"},
            "Labels": {MANAGED: "true"},
        }
        if ipam is not None:
            body["IPAM"] = ipam
        try:
            self._engine.call("POST", "/networks/create", f"network {name}", body=body)
        except SliceboxError as exc:
            if "already exists" not in exc.message:
                raise
        log.info("made the network %s (%s, inter-container traffic off)", name, options)

    def bridge_subnets(self) -> tuple[IPv4Network, ...]:
        """The IPv4 subnets of Docker's bridge networks: no egress entry or answer reaches
        them (core.egress)."""
        query = {"filters": json.dumps({"driver": ["bridge"]})}
        found = self._engine.call("GET", "/networks", "the networks", query=query)
        subnets: list[IPv4Network] = []
        for entry in found or []:
            for config in (entry.get("IPAM") or {}).get("Config") or []:
                try:
                    subnet = ip_network(str(config.get("Subnet", "")))
                except ValueError:
                    continue
                if isinstance(subnet, IPv4Network):
                    subnets.append(subnet)
        return tuple(subnets)

    # --- volumes ----------------------------------------------------------------------------

    def volume(self, name: str) -> VolumeInfo | None:
        try:
            attrs = self._engine.call("GET", f"/volumes/{segment(name)}", f"volume {name}")
        except SandboxNotFound:
            return None
        return volume_info(attrs)

    def create_volume(self, name: str, labels: Mapping[str, str]) -> VolumeInfo:
        body = {"Name": name, "Driver": "local", "Labels": dict(labels)}
        return volume_info(
            self._engine.call("POST", "/volumes/create", f"volume {name}", body=body)
        )

    def remove_volume(self, name: str) -> bool:
        try:
            self._engine.call("DELETE", f"/volumes/{segment(name)}", f"volume {name}")
        except SandboxNotFound:
            return False
        except SliceboxError as exc:
            if "in use" not in exc.message:
                raise
            log.info("volume %s is still in use; it stays", name)
            return False
        return True

    def volumes(self, labels: Mapping[str, str]) -> list[VolumeInfo]:
        found = self._engine.call(
            "GET", "/volumes", "the volumes", query={"filters": label_filter(labels)}
        )
        return [volume_info(entry) for entry in (found or {}).get("Volumes") or []]

    # --- exec primitives ------------------------------------------------------------------

    def sandbox_pid(self, backend_id: str) -> int:
        attrs = self._engine.call("GET", f"/containers/{segment(backend_id)}/json", backend_id)
        state = attrs["State"]
        if not state.get("Running") or state.get("Paused"):
            raise SandboxNotRunning(
                f"sandbox {backend_id} is not running ({state.get('Status')}): create a new one"
            )
        return int(state["Pid"])

    async def exec_start(self, exec_id: str, stdin: bytes | StdinSource) -> AsyncRawExecAttachment:
        version = await self._api_version()
        try:
            return await attach(self._endpoint, version, exec_id, stdin)
        except StartRefused as exc:
            raise map_status(exc.status, exc.text, f"of exec {exec_id}") from exc

    async def release(self, backend_id: str, line: bytes) -> None:
        version = await self._api_version()
        try:
            await release(self._endpoint, version, segment(backend_id), line)
        except StartRefused as exc:
            raise map_status(exc.status, exc.text, backend_id) from exc

    async def launch_async(self, backend_id: str, stdin: bytes) -> AsyncRawExecAttachment:
        version = await self._api_version()
        request = attach_request(version, segment(backend_id))
        try:
            return await attach(self._endpoint, version, backend_id, stdin, request=request)
        except StartRefused as exc:
            raise map_status(exc.status, exc.text, backend_id) from exc

    # --- the calls on the event loop (backends.dockerjson) ---------------------------------

    async def inspect(self, backend_id: str) -> SandboxInfo | None:
        path = f"/containers/{segment(backend_id)}/json"
        try:
            attrs = await self._json.get(await self._versioned(path), backend_id)
        except SandboxNotFound:
            return None
        return inspected(attrs)

    async def exec_create(
        self, backend_id: str, request: ExecRequest, streamed_stdin: bool = False
    ) -> str:
        path = await self._versioned(f"/containers/{segment(backend_id)}/exec")
        created = await self._json.post(path, backend_id, exec_body(request, streamed_stdin))
        return str(created["Id"])

    async def exec_inspect(self, exec_id: str) -> ExecState:
        path = await self._versioned(f"/exec/{segment(exec_id)}/json")
        return exec_state(await self._json.get(path, exec_id))

    async def aclose(self) -> None:
        """End the connections to the daemon (the agent's shutdown)."""
        await self._json.aclose()
        self._engine.close()

    async def _versioned(self, path: str) -> str:
        return f"/v{await self._api_version()}{path}"

    async def _api_version(self) -> str:
        """The threads' API version, once known; else asked of the daemon on the loop (asking
        it through the threads' client would block the loop on the same question)."""
        known = self._engine.known_version
        if known is not None:
            return known
        said = await self._json.get("/version", "the version")
        return self._engine.settle(str(said["ApiVersion"]))

    # --- the client -----------------------------------------------------------------------

    async def present(self, image: str) -> bool:
        return await self._has_image(await self._api_version(), image)

    async def _has_image(self, version: str, image: str) -> bool:
        try:
            await self._json.get(f"/v{version}/images/{quote(image, safe='/:@')}/json", image)
        except (ImageUnavailable, SandboxNotFound):
            return False
        return True
