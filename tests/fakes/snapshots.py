"""A fake of :class:`slicebox.backends.base.SnapshotEngine`: pauses, containers' root
filesystems as tar members, and images made by an import, kept in memory. Like the engine, an
import whose stream fails leaves no image, and a container's config carries its create's env
(which a snapshot must not copy). Images have ids and references as Docker's do: a reference
given again moves to its new image, an image a container runs (``run``) keeps its last
reference when asked to remove it without force, and one with another left is untagged."""

from __future__ import annotations

import io
import itertools
import json
import shlex
import tarfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, BinaryIO

from slicebox.backends.base import Removal
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
        self.store: dict[str, dict[str, Any]] = {}  # image id: its inspect, and "tar"
        self.running: set[str] = set()  # image ids a container runs (a fork's)
        self._ids = itertools.count(1)
        self.fail_import = False
        self.calls: list[str] = []

    @property
    def images_made(self) -> dict[str, dict[str, Any]]:
        """Every tagged image by each of its references."""
        return {tag: image for image in self.store.values() for tag in image["RepoTags"]}

    def add_image(self, tags: list[str], labels: dict[str, str], size: int = 1 << 20) -> str:
        """An image as a pull (or an earlier agent) left it: its id."""
        image_id = f"sha256:{next(self._ids):064x}"
        for tag in tags:
            self._untag(tag)
        self.store[image_id] = {"Id": image_id, "RepoTags": tags, "Labels": labels, "Size": size}
        return image_id

    def run(self, reference: str) -> str:
        """A container now runs the image ``reference`` names (a fork): its id."""
        image_id = self.images_made[reference]["Id"]
        self.running.add(image_id)
        return str(image_id)

    def _untag(self, reference: str) -> None:
        for image in self.store.values():
            if reference in image["RepoTags"]:
                image["RepoTags"].remove(reference)

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
            {key: image[key] for key in ("Id", "RepoTags", "Labels", "Size")}
            for image in self.store.values()
            if all(image["Labels"].get(k) == v for k, v in labels.items())
        ]

    def tag_image(self, image_id: str, reference: str) -> None:
        if image_id not in self.store:
            raise SandboxNotFound(f"no image {image_id}")
        self._untag(reference)
        self.store[image_id]["RepoTags"].append(reference)

    def remove_image(self, image: str) -> Removal:
        found = self.store.get(image) or self.images_made.get(image)
        if found is None:
            return Removal.GONE
        tags = found["RepoTags"]
        if image in tags and len(tags) > 1:
            tags.remove(image)
            return Removal.REMOVED
        if found["Id"] in self.running or (image == found["Id"] and tags):
            return Removal.KEPT
        del self.store[found["Id"]]
        return Removal.REMOVED

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
        image_id = self.add_image([image], labels, len(data))
        self.store[image_id] |= {"Config": {"Env": env, "Labels": labels}, "tar": data}
