"""An image's pull on the event loop, against a daemon stand-in on a real unix socket that
answers ``/images/create`` as dockerd does: a refusal as a status, then progress lines, and a
registry's failure as an error line under a 200. Also what a hostile stream cannot do: grow
the agent's memory (an over-long line, endless progress) or outlast the pull's timeout."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from slicebox.backends.docker import DockerBackend
from slicebox.backends.dockerpull import MAX_LINE, PullTally, pull_query
from slicebox.model.errors import ImagePullFailed, ImageUnavailable
from slicebox.model.progress import MAX_LAYERS, Phase, ProgressEvent
from slicebox.model.pulls import RegistryCredential
from slicebox.web.app import Handler
from slicebox.web.request import Request
from slicebox.web.response import Response, StreamResponse, json_response
from tests.unit.test_dockerjson import serve_daemon

MIB = 1 << 20
IMAGE = "localhost:5000/slicebox-test/big:1"


def progress_lines(layers: dict[str, int], steps: int = 4) -> list[dict[str, object]]:
    """What dockerd says of a pull of ``layers`` (id: bytes), as it says it."""
    lines: list[dict[str, object]] = [{"status": "Pulling from slicebox-test/big", "id": "1"}]
    lines += [{"status": "Pulling fs layer", "id": layer, "progressDetail": {}} for layer in layers]
    for step in range(1, steps + 1):
        for layer, size in layers.items():
            detail = {"current": size * step // steps, "total": size}
            lines.append({"status": "Downloading", "id": layer, "progressDetail": detail})
    for layer in layers:
        lines.append({"status": "Download complete", "id": layer, "progressDetail": {}})
        lines.append({"status": "Pull complete", "id": layer, "progressDetail": {}})
    lines.append({"status": "Digest: sha256:" + "0" * 64})
    lines.append({"status": f"Status: Downloaded newer image for {IMAGE}"})
    return lines


class Daemon:
    """``/images/create`` answers ``lines`` (or ``status`` with a message), then the image is
    there; ``endless`` sends progress forever; ``silent`` answers its head and nothing more."""

    def __init__(self) -> None:
        self.images: set[str] = set()
        self.lines: list[dict[str, object]] = progress_lines({"aaa": 24 * MIB, "bbb": 1000})
        self.raw: bytes | None = None
        self.status = 200
        self.endless = self.silent = False
        self.pulls = 0
        self.auths: list[str | None] = []  # each pull's X-Registry-Auth, as sent
        self.gone = asyncio.Event()  # the agent closed a pull's connection

    async def handle(self, request: Request, _: Handler) -> Response | StreamResponse:
        await request.read()
        path = request.path
        if path == "/version":
            return json_response({"ApiVersion": "1.45"})
        if path == "/v1.45/images/create":
            self.pulls += 1
            return await self._pull(request)
        if path.startswith("/v1.45/images/") and path.endswith("/json"):
            name = path.removeprefix("/v1.45/images/").removesuffix("/json")
            if name in self.images:
                return json_response({"Id": "sha256:" + "1" * 64})
        return json_response({"message": f"No such image: {path}"}, status=404)

    async def _pull(self, request: Request) -> Response | StreamResponse:
        query = {key: request.query[key] for key in ("fromImage", "tag")}
        self.auths.append(request.headers.get("X-Registry-Auth"))
        if self.status != 200:
            return json_response({"message": "manifest unknown"}, status=self.status)
        response = StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            async for piece in self._said():
                await response.write(piece)
            self.images.add(f"{query['fromImage']}:{query['tag']}")
            await response.write_eof()
        except (ConnectionError, OSError):
            self.gone.set()
        except asyncio.CancelledError:  # the agent closed it: seen at the connection's end
            self.gone.set()
            raise
        return response

    async def _said(self) -> AsyncIterator[bytes]:
        if self.raw is not None:
            yield self.raw
            return
        for line in self.lines:
            yield json.dumps(line).encode() + b"\r\n"
        while self.endless:
            line = {"status": "Downloading", "id": "aaa", "progressDetail": {"current": 1}}
            yield json.dumps(line).encode() * 20 + b"\r\n"
            await asyncio.sleep(0)
        while self.silent:  # a space now and then: a write that finds the agent gone
            await asyncio.sleep(0.05)
            yield b" "


def with_daemon(test: Callable[[DockerBackend, Daemon], Awaitable[None]], daemon: Daemon) -> None:
    serve_daemon(daemon, test)


def pulled(
    daemon: Daemon, timeout: float = 10.0, grant: RegistryCredential | None = None
) -> list[ProgressEvent]:
    events: list[ProgressEvent] = []

    async def test(backend: DockerBackend, _: Daemon) -> None:
        await backend.pull(IMAGE, events.append, timeout, grant)

    with_daemon(test, daemon)
    return events


@pytest.mark.parametrize(
    ("image", "query"),
    [
        ("alpine", {"fromImage": "alpine", "tag": "latest"}),
        ("alpine:3.19", {"fromImage": "alpine", "tag": "3.19"}),
        ("localhost:5000/a/b", {"fromImage": "localhost:5000/a/b", "tag": "latest"}),
        ("localhost:5000/a/b:1", {"fromImage": "localhost:5000/a/b", "tag": "1"}),
        ("a/b@sha256:" + "f" * 64, {"fromImage": "a/b", "tag": "sha256:" + "f" * 64}),
    ],
)
def test_an_image_s_name_is_split_as_the_daemon_wants_it(image: str, query: dict[str, str]) -> None:
    assert pull_query(image) == query


def test_a_pull_reports_each_layer_s_bytes_up_to_its_total() -> None:
    daemon = Daemon()
    events = pulled(daemon)
    assert daemon.pulls == 1
    last = events[-1]
    assert last.phase is Phase.PULLING
    assert (last.done, last.total) == (24 * MIB + 1000, 24 * MIB + 1000)
    sizes = {layer.id: (layer.current, layer.total) for layer in last.layers}
    assert sizes == {"aaa": (24 * MIB, 24 * MIB), "bbb": (1000, 1000)}
    partial = [event.done for event in events if event.done and event.total]
    assert partial == sorted(partial), "a pull's bytes only grow"
    assert "1/1" not in last.describe()
    assert "2/2 layers" in last.describe()


def test_an_image_that_is_present_is_not_pulled() -> None:
    daemon = Daemon()
    daemon.images.add(IMAGE)
    assert pulled(daemon) == []
    assert daemon.pulls == 0


def test_nothing_to_pull_is_image_unavailable_as_before() -> None:
    daemon = Daemon()
    daemon.status = 404
    with pytest.raises(ImageUnavailable, match="manifest unknown") as caught:
        pulled(daemon)
    assert caught.value.code == "image_unavailable"


@pytest.mark.parametrize(
    ("said", "code"),
    [
        ("received unexpected HTTP status: 500 Internal Server Error", "image_pull_failed"),
        ("unexpected EOF", "image_pull_failed"),
        ("manifest for x:1 not found: manifest unknown", "image_unavailable"),
        (
            'Get "https://r.example/v2/": dial tcp: lookup r.example: no such host',
            "image_unavailable",
        ),
    ],
)
def test_a_registry_s_failure_mid_stream_is_told_in_its_words(said: str, code: str) -> None:
    daemon = Daemon()
    daemon.lines = [*daemon.lines[:6], {"errorDetail": {"message": said}, "error": said}]
    with pytest.raises((ImagePullFailed, ImageUnavailable)) as caught:
        pulled(daemon)
    assert caught.value.code == code
    assert said in caught.value.message


def test_a_registry_that_goes_silent_fails_at_the_timeout_and_the_connection_is_closed() -> None:
    daemon = Daemon()
    daemon.lines, daemon.silent = daemon.lines[:6], True

    async def test(backend: DockerBackend, _: Daemon) -> None:
        with pytest.raises(ImagePullFailed, match=r"did not end within 0\.5 s"):
            await backend.pull(IMAGE, lambda _: None, 0.5)
        await asyncio.wait_for(daemon.gone.wait(), 5)  # the daemon abandons the pull

    with_daemon(test, daemon)
    assert IMAGE not in daemon.images


def test_an_endless_stream_is_bounded_by_the_timeout_and_holds_no_memory() -> None:
    daemon = Daemon()
    daemon.endless = True
    events: list[ProgressEvent] = []

    async def test(backend: DockerBackend, _: Daemon) -> None:
        with pytest.raises(ImagePullFailed):
            await backend.pull(IMAGE, events.append, 1.0)

    with_daemon(test, daemon)
    assert len(events) <= 10, "a snapshot a period, however much the stream says"


def test_an_overlong_line_ends_the_pull() -> None:
    daemon = Daemon()
    daemon.raw = b"x" * (MAX_LINE + 10)
    with pytest.raises(ImagePullFailed, match="progress line over"):
        pulled(daemon)


def test_a_tally_tracks_at_most_max_layers_and_ignores_what_is_not_progress() -> None:
    tally = PullTally(IMAGE, clock=lambda: 0.0)
    for number in range(MAX_LAYERS + 50):
        tally.feed(json.dumps({"status": "Waiting", "id": f"l{number}"}).encode())
    tally.feed(b"not json")
    tally.feed(b"[1, 2]")
    assert len(tally.snapshot().layers) == MAX_LAYERS


def test_a_pull_holds_no_thread() -> None:
    daemon = Daemon()
    daemon.lines = daemon.lines[:6]
    daemon.silent = True
    counts: list[int] = []

    async def test(backend: DockerBackend, _: Daemon) -> None:
        before = threading.active_count()
        pulling = asyncio.ensure_future(backend.pull(IMAGE, lambda _: None, 30))
        await asyncio.sleep(0.3)
        counts.append(threading.active_count() - before)
        pulling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pulling

    with_daemon(test, daemon)
    assert counts[0] <= 0, "no thread held by a silent pull (another may end meanwhile)"


def docker_config(where: Path, user: str, password: str) -> Path:
    """A Docker client config holding credentials for ``IMAGE``'s registry, mode 0600."""
    where.mkdir(parents=True, exist_ok=True)
    encoded = base64.b64encode(f"{user}:{password}".encode()).decode()
    path = where / "config.json"
    path.write_text(json.dumps({"auths": {"localhost:5000": {"auth": encoded}}}))
    path.chmod(0o600)
    return path


def grant_of(path: Path) -> RegistryCredential:
    return RegistryCredential(
        registry="localhost:5000", users=frozenset({"alice"}), auth_file=str(path)
    )


def test_a_granted_pull_sends_the_credentials_as_the_engine_reads_them(tmp_path: Path) -> None:
    """The header is the base64 of the JSON auth config (not ``str(bytes)``, "b'…'", which
    the engine cannot read and so pulls anonymously)."""
    daemon = Daemon()
    pulled(daemon, grant=grant_of(docker_config(tmp_path, "alice", "s3cret")))
    [header] = daemon.auths
    assert header is not None
    assert not header.startswith("b'")
    said = json.loads(base64.urlsafe_b64decode(header))
    assert (said["username"], said["password"]) == ("alice", "s3cret")


def test_root_s_own_docker_credentials_are_never_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's own ~/.docker (root's, the operator's) holds credentials for the registry:
    a tenant's pull without a grant is anonymous all the same."""
    own = tmp_path / "root-docker"
    docker_config(own, "operator", "private")
    monkeypatch.setenv("DOCKER_CONFIG", str(own))
    monkeypatch.setenv("HOME", str(tmp_path))
    daemon = Daemon()
    pulled(daemon)
    assert daemon.auths == [None]


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (lambda path: path.chmod(0o644), "mode 0600"),
        (lambda path: path.write_text('{"auths": {}}'), "no auths entry for localhost:5000"),
        (lambda path: path.unlink(), "No such file"),
        (lambda path: path.write_text("[1]"), "not a Docker client config"),
    ],
)
def test_a_grant_that_cannot_be_used_fails_the_pull_saying_why_never_anonymous(
    tmp_path: Path, spoil: Callable[[Path], None], said: str
) -> None:
    path = docker_config(tmp_path, "alice", "s3cret")
    spoil(path)
    daemon = Daemon()
    with pytest.raises(ImagePullFailed, match=said) as caught:
        pulled(daemon, grant=grant_of(path))
    assert "[[registry_credentials]]" in caught.value.message
    assert daemon.auths == [], "nothing was asked of the engine"
