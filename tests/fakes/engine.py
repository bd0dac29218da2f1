"""A Docker daemon stand-in on a real unix socket: the Engine API's paths, JSON and statuses.

It speaks HTTP/1.1 with keep-alive, one thread per connection, as dockerd does, and fails the
way dockerd fails: a create of an image it lacks is 404 "No such image", of a taken name 409
"already in use"; a failing start is a 400/500 with the runtime's message; a remove of a missing
container is 404, of one another removal holds 409 "removal ... already in progress"; a volume
a container mounts is 409 "volume is in use". ``slow`` makes starts and removals take a while,
and ``peak`` says how many of those ran at once.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

API = "/v1.45"


class FakeEngine:
    """The daemon's state and what it was asked; ``serve`` puts it on ``path``."""

    def __init__(self, images: tuple[str, ...] = ("alpine:3.19",)) -> None:
        self.images = set(images)
        # What /version answers; Podman's compatible API adds its Components (as 5.4 does).
        self.version: dict[str, Any] = {"ApiVersion": "1.45", "Version": "27.5.1"}
        self.containers: dict[str, dict[str, Any]] = {}
        self.volumes: dict[str, dict[str, Any]] = {}
        self.networks: dict[str, dict[str, Any]] = {
            "bridge": {"Name": "bridge", "Driver": "bridge", "IPAM": _ipam("172.17.0.0/16")}
        }
        self.asked: list[tuple[str, str, dict[str, list[str]], Any]] = []
        self.start_error: tuple[int, str] | None = None
        # The next starts' and removals' answers, one each, before they go through: what
        # dockerd says when containerd runs out of its own time on a busy host.
        self.start_failures: list[tuple[int, str]] = []
        self.remove_failures: list[tuple[int, str]] = []
        self.removing: set[str] = set()
        self.slow = 0.0
        self.running = self.peak = 0
        self.connections = 0
        self.lock = threading.Lock()
        self._server: _Server | None = None

    def serve(self, path: Path) -> FakeEngine:
        self._server = _Server(str(path), _handler(self))
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def drop_idle_connections(self) -> None:
        """Close every connection between requests, as a daemon restarting would."""
        assert self._server is not None
        self._server.close_all()

    # --- answers --------------------------------------------------------------------------

    def answer(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> Reply:
        with self.lock:
            self.asked.append((method, path, query, body))
        if path == "/version":
            return 200, self.version
        if not path.startswith(API + "/"):
            return 400, {"message": f"client version not supported: {path}"}
        parts = [unquote(p) for p in path[len(API) + 1 :].split("/")]
        route = getattr(self, f"_{method.lower()}_{parts[0]}", None)
        if route is None:
            return 404, {"message": "page not found"}
        reply: Reply = route(parts[1:], query, body)
        return reply

    def _post_containers(self, rest: list[str], query: dict[str, list[str]], body: Any) -> Reply:
        if rest == ["create"]:
            return self._create(query["name"][0], body)
        container = self.containers.get(rest[0])
        if container is None:
            return 404, {"message": f"No such container: {rest[0]}"}
        if rest[1:] == ["start"]:
            self._busy()
            if self.start_error is not None:
                return self.start_error[0], {"message": self.start_error[1]}
            if self.start_failures:
                status, message = self.start_failures.pop(0)
                return status, {"message": message}
            container["Status"] = "running"
            return 204, None
        return 404, {"message": "page not found"}

    def _create(self, name: str, body: Any) -> Reply:
        if body["Image"] not in self.images:
            return 404, {"message": f"No such image: {body['Image']}"}
        if any(c["Name"] == f"/{name}" for c in self.containers.values()):
            return 409, {"message": f'Conflict. The container name "/{name}" is already in use'}
        cid = uuid.uuid4().hex * 2
        self.containers[cid] = {"Id": cid, "Name": f"/{name}", "Body": body, "Status": "created"}
        return 201, {"Id": cid, "Warnings": []}

    def _get_containers(self, rest: list[str], query: dict[str, list[str]], body: Any) -> Reply:
        if rest == ["json"]:
            wanted = json.loads(query.get("filters", ["{}"])[0]).get("label", [])
            listed = [
                {
                    "Id": c["Id"],
                    "Names": [c["Name"]],
                    "Labels": c["Body"]["Labels"],
                    "State": c["Status"],
                }
                for c in self.containers.values()
                if all(_has_label(c["Body"]["Labels"], label) for label in wanted)
            ]
            return 200, listed
        container = self.containers.get(rest[0])
        if container is None:
            return 404, {"message": f"No such container: {rest[0]}"}
        state = {"Status": container["Status"], "Running": container["Status"] == "running"}
        config = {"Labels": container["Body"]["Labels"]}
        return 200, {"Id": container["Id"], "Name": container["Name"], "Config": config,
                     "State": state | {"Pid": 4242}}  # fmt: skip

    def _delete_containers(self, rest: list[str], query: dict[str, list[str]], _: Any) -> Reply:
        cid = rest[0]
        if cid in self.removing:
            return 409, {"message": f"removal of container {cid} is already in progress"}
        if cid not in self.containers:
            return 404, {"message": f"No such container: {cid}"}
        self._busy()
        if self.remove_failures:
            status, message = self.remove_failures.pop(0)
            return status, {"message": message}
        del self.containers[cid]
        return 204, None

    def _get_images(self, rest: list[str], query: dict[str, list[str]], _: Any) -> Reply:
        image = "/".join(rest[:-1])
        if image in self.images:
            return 200, {"Id": "sha256:" + "0" * 64, "RepoTags": [image]}
        return 404, {"message": f"No such image: {image}"}

    def _delete_images(self, rest: list[str], query: dict[str, list[str]], _: Any) -> Reply:
        """A removal without force of the last reference of an image a container was made
        from is refused 409, as dockerd refuses it; with ``force`` it is untagged."""
        image = "/".join(rest)
        if image not in self.images:
            return 404, {"message": f"No such image: {image}"}
        used = [c["Id"] for c in self.containers.values() if c["Body"]["Image"] == image]
        if used and "force" not in query:
            return 409, {
                "message": f'conflict: unable to remove repository reference "{image}" (must '
                f"force) - container {used[0][:12]} is using its referenced image"
            }
        self.images.discard(image)
        return 200, [{"Untagged": image}]

    def _post_images(self, rest: list[str], query: dict[str, list[str]], _: Any) -> Reply:
        """``POST /images/{name}/tag?repo=&tag=``."""
        image = "/".join(rest[:-1])
        if rest[-1:] != ["tag"] or image not in self.images:
            return 404, {"message": f"No such image: {image}"}
        self.images.add(f"{query['repo'][0]}:{query['tag'][0]}")
        return 201, None

    def _get_networks(self, rest: list[str], query: dict[str, list[str]], _: Any) -> Reply:
        filters = json.loads(query.get("filters", ["{}"])[0])
        names, drivers = filters.get("name"), filters.get("driver")
        return 200, [
            n
            for n in self.networks.values()
            if (not names or n["Name"] in names) and (not drivers or n["Driver"] in drivers)
        ]

    def _post_networks(self, rest: list[str], query: dict[str, list[str]], body: Any) -> Reply:
        if body["Name"] in self.networks:
            return 409, {"message": f"network with name {body['Name']} already exists"}
        subnet = f"172.{18 + len(self.networks)}.0.0/16"
        self.networks[body["Name"]] = {"IPAM": _ipam(subnet), **body}
        return 201, {"Id": body["Name"], "Warning": ""}

    def _post_volumes(self, rest: list[str], query: dict[str, list[str]], body: Any) -> Reply:
        name = body["Name"]
        volume = {"Name": name, "Labels": body.get("Labels") or {}, "Mountpoint": f"/v/{name}"}
        self.volumes.setdefault(name, volume)
        return 201, self.volumes[name]

    def _get_volumes(self, rest: list[str], query: dict[str, list[str]], _: Any) -> Reply:
        if rest:
            volume = self.volumes.get(rest[0])
            return (200, volume) if volume else (404, {"message": f"no such volume: {rest[0]}"})
        wanted = json.loads(query.get("filters", ["{}"])[0]).get("label", [])
        found = [
            v for v in self.volumes.values() if all(_has_label(v["Labels"], w) for w in wanted)
        ]
        return 200, {"Volumes": found, "Warnings": None}

    def _delete_volumes(self, rest: list[str], query: dict[str, list[str]], _: Any) -> Reply:
        name = rest[0]
        if name not in self.volumes:
            return 404, {"message": f"get {name}: no such volume"}
        if any(
            m.get("Source") == name
            for c in self.containers.values()
            for m in c["Body"]["HostConfig"].get("Mounts") or []
        ):
            return 409, {"message": f"remove {name}: volume is in use - [{name}]"}
        del self.volumes[name]
        return 204, None

    def _busy(self) -> None:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(self.slow)
        with self.lock:
            self.running -= 1


Reply = tuple[int, Any]


def _ipam(subnet: str) -> dict[str, Any]:
    return {"Config": [{"Subnet": subnet}]}


def _has_label(labels: dict[str, str], wanted: str) -> bool:
    key, _, value = wanted.partition("=")
    return key in labels and (not value or labels[key] == value)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, handler: type[BaseHTTPRequestHandler]) -> None:
        self.open: set[Any] = set()
        super().__init__(path, handler)

    def close_all(self) -> None:
        for sock in list(self.open):
            sock.shutdown(socket.SHUT_RDWR)


def _handler(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as dockerd

        def setup(self) -> None:
            super().setup()
            server: Any = self.server
            server.open.add(self.connection)
            with engine.lock:
                engine.connections += 1

        def finish(self) -> None:
            server: Any = self.server
            server.open.discard(self.connection)
            super().finish()

        def address_string(self) -> str:
            return "docker.sock"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            status, reply = engine.answer(self.command, url.path, parse_qs(url.query), body)
            data = b"" if reply is None else json.dumps(reply).encode()
            self.send_response(status)
            if data:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _answer

    return Handler
