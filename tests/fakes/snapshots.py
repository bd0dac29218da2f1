"""A fake of :class:`slicebox.backends.base.SnapshotEngine`: pauses, containers' root
filesystems as tar members, and images made by an import, kept in memory. Like the engine, an
import whose stream fails leaves no image, and a container's config carries its create's env
(which a snapshot must not copy)."""

from __future__ import annotations

import io
import json
import shlex
import tarfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, BinaryIO

from slicebox.model.errors import ImageUnavailable, SandboxNotFound

BASE_ENV = ["PATH=/usr/bin:/bin"]


def tar_of(members: Iterable[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in members:
            member.size = len(data) if member.isreg() else 0
            tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return buffer.getvalue()


def member(
    name: str, data: bytes = b"", *, mode: int = 0o644, kind: bytes = tarfile.REGTYPE
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, mode
    return info, data


def members_of(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: m for m in tar.getmembers()}


def contents(data: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        found = tar.extractfile(name)
        assert found is not None
        return found.read()


class FakeSnapshotEngine:
    def __init__(self) -> None:
        self.paused_ids: set[str] = set()
        self.rootfs: dict[str, bytes] = {}  # container id: its exported tar
        self.env: dict[str, list[str]] = {}  # container id: its create's env
        self.mounts: dict[str, list[dict[str, str]]] = {}
        self.images_made: dict[str, dict[str, Any]] = {}  # reference: its inspect, and "tar"
        self.fail_import = False
        self.calls: list[str] = []

    def add(self, container_id: str, rootfs: bytes, env: list[str] | None = None) -> None:
        self.rootfs[container_id] = rootfs
        self.env[container_id] = env or []

    def _known(self, container_id: str) -> None:
        if container_id not in self.rootfs:
            raise SandboxNotFound(f"no sandbox {container_id}")

    def paused(self, container_id: str) -> bool:
        self._known(container_id)
        return container_id in self.paused_ids

    def pause(self, container_id: str) -> None:
        self._known(container_id)
        self.calls.append(f"pause {container_id}")
        self.paused_ids.add(container_id)

    def unpause(self, container_id: str) -> None:
        self._known(container_id)
        self.calls.append(f"unpause {container_id}")
        self.paused_ids.discard(container_id)

    def container(self, container_id: str) -> Mapping[str, Any]:
        self._known(container_id)
        return {
            "Image": "sha256:base",
            "Config": {"Image": "base:1", "Env": BASE_ENV + self.env[container_id]},
            "State": {"Paused": container_id in self.paused_ids, "Pid": 4242},
            "Mounts": self.mounts.get(container_id, []),
        }

    def image_config(self, image: str) -> Mapping[str, Any]:
        if image != "sha256:base":
            raise ImageUnavailable(f"image {image} is not in the engine's store")
        return {"Env": BASE_ENV, "Cmd": ["sh"]}

    def images(self, labels: Mapping[str, str]) -> list[Mapping[str, Any]]:
        return [
            image
            for image in self.images_made.values()
            if all(image["Labels"].get(k) == v for k, v in labels.items())
        ]

    def remove_image(self, image: str) -> bool:
        return self.images_made.pop(image, None) is not None

    def export(self, container_id: str, read: Callable[[BinaryIO], None]) -> None:
        self._known(container_id)
        read(io.BytesIO(self.rootfs[container_id]))

    def import_image(self, image: str, changes: list[str], body: Iterable[bytes]) -> None:
        data = b"".join(body)
        if self.fail_import:
            raise SandboxNotFound("the import was cut off")
        labels, env = {}, []
        for change in changes:
            verb, _, rest = change.partition(" ")
            if verb == "LABEL":
                key, _, value = rest.partition("=")
                labels[json.loads(key)] = json.loads(value)
            elif verb == "ENV":
                env.append("".join(shlex.split(rest)))
        self.images_made[image] = {
            "RepoTags": [image],
            "Labels": labels,
            "Size": len(data),
            "Config": {"Env": env, "Labels": labels},
            "tar": data,
        }
