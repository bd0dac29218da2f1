"""The Engine API calls of pause, snapshots and forks (core.pausing, core.snapshots).

A pause is the engine's own (``POST /containers/{id}/pause``), so ``docker`` and the engine's
``State.Paused`` agree with the agent. A snapshot is an export of the container's root
filesystem read as a stream and an import of a rewritten stream as one new image: the import
takes its image configuration only from ``changes`` (the base image's command, entrypoint,
env, working directory, and slicebox's labels), never from the container, whose ``Env`` holds
what its create was given; ``docker commit`` would copy that Env into the image. The import is
the engine's one step: a stream cut short (an agent killed mid-way) leaves no image. An image is
never removed by force: a forced removal of an image a fork runs untags it and leaves its bytes
in the store, no one's (core.snapshots retires it instead).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, BinaryIO, cast
from urllib.parse import quote, urlencode

from slicebox.backends.base import Removal
from slicebox.backends.dockerapi import EngineApi, call_failed, message_of
from slicebox.backends.dockerbody import segment
from slicebox.backends.dockerendpoint import DockerEndpoint
from slicebox.backends.dockererrors import map_status
from slicebox.model.errors import HostError, ImageUnavailable, SandboxNotFound

STREAM_TIMEOUT = 3600.0  # an export or import of a large sandbox on a slow disk
CALL_TIMEOUT = 300.0


class DockerSnapshots:
    """:class:`~slicebox.backends.base.SnapshotEngine` over the Engine API at ``endpoint``."""

    def __init__(self, endpoint: DockerEndpoint) -> None:
        self._api = EngineApi(endpoint, map_status, CALL_TIMEOUT)
        self._endpoint = endpoint

    def paused(self, container_id: str) -> bool:
        return bool(self.container(container_id)["State"].get("Paused"))

    def pause(self, container_id: str) -> None:
        self._api.call("POST", f"/containers/{segment(container_id)}/pause", container_id)

    def unpause(self, container_id: str) -> None:
        self._api.call("POST", f"/containers/{segment(container_id)}/unpause", container_id)

    def container(self, container_id: str) -> Mapping[str, Any]:
        path = f"/containers/{segment(container_id)}/json"
        return cast(Mapping[str, Any], self._api.call("GET", path, container_id))

    def image_config(self, image: str) -> Mapping[str, Any]:
        """The image's configuration (its Cmd, Env...): ``ImageUnavailable`` when it is gone."""
        try:
            found = self._api.call("GET", f"/images/{quote(image, safe='/:@')}/json", image)
        except SandboxNotFound as exc:
            raise ImageUnavailable(f"image {image} is not in the engine's store") from exc
        return cast(Mapping[str, Any], found.get("Config") or {})

    def images(self, labels: Mapping[str, str]) -> list[Mapping[str, Any]]:
        filters = json.dumps({"label": [f"{k}={v}" for k, v in labels.items()]})
        found = self._api.call("GET", "/images/json", "the images", query={"filters": filters})
        return list(found or [])

    def tag_image(self, image_id: str, reference: str) -> None:
        repo, tag = reference.rsplit(":", 1)
        target = f"/images/{quote(image_id, safe='/:@')}/tag"
        self._api.call("POST", target, image_id, query={"repo": repo, "tag": tag})

    def remove_image(self, image: str) -> Removal:
        """Without force: the engine refuses (409) to take the last reference of an image a
        container runs, where a forced removal would untag it and leave its bytes no one's."""
        target = self._api.versioned(f"/images/{quote(image, safe='/:@')}")
        status, text = self._api.request("DELETE", target)
        if status == 404:
            return Removal.GONE
        if status == 409:
            return Removal.KEPT
        if status >= 300:
            raise map_status(status, message_of(text), f"image {image}")
        return Removal.REMOVED

    def export(self, container_id: str, read: Callable[[BinaryIO], None]) -> None:
        """``read`` the container's root filesystem as a tar stream."""
        with self._stream("GET", f"/containers/{segment(container_id)}/export", container_id) as r:
            read(cast(BinaryIO, r))

    def import_image(self, image: str, changes: list[str], body: Iterable[bytes]) -> None:
        """One image ``image`` (repo:tag) from the tar stream ``body``, configured only by
        ``changes`` (Dockerfile instructions)."""
        repo, tag = image.rsplit(":", 1)
        query = urlencode(
            [("fromSrc", "-"), ("repo", repo), ("tag", tag)] + [("changes", c) for c in changes]
        )
        headers = {"Content-Type": "application/x-tar"}
        with self._stream("POST", f"/images/create?{query}", image, body, headers) as answer:
            _progress_ok(answer, image)

    @contextmanager
    def _stream(
        self,
        method: str,
        target: str,
        what: str,
        body: Iterable[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Iterator[http.client.HTTPResponse]:
        conn = self._api.fresh()
        conn.timeout = STREAM_TIMEOUT
        try:
            try:
                conn.request(
                    method,
                    self._api.versioned(target),
                    body=body,
                    headers=dict(headers or {}),
                    encode_chunked=body is not None,
                )
                answer = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise call_failed(self._endpoint, exc, STREAM_TIMEOUT) from exc
            if answer.status >= 300:
                raise map_status(answer.status, message_of(answer.read().decode()), what)
            yield answer
        finally:
            conn.close()


def _progress_ok(answer: http.client.HTTPResponse, image: str) -> None:
    """An import answers 200 with JSON progress lines; a failure is an ``error`` among them."""
    for line in answer.read().decode(errors="replace").splitlines():
        try:
            said = json.loads(line)
        except ValueError:
            continue
        if isinstance(said, dict) and said.get("error"):
            raise HostError(f"the engine could not import snapshot {image}: {said['error']}")
