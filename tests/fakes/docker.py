"""An in-memory :class:`slicebox.backends.docker.DockerApi`; it places scopes in FakeSystemd."""

from __future__ import annotations

from collections.abc import Mapping

from slicebox.backends.docker import ContainerInfo, ContainerRequest
from slicebox.model.errors import ImageUnavailable, InvalidRequest
from slicebox.model.names import scope_name
from tests.fakes.systemd import FakeSystemd


class FakeDocker:
    def __init__(self, systemd: FakeSystemd, images: set[str] | None = None) -> None:
        self.systemd = systemd
        self.images = images if images is not None else {"alpine:3.19"}
        self.registry: set[str] = set()
        self.containers: dict[str, ContainerInfo] = {}
        self.requests: dict[str, ContainerRequest] = {}
        self.removed: list[str] = []
        self.fail_start = False

    def has_image(self, image: str) -> bool:
        return image in self.images

    def pull(self, image: str) -> None:
        if image not in self.registry:
            raise ImageUnavailable(f"image {image!r} cannot be pulled")
        self.images.add(image)

    def create(self, request: ContainerRequest) -> str:
        container_id = f"{len(self.requests) + 1:064x}"
        self.requests[container_id] = request
        self.containers[container_id] = ContainerInfo(
            id=container_id, name=request.name, labels=request.labels, status="created"
        )
        return container_id

    def start(self, container_id: str) -> None:
        if self.fail_start:
            raise InvalidRequest("cannot start", code="container_start_failed")
        info = self.containers[container_id]
        self.containers[container_id] = info.model_copy(update={"status": "running"})
        parent = self.requests[container_id].cgroup_parent
        self.systemd.children.setdefault(parent, set()).add(scope_name(container_id))

    def inspect(self, container: str) -> ContainerInfo | None:
        return self.containers.get(container)

    def find(self, labels: Mapping[str, str]) -> list[ContainerInfo]:
        return [
            info
            for info in self.containers.values()
            if all(info.labels.get(k) == v for k, v in labels.items())
        ]

    def remove(self, container_id: str) -> bool:
        if self.containers.pop(container_id, None) is None:
            return False
        self.removed.append(container_id)
        parent = self.requests[container_id].cgroup_parent
        self.systemd.children.get(parent, set()).discard(scope_name(container_id))
        return True
