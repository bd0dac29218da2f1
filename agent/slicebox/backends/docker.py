"""The small part of the Docker Engine slicebox needs, and its docker-py implementation.

Docker's errors are mapped here, at the edge, into the slicebox tree: a missing image that
cannot be pulled is :class:`ImageUnavailable`, an unreachable daemon :class:`Unavailable`, a
request the engine refuses (say, a command that does not exist in the image)
:class:`InvalidRequest` with code ``container_start_failed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from slicebox.model.errors import HostError, ImageUnavailable, InvalidRequest, NotFound, Unavailable

log = logging.getLogger(__name__)
R = TypeVar("R")


class BindMount(BaseModel):
    model_config = ConfigDict(frozen=True)

    source: str  # a host path, or a volume name
    target: str
    read_only: bool = False
    volume: bool = False


class ContainerRequest(BaseModel):
    """Everything a sandbox container is created with; the hardening is on by default."""

    model_config = ConfigDict(frozen=True)

    name: str
    image: str
    command: tuple[str, ...] | None = None
    labels: dict[str, str]
    cgroup_parent: str
    memory_bytes: int
    nano_cpus: int
    pids: int
    network: str = "none"
    env: dict[str, str] = {}
    user: str | None = None
    workdir: str | None = None
    mounts: tuple[BindMount, ...] = ()
    cap_add: tuple[str, ...] = ()
    cap_drop: tuple[str, ...] = ("ALL",)
    security_opt: tuple[str, ...] = ("no-new-privileges:true",)
    init: bool = True


class ContainerInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    labels: dict[str, str]
    status: str  # created, running, exited...
    pid: int = 0


class DockerApi(Protocol):
    def has_image(self, image: str) -> bool: ...

    def pull(self, image: str) -> None: ...

    def create(self, request: ContainerRequest) -> str:
        """Create (not start) a container; its id."""

    def start(self, container_id: str) -> None: ...

    def inspect(self, container: str) -> ContainerInfo | None:
        """A container by id or name; None when there is none."""

    def find(self, labels: Mapping[str, str]) -> list[ContainerInfo]:
        """All containers (running or not) carrying every one of ``labels``."""

    def remove(self, container_id: str) -> bool:
        """Kill and remove; False when it was already gone."""


class DockerPy:
    """:class:`DockerApi` over docker-py's low-level client."""

    def __init__(self, client: Any = None) -> None:
        if client is None:
            import docker

            client = _mapped("docker", docker.from_env)
        self._api = client.api

    def has_image(self, image: str) -> bool:
        import docker.errors

        try:
            self._api.inspect_image(image)
        except docker.errors.ImageNotFound:
            return False
        return True

    def pull(self, image: str) -> None:
        import docker.errors

        log.info("pulling %s", image)
        try:
            self._api.pull(image)
        except docker.errors.DockerException as exc:
            raise ImageUnavailable(
                f"image {image!r} is not on this host and could not be pulled ({exc}); "
                "load it with `docker load`/`docker pull` or choose another image"
            ) from exc

    def create(self, request: ContainerRequest) -> str:
        host_config = self._api.create_host_config(**_host_config(request))
        created = _mapped(
            request.name,
            lambda: self._api.create_container(
                request.image,
                command=list(request.command) if request.command is not None else None,
                name=request.name,
                labels=request.labels,
                environment=request.env,
                user=request.user,
                working_dir=request.workdir,
                host_config=host_config,
            ),
        )
        return str(created["Id"])

    def start(self, container_id: str) -> None:
        import docker.errors

        try:
            self._api.start(container_id)
        except docker.errors.APIError as exc:
            # The engine answers 400 or 500 alike when the request cannot run (no such user,
            # workdir or program): the caller's request is what needs changing.
            raise InvalidRequest(
                f"the sandbox could not start: {exc.explanation}; check image, command, user",
                code="container_start_failed",
            ) from exc

    def inspect(self, container: str) -> ContainerInfo | None:
        try:
            attrs = _mapped(container, lambda: self._api.inspect_container(container))
        except NotFound:
            return None
        return _info(attrs)

    def find(self, labels: Mapping[str, str]) -> list[ContainerInfo]:
        wanted = [f"{key}={value}" for key, value in labels.items()]
        found = _mapped("list", lambda: self._api.containers(all=True, filters={"label": wanted}))
        return [info for entry in found if (info := self.inspect(entry["Id"])) is not None]

    def remove(self, container_id: str) -> bool:
        try:
            _mapped(
                container_id, lambda: self._api.remove_container(container_id, force=True, v=True)
            )
        except NotFound:
            return False
        return True


def _host_config(request: ContainerRequest) -> dict[str, Any]:
    return {
        "cgroup_parent": request.cgroup_parent,
        "mem_limit": request.memory_bytes,
        "memswap_limit": request.memory_bytes,  # no swap beyond the memory limit
        "nano_cpus": request.nano_cpus,
        "pids_limit": request.pids,
        "network_mode": request.network,
        "cap_drop": list(request.cap_drop),
        "cap_add": list(request.cap_add) or None,
        "security_opt": list(request.security_opt),
        "init": request.init,
        "privileged": False,
        "binds": [_bind(mount) for mount in request.mounts] or None,
    }


def _bind(mount: BindMount) -> str:
    return f"{mount.source}:{mount.target}:{'ro' if mount.read_only else 'rw'}"


def _info(attrs: Mapping[str, Any]) -> ContainerInfo:
    state = attrs.get("State") or {}
    return ContainerInfo(
        id=attrs["Id"],
        name=str(attrs.get("Name", "")).lstrip("/"),
        labels=(attrs.get("Config") or {}).get("Labels") or {},
        status=state.get("Status", "unknown"),
        pid=state.get("Pid") or 0,
    )


def _mapped(what: str, call: Callable[[], R]) -> R:
    """Run a docker-py call, mapping its exceptions into the slicebox tree."""
    import docker.errors

    try:
        return call()
    except docker.errors.ImageNotFound as exc:
        raise ImageUnavailable(f"{what}: image not found ({exc.explanation})") from exc
    except docker.errors.NotFound as exc:
        raise NotFound(f"{what}: no such container") from exc
    except docker.errors.APIError as exc:
        if exc.status_code is not None and 400 <= exc.status_code < 500:
            raise InvalidRequest(
                f"docker refused {what}: {exc.explanation}; check the image, command and user",
                code="container_start_failed",
            ) from exc
        raise HostError(f"docker failed on {what}: {exc.explanation}") from exc
    except docker.errors.DockerException as exc:
        raise Unavailable(f"docker is not reachable ({exc}); is docker.service running?") from exc
