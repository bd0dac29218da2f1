"""A local stand-in for the Daytona API and its sandboxes' toolbox, over real HTTP.

The daytona backend's tests run the real SDK against this: the routes the SDK calls for what the
backend does, found in the SDK's generated clients, and answers built from the SDK's own API
models (``daytona_api_client.models.Sandbox(...).to_dict()``, the toolbox client's
``ExecuteResponse``), so that a change of the SDK's wire breaks the tests instead of the agent.

- ``GET /api/sandbox`` (``labels`` a JSON object, every one matched), ``POST /api/sandbox``
  (``CreateSandbox``; the image is the build's ``FROM``), ``GET|DELETE /api/sandbox/<id or
  name>``, ``POST /api/sandbox/<id>/start``, ``GET /api/sandbox/<id>/toolbox-proxy-url``;
- the toolbox at ``/toolbox/<id>``: ``POST /process/execute`` runs the command with ``sh -c``
  on this host, in the sandbox's own directory, and answers its exit code and its stdout and
  stderr combined (500 while ``execute_fails``); ``POST /files/bulk-upload`` writes multipart
  files there and ``DELETE /files?path=`` removes one;
- ``/api/socket.io/`` answers 404: the SDK's event stream falls back to polling;
- every other call wants the API key as a bearer token (401 otherwise).

A sandbox's paths are below its directory: the exec's ``cwd`` and an upload's path are taken
relative to it (``/`` is the directory itself); a command sees the host's filesystem otherwise,
so the backend's wrapper names every path relative to its ``/`` cwd. The image
:data:`FAILING_IMAGE` makes a sandbox that ends in state ``error`` instead of starting.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from daytona_api_client.models.create_sandbox import CreateSandbox
from daytona_api_client.models.list_sandboxes_response import ListSandboxesResponse
from daytona_api_client.models.sandbox import Sandbox
from daytona_api_client.models.sandbox_list_item import SandboxListItem
from daytona_api_client.models.sandbox_state import SandboxState
from daytona_api_client.models.toolbox_proxy_url import ToolboxProxyUrl
from daytona_toolbox_api_client.models.execute_request import ExecuteRequest
from daytona_toolbox_api_client.models.execute_response import ExecuteResponse

FAILING_IMAGE = "slicebox-test/fails-to-start:1"
ORGANIZATION = "org-stand-in"
DEFAULT_TIMEOUT = 10  # seconds: what the toolbox says its execute defaults to


@dataclass
class Box:
    """One sandbox the stand-in holds: its API model and its directory."""

    dto: Sandbox
    root: Path
    image: str
    executed: list[ExecuteRequest] = field(default_factory=list)


class StandIn:
    """The Daytona API in memory, served on 127.0.0.1 at a port of its own."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.boxes: dict[str, Box] = {}
        self.creates: list[CreateSandbox] = []  # every create's body, as the SDK sent it
        self.execute_fails = False  # process/execute answers 500 (Daytona's side failing)
        self.lock = threading.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="daytona-stand-in-"))
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.stand_in = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def toolbox_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/toolbox"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- what the routes do ---------------------------------------------------------------------

    def find(self, id_or_name: str) -> Box | None:
        with self.lock:
            box = self.boxes.get(id_or_name)
            if box is None:
                box = next((b for b in self.boxes.values() if b.dto.name == id_or_name), None)
            return box

    def create(self, body: CreateSandbox) -> Sandbox:
        sandbox_id = str(uuid.uuid4())
        dockerfile = body.build_info.dockerfile_content if body.build_info else ""
        image = next(
            (
                line.split(None, 1)[1].strip()
                for line in dockerfile.splitlines()
                if line[:5] == "FROM "
            ),
            body.snapshot or "",
        )
        fails = image == FAILING_IMAGE
        dto = Sandbox(
            id=sandbox_id,
            organization_id=ORGANIZATION,
            name=body.name or sandbox_id,
            snapshot=body.snapshot,
            user=body.user or "daytona",
            env=dict(body.env or {}),
            labels=dict(body.labels or {}),
            public=bool(body.public),
            network_block_all=bool(body.network_block_all),
            kvm=False,
            target=body.target or "us",
            cpu=body.cpu if body.cpu is not None else 1,
            gpu=body.gpu or 0,
            memory=body.memory if body.memory is not None else 1,
            disk=body.disk if body.disk is not None else 3,
            state=SandboxState.ERROR if fails else SandboxState.STARTED,
            error_reason="its image's entrypoint exited at once" if fails else None,
            toolbox_proxy_url=self.toolbox_url,
        )
        root = self._dir / sandbox_id
        root.mkdir()
        with self.lock:
            if any(b.dto.name == dto.name for b in self.boxes.values()):
                raise _Refusal(409, f"a sandbox named {dto.name} exists")
            self.creates.append(body)
            self.boxes[sandbox_id] = Box(dto, root, image)
        return dto

    def listed(self, labels: dict[str, str]) -> ListSandboxesResponse:
        with self.lock:
            boxes = list(self.boxes.values())
        items = [
            _list_item(box.dto)
            for box in boxes
            if all(box.dto.labels.get(key) == value for key, value in labels.items())
        ]
        return ListSandboxesResponse(items=items, next_cursor=None)

    def delete(self, id_or_name: str) -> Sandbox:
        box = self.find(id_or_name)
        if box is None:
            raise _Refusal(404, f"Sandbox with ID or name {id_or_name} not found")
        with self.lock:
            self.boxes.pop(box.dto.id, None)
        shutil.rmtree(box.root, ignore_errors=True)
        box.dto.state = SandboxState.DESTROYING
        return box.dto

    def execute(self, box: Box, request: ExecuteRequest) -> ExecuteResponse:
        box.executed.append(request)
        cwd = inside(box.root, request.cwd or "/")
        if not cwd.is_dir():
            raise _Refusal(400, f"cwd {request.cwd} does not exist")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(box.root)}
        env.update(box.dto.env or {})
        env.update(request.envs or {})
        try:
            done = subprocess.run(
                ["sh", "-c", request.command],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=request.timeout or DEFAULT_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise _Refusal(408, "command execution timeout") from None
        code = done.returncode if done.returncode >= 0 else 128 - done.returncode
        return ExecuteResponse(exit_code=code, result=done.stdout.decode(errors="replace"))

    def upload(self, box: Box, files: dict[str, bytes]) -> None:
        for index in range(len(files)):
            path = files.get(f"files[{index}].path")
            data = files.get(f"files[{index}].file")
            if path is None or data is None:
                break
            target = inside(box.root, path.decode())
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def inside(root: Path, path: str) -> Path:
    """A sandbox path below the sandbox's directory (one that would leave it is refused)."""
    target = (root / path.lstrip("/")).resolve()
    if target != root.resolve() and root.resolve() not in target.parents:
        raise _Refusal(400, f"path {path} leaves the sandbox")
    return target


def _list_item(dto: Sandbox) -> SandboxListItem:
    names = [name for name in SandboxListItem.model_fields if name != "additional_properties"]
    return SandboxListItem(**{name: getattr(dto, name) for name in names if hasattr(dto, name)})


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Handler(BaseHTTPRequestHandler):
    """One request: the route it names, answered as JSON."""

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    @property
    def stand_in(self) -> StandIn:
        stand_in: StandIn = self.server.stand_in  # type: ignore[attr-defined]
        return stand_in

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        parts = [unquote(part) for part in url.path.strip("/").split("/")]
        try:
            body = self._body()
            if parts[:2] == ["api", "socket.io"]:
                raise _Refusal(404, "no event stream here")
            if self.headers.get("Authorization") != f"Bearer {self.stand_in.api_key}":
                raise _Refusal(401, "Unauthorized")
            answer = self._route(method, parts, parse_qs(url.query), body)
        except _Refusal as refusal:
            self._answer(refusal.status, {"statusCode": refusal.status, "message": refusal.message})
            return
        self._answer(200, answer)

    def _route(
        self, method: str, parts: list[str], query: dict[str, list[str]], body: bytes
    ) -> Any:
        if parts[:2] == ["api", "sandbox"]:
            return self._api(method, parts[2:], query, body)
        if parts[:1] == ["toolbox"] and len(parts) >= 3 and method in ("POST", "DELETE"):
            return self._toolbox(method, parts[1], parts[2:], query, body)
        raise _Refusal(404, f"no route {method} /{'/'.join(parts)}")

    def _api(self, method: str, rest: list[str], query: dict[str, list[str]], body: bytes) -> Any:
        """``/api/sandbox...``: the sandboxes."""
        stand_in = self.stand_in
        if not rest and method == "GET":
            labels = json.loads(query["labels"][0]) if "labels" in query else {}
            return stand_in.listed(labels).to_dict()
        if not rest and method == "POST":
            create = CreateSandbox.from_dict(json.loads(body))
            if create is None:
                raise _Refusal(400, "no body")
            return stand_in.create(create).to_dict()
        if len(rest) == 1 and method == "DELETE":
            return stand_in.delete(rest[0]).to_dict()
        box = stand_in.find(rest[0]) if rest else None
        if box is None:
            raise _Refusal(404, f"Sandbox with ID or name {rest[:1]} not found")
        if rest[1:] == ["start"] and method == "POST":
            box.dto.state = SandboxState.STARTED
        elif rest[1:] == ["toolbox-proxy-url"] and method == "GET":
            return ToolboxProxyUrl(url=stand_in.toolbox_url).to_dict()
        elif rest[1:] or method != "GET":
            raise _Refusal(404, f"no route {method} /api/sandbox/{'/'.join(rest)}")
        return box.dto.to_dict()

    def _toolbox(
        self, method: str, sandbox: str, rest: list[str], query: dict[str, list[str]], body: bytes
    ) -> Any:
        """``/toolbox/<id>/...``: a started sandbox's execute and upload."""
        box = self.stand_in.find(sandbox)
        if box is None:
            raise _Refusal(404, "no such sandbox")
        if box.dto.state != SandboxState.STARTED:
            raise _Refusal(409, "the sandbox is not started")
        if method == "DELETE":
            if rest != ["files"] or not query.get("path"):
                raise _Refusal(404, f"no route DELETE /toolbox/{sandbox}/{'/'.join(rest)}")
            target = inside(box.root, query["path"][0])
            if not target.is_file():
                raise _Refusal(404, f"no such file {query['path'][0]}")
            target.unlink()
            return {}
        if rest == ["process", "execute"]:
            if self.stand_in.execute_fails:
                raise _Refusal(500, "the toolbox could not run the command")
            request = ExecuteRequest.from_dict(json.loads(body))
            if request is None:
                raise _Refusal(400, "no body")
            return self.stand_in.execute(box, request).to_dict()
        if rest == ["files", "bulk-upload"]:
            self.stand_in.upload(box, _multipart(self.headers.get("Content-Type", ""), body))
            return {}
        raise _Refusal(404, f"no route POST /toolbox/{sandbox}/{'/'.join(rest)}")

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = bytearray()
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                data += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(data)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(self, status: int, answer: Any) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _multipart(content_type: str, body: bytes) -> dict[str, bytes]:
    """A multipart/form-data body's fields by name, their bytes exactly as sent."""
    boundary = next(
        (p.split("=", 1)[1].strip('"') for p in content_type.split(";") if "boundary=" in p), ""
    )
    if not boundary:
        raise _Refusal(400, "not a multipart body")
    fields: dict[str, bytes] = {}
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, _, data = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        disposition = next(
            (line for line in head.decode().split("\r\n") if line.lower().startswith("content-d")),
            "",
        )
        name = next(
            (
                p.split("=", 1)[1].strip().strip('"')
                for p in disposition.split(";")
                if p.strip().startswith("name=")
            ),
            "",
        )
        fields[name] = data.removesuffix(b"\r\n")
    return fields


@contextlib.contextmanager
def running(api_key: str) -> Iterator[StandIn]:
    """A stand-in serving until the block ends."""
    stand_in = StandIn(api_key)
    stand_in.start()
    try:
        yield stand_in
    finally:
        stand_in.stop()
