"""An authenticated git server for tests on a real host: ``git http-backend`` run as CGI behind
``http.server``, answering only requests with HTTP basic auth for one username and token.

Everything stays on the host: sandboxes on Docker's ``bridge`` network reach it at the
``docker0`` gateway address (:func:`bridge_gateway`). The token lives only in this process's
memory; nothing here puts it in an argv, an environment or a log."""

from __future__ import annotations

import base64
import binascii
import hmac
import io
import json
import os
import shutil
import subprocess
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, ClassVar, cast

REPO = "demo.git"
BRANCH = "main"
README = "hello from the slicebox test server\n"  # the seed commit's only file, README
REALM = "slicebox-test"
PIECE = 64 * 1024


def git(*argv: str, cwd: Path | None = None) -> str:
    """Run the host's git with no user or system config of its own; its stdout."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/nonexistent",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
    }
    done = subprocess.run(
        ["git", *argv], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def bridge_gateway() -> str:
    """The address of the host on Docker's default ``bridge`` network (docker0)."""
    out = subprocess.run(
        ["docker", "network", "inspect", "bridge"], capture_output=True, text=True, check=True
    ).stdout
    [network] = json.loads(out)
    for config in network["IPAM"]["Config"]:
        gateway = config.get("Gateway", "")
        if gateway and ":" not in gateway:
            return str(gateway)
    raise RuntimeError("Docker's bridge network has no IPv4 gateway")


def make_repo(projects: Path) -> Path:
    """A bare ``demo.git`` under ``projects`` that accepts pushes, with one commit on ``main``
    holding the file ``README``."""
    bare = projects / REPO
    git("init", "--quiet", "--bare", f"--initial-branch={BRANCH}", str(bare))
    git("-C", str(bare), "config", "http.receivepack", "true")
    seed = Path(tempfile.mkdtemp(prefix="seed-", dir=projects))
    try:
        git("init", "--quiet", f"--initial-branch={BRANCH}", str(seed))
        (seed / "README").write_text(README)
        git("-C", str(seed), "add", "README")
        ident = ("-c", "user.name=slicebox test", "-c", "user.email=test@slicebox.invalid")
        git("-C", str(seed), *ident, "commit", "--quiet", "-m", "seed")
        git("-C", str(seed), "push", "--quiet", str(bare), f"HEAD:refs/heads/{BRANCH}")
    finally:
        shutil.rmtree(seed)
    return bare


def head_of(bare: Path, branch: str = BRANCH) -> str:
    """The commit ``branch`` of the bare repository points at."""
    return git("--git-dir", str(bare), "rev-parse", f"refs/heads/{branch}").strip()


class GitHandler(BaseHTTPRequestHandler):
    """One request: checked against the credentials, then handed to ``git http-backend``."""

    projects: ClassVar[Path]
    username: ClassVar[str]
    token: ClassVar[str]
    server_version = "slicebox-test-git/1"

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads the repository, not a request log."""

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _authorized(self) -> bool:
        scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        wanted = f"{self.username}:{self.token}".encode()
        return hmac.compare_digest(f"{user}:{password}".encode(), wanted)

    def _refuse(self) -> None:
        body = b"authentication required\n"
        self.send_response(401)
        self.send_header("WWW-Authenticate", f'Basic realm="{REALM}"')
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _cgi_env(self) -> dict[str, str]:
        path, _, query = self.path.partition("?")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": "/nonexistent",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_PROJECT_ROOT": str(self.projects),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GATEWAY_INTERFACE": "CGI/1.1",
            "SERVER_PROTOCOL": self.request_version,
            "SERVER_SOFTWARE": self.server_version,
            "REQUEST_METHOD": self.command,
            "PATH_INFO": urllib.parse.unquote(path),
            "QUERY_STRING": query,
            "REMOTE_USER": self.username,
            "REMOTE_ADDR": self.client_address[0],
            "AUTH_TYPE": "Basic",
        }
        for header, name in (
            ("Content-Type", "CONTENT_TYPE"),
            ("Content-Length", "CONTENT_LENGTH"),
            ("Content-Encoding", "HTTP_CONTENT_ENCODING"),  # http-backend inflates gzip
            ("Git-Protocol", "HTTP_GIT_PROTOCOL"),  # protocol v2
        ):
            value = self.headers.get(header)
            if value is not None:
                env[name] = value
        return env

    def _send_body(self, sink: IO[bytes]) -> None:
        """The request's body into ``sink`` as it arrives (by length, or chunk by chunk)."""
        try:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    copy_exactly(self.rfile, sink, size)
                    self.rfile.readline()  # the chunk's CRLF
                while self.rfile.readline().strip():
                    pass  # trailers
            else:
                copy_exactly(self.rfile, sink, int(self.headers.get("Content-Length") or 0))
        except (OSError, ValueError):
            pass  # the backend stopped reading, or the client sent garbage: the answer says
        finally:
            with suppress(OSError):
                sink.close()

    def _handle(self) -> None:
        self.close_connection = True  # the answer's body ends with the connection
        if not self._authorized():
            self._refuse()
            return
        backend = subprocess.Popen(
            ["git", "http-backend"],
            env=self._cgi_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert backend.stdin is not None
        assert backend.stdout is not None
        feeder = threading.Thread(target=self._send_body, args=(backend.stdin,), daemon=True)
        feeder.start()
        try:
            status, headers = read_cgi_headers(backend.stdout)
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            out = cast(io.BufferedReader, backend.stdout)
            while piece := out.read1(PIECE):
                self.wfile.write(piece)
        finally:
            feeder.join(30)
            backend.stdout.close()
            backend.wait(30)


def copy_exactly(source: io.BufferedIOBase, sink: IO[bytes], size: int) -> None:
    while size > 0:
        piece = source.read(min(size, PIECE))
        if not piece:
            raise ValueError("the request's body ended early")
        sink.write(piece)
        size -= len(piece)
    sink.flush()


def read_cgi_headers(stream: IO[bytes]) -> tuple[int, list[tuple[str, str]]]:
    """A CGI script's header block: its ``Status`` (200 without one) and the other headers."""
    status, headers = 200, []
    while line := stream.readline().decode("latin-1").rstrip("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == "status":
            status = int(value.split()[0])
        else:
            headers.append((name.strip(), value.strip()))
    return status, headers


@contextmanager
def git_server(root: Path, username: str, token: str, host: str) -> Iterator[str]:
    """Serve ``root``'s new bare ``demo.git`` (one commit on ``main``) over HTTP on ``host`` at
    a free port, for ``username`` with ``token`` only; yields the base URL
    (``http://host:port``: the repository is ``<base>/demo.git``)."""
    projects = root / "projects"
    projects.mkdir(parents=True, exist_ok=True)
    make_repo(projects)

    class Bound(GitHandler):
        pass

    Bound.projects, Bound.username, Bound.token = projects, username, token
    server = ThreadingHTTPServer((host, 0), Bound)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="git-server", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def repo_path(root: Path) -> Path:
    """Where :func:`git_server` under ``root`` keeps the bare repository."""
    return root / "projects" / REPO
