"""An image's pull through the Engine API, on the event loop: progress as it comes, no thread.

``POST /images/create?fromImage=…&tag=…`` answers a refusal the daemon knows at once (no such
image, no registry to ask) as a status, and everything later as a stream of JSON lines, one a
status change of a layer (``{"id", "status", "progressDetail": {"current", "total"}}``) or, when
the registry fails mid-way, ``{"error", "errorDetail"}`` under a 200. :class:`PullTally` reads
those lines into :class:`~slicebox.model.progress.ProgressEvent` snapshots and the verdict.

What the daemon sends is bounded here, since a registry (through the daemon) may send anything:
a line longer than :data:`MAX_LINE`, or more than :data:`MAX_STREAM` of progress in all, ends the
pull as failed, layers beyond :data:`~slicebox.model.progress.MAX_LAYERS` are not tracked, and
the whole pull has its timeout. Leaving early closes the connection, which makes the daemon
abandon the pull: nothing of it is left as an image.

Credentials: only an operator's grant for the image's registry and the sandbox's user
(``model.pulls``), never root's own Docker config.

Codes: nothing to pull (not found, denied, no registry reachable) is ``image_unavailable`` as
before; a registry that fails or stops answering is ``image_pull_failed`` with its words.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from slicebox.backends.dockerapi import message_of
from slicebox.backends.dockererrors import unpullable
from slicebox.model.errors import ImagePullFailed, SliceboxError
from slicebox.model.progress import MAX_LAYERS, LayerProgress, Phase, ProgressEvent
from slicebox.model.pulls import RegistryCredential
from slicebox.web.message import READ_SIZE, BodyTooLarge

if TYPE_CHECKING:
    from docker.auth import AuthConfig

    from slicebox.backends.dockerjson import DockerJsonApi
    from slicebox.web.client import ClientResponse

log = logging.getLogger(__name__)

Report = Callable[[ProgressEvent], None]

MAX_LINE = 64 * 1024  # a progress line is ~200 bytes; an error quoting a registry, a few KiB
MAX_STREAM = 64 << 20  # progress of a pull of hundreds of layers is a few MiB
REPORT_EVERY = 0.25  # seconds between two snapshots of one pull, unless a layer changed status
_DONE = ("Download complete", "Verifying Checksum", "Extracting", "Pull complete")
# The daemon's words when there is nothing to pull: no such image, or no registry to ask.
_NOTHING_TO_PULL = (
    "not found",
    "manifest unknown",
    "does not exist",
    "denied",
    "no such host",
    "connection refused",
    "network is unreachable",
    "no route to host",
    "invalid reference",
    "server misbehaving",
)


def pull_query(image: str) -> dict[str, str]:
    """``fromImage`` and ``tag`` for ``image`` as the daemon wants them: a digest or a tag
    apart from the repository (a port's colon is not a tag's), ``latest`` when none."""
    if "@" in image:
        repository, digest = image.split("@", 1)
        return {"fromImage": repository, "tag": digest}
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return {"fromImage": image[:colon], "tag": image[colon + 1 :]}
    return {"fromImage": image, "tag": "latest"}


def refused(image: str, status: int, message: str) -> SliceboxError:
    """The daemon's refusal of the pull before any progress (``status``, its ``message``)."""
    if status == 404 or _nothing_to_pull(message):
        return unpullable(image, message)
    return failed(image, message)


def failed(image: str, why: str) -> ImagePullFailed:
    return ImagePullFailed(
        f"the pull of image {image!r} failed: {why}; retry later or check its registry"
    )


def _nothing_to_pull(message: str) -> bool:
    lowered = message.lower()
    return any(words in lowered for words in _NOTHING_TO_PULL)


class PullTally:
    """The progress of one pull, line by line, and the snapshot to report."""

    def __init__(self, image: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.image = image
        self.layers: dict[str, LayerProgress] = {}
        self.said = 0  # bytes of progress read
        self._clock = clock
        self._reported = float("-inf")
        self._changed = False

    def feed(self, line: bytes) -> bool:
        """Take one line; whether a snapshot is due. An error line raises its verdict."""
        self.said += len(line) + 1
        if self.said > MAX_STREAM:
            raise failed(self.image, f"the engine sent over {MAX_STREAM >> 20} MiB of progress")
        try:
            said = json.loads(line)
        except ValueError:
            return False  # not a line of progress: nothing to show
        if not isinstance(said, dict):
            return False
        if said.get("error") or said.get("errorDetail"):
            raise self._verdict(said)
        return self._layer(said)

    def due(self) -> bool:
        now = self._clock()
        if self._changed or now - self._reported >= REPORT_EVERY:
            self._reported, self._changed = now, False
            return True
        return False

    def snapshot(self) -> ProgressEvent:
        layers = tuple(self.layers.values())
        sized = [layer for layer in layers if layer.total]
        total = sum(layer.total or 0 for layer in sized)
        done = sum(min(layer.current or 0, layer.total or 0) for layer in sized)
        return ProgressEvent(
            phase=Phase.PULLING,
            subject=self.image,
            done=done,
            total=total or None,
            layers=layers,
        )

    def _verdict(self, said: Mapping[str, Any]) -> SliceboxError:
        detail = said.get("errorDetail")
        message = str(said.get("error") or (detail or {}).get("message") or "no reason given")
        return (
            unpullable(self.image, message)
            if _nothing_to_pull(message)
            else failed(self.image, message)
        )

    def _layer(self, said: Mapping[str, Any]) -> bool:
        layer_id, status = str(said.get("id") or "")[:128], str(said.get("status") or "")[:200]
        if not layer_id or " " in layer_id or status.startswith("Pulling from"):
            return False  # the pull's own status lines ("Pulling from …" names the tag)
        known = self.layers.get(layer_id)
        if known is None and len(self.layers) >= MAX_LAYERS:
            return False
        current, total = _bytes(said.get("progressDetail"))
        if status.startswith(_DONE) and known is not None and known.total:
            current, total = known.total, known.total
        elif total is None and known is not None:
            current, total = known.current, known.total
        self.layers[layer_id] = LayerProgress(
            id=layer_id, status=status, current=current, total=total
        )
        self._changed = self._changed or known is None or known.status != status
        return self.due()


def _bytes(detail: object) -> tuple[int | None, int | None]:
    if not isinstance(detail, dict):
        return None, None
    current, total = detail.get("current"), detail.get("total")
    if not isinstance(current, int) or not isinstance(total, int) or total <= 0 or current < 0:
        return None, None
    return min(current, total), total


def registry_auth(image: str, grant: RegistryCredential | None) -> str | None:
    """The ``X-Registry-Auth`` header of a pull of ``image`` with the operator's ``grant``
    (``model.pulls``): None, anonymous, without one. Root's own Docker credentials are never
    read: they would pull the operator's private images for any tenant. A grant that cannot be
    used fails the pull, saying why: never a silent anonymous pull."""
    if grant is None:
        return None
    from docker import auth  # the config's formats are docker-py's; imported when one is used

    try:
        found = _auths(Path(str(grant.auth_file))).resolve_authconfig(grant.registry)
    except (OSError, ValueError) as exc:
        raise _unusable(image, grant, str(exc)) from None
    if not found:
        raise _unusable(image, grant, f"it holds no auths entry for {grant.registry}")
    # docker-py's header is base64 bytes; the header is their text (str() would say "b'…'").
    header: bytes = auth.encode_header(found)
    return header.decode("ascii")


def _auths(path: Path) -> AuthConfig:
    """The ``auths`` of a Docker client config of root's, its helpers left out (nothing is
    run); a file others may read or write is refused."""
    from docker import auth, errors

    with path.open("rb") as file:
        found = os.fstat(file.fileno())
        if found.st_uid != os.geteuid() or found.st_mode & 0o077:
            raise ValueError("it must be the agent's own (root's), mode 0600 (chown, chmod it)")
        said = json.loads(file.read(MAX_LINE))
    if not isinstance(said, dict) or not isinstance(said.get("auths", {}), dict):
        raise ValueError("it is not a Docker client config (a JSON object with 'auths')")
    try:
        auths = auth.parse_auth(said.get("auths", {}), raise_on_error=True)
    except errors.InvalidConfigFile as exc:
        raise ValueError(str(exc)) from None
    return auth.AuthConfig({"auths": auths})


def _unusable(image: str, grant: RegistryCredential, why: str) -> ImagePullFailed:
    return failed(
        image,
        f"the credentials the operator granted for {grant.registry} cannot be used: "
        f"auth_file {grant.auth_file}: {why}; an operator fixes it ([[registry_credentials]])",
    )


async def pull(
    api: DockerJsonApi,
    path: str,
    image: str,
    report: Report,
    timeout: float,
    *,
    grant: RegistryCredential | None = None,
) -> None:
    """Pull ``image`` through ``api`` (``path``: the versioned ``/images/create``), reporting
    snapshots of its progress; within ``timeout`` seconds or ``image_pull_failed``. ``grant``:
    the operator's credentials this pull may send (``model.pulls``); None: anonymous."""
    header = registry_auth(image, grant)
    headers = {"X-Registry-Auth": header} if header else None
    tally = PullTally(image)
    try:
        async with asyncio.timeout(timeout):
            answer = await api.open("POST", f"{path}?{urlencode(pull_query(image))}", headers)
            try:
                await _follow(answer, tally, report)
            finally:
                answer.close()  # read to its end or not: the daemon abandons an unread pull
    except TimeoutError:
        last = f"; it had {tally.snapshot().describe()}" if tally.layers else ""
        raise failed(
            image, f"it did not end within {timeout:g} s (the registry stopped answering?){last}"
        ) from None


async def _follow(answer: ClientResponse, tally: PullTally, report: Report) -> None:
    if answer.status >= 300:
        try:
            text = await answer.content.readall(MAX_LINE)
        except BodyTooLarge:
            text = b"(a longer refusal)"
        raise refused(tally.image, answer.status, message_of(text.decode(errors="replace")))
    buffer = bytearray()
    while piece := await answer.content.read(READ_SIZE):
        buffer += piece
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if tally.feed(line):
                report(tally.snapshot())
        if len(buffer) > MAX_LINE:
            raise failed(tally.image, f"the engine sent a progress line over {MAX_LINE} bytes")
    if buffer.strip():
        tally.feed(bytes(buffer))
    report(tally.snapshot())
