"""Finding the container engine: DOCKER_HOST, the Docker context, then the known sockets.

The order is Docker's own CLI's for what the user chose: ``DOCKER_HOST``, else the context
``DOCKER_CONTEXT`` names, else the config's ``currentContext`` (``$DOCKER_CONFIG/config.json``,
by default ``~/.docker/config.json`` of the agent's user), whose endpoint is in
``contexts/meta/<sha256 of the name>/meta.json``. A choice made there is kept even when its
daemon does not answer: that daemon's failure is reported, never hidden behind another engine.

With no choice made (no DOCKER_HOST, no context or the ``default`` one), where Docker's CLI
takes ``/var/run/docker.sock`` blindly, the first of the known sockets that accepts a connection
is used: the system daemon's (``/var/run/docker.sock``, ``/run/docker.sock``), the user's
rootless daemon's (``$XDG_RUNTIME_DIR/docker.sock``), then Podman's Docker-compatible API, the
system service's (``/run/podman/podman.sock``) and the user's. A socket that refuses (no daemon,
or not the user's to open) is passed over. When none accepts, the first that exists is named,
so the error says which daemon is down; with none at all, Docker's default socket.

Connecting to a socket systemd holds (``docker.socket``) starts the daemon: that is a connection
accepted, as the daemon's own would be.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ConfigDict

from slicebox.backends.dockerendpoint import DockerEndpoint, endpoint_from_env, parse_docker_host
from slicebox.model.base import Model
from slicebox.model.errors import Unavailable
from slicebox.model.paths import DOCKER_SOCKET

PROBE_TIMEOUT = 2.0
DEFAULT_CONTEXT = "default"
CONTEXT_CODE = "docker_context_unknown"
CONFIG_CODE = "docker_config_invalid"


class FoundEngine(Model):
    """The engine the agent talks to, and how it was found (for ``doctor`` and the log)."""

    model_config = ConfigDict(frozen=True)

    endpoint: DockerEndpoint
    source: str  # "DOCKER_HOST", "the Docker context 'x'", "the rootless Docker socket", ...
    answered: bool = True  # False: no known socket accepted; this is the first that exists

    def describe(self) -> str:
        quiet = "" if self.answered else ", which did not answer"
        return f"{self.endpoint.base_url} ({self.source}{quiet})"


def known_sockets(env: Mapping[str, str], uid: int) -> list[tuple[str, str]]:
    """The sockets tried in order when nothing is chosen: (path, what it is)."""
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    return [
        (DOCKER_SOCKET, "the system's Docker socket"),
        ("/run/docker.sock", "the system's Docker socket"),
        (f"{runtime}/docker.sock", "the rootless Docker socket"),
        ("/run/podman/podman.sock", "Podman's socket"),
        (f"{runtime}/podman/podman.sock", "the rootless Podman socket"),
    ]


def accepts(path: str) -> bool:
    """Whether a unix socket at ``path`` accepts a connection (closed again at once)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(PROBE_TIMEOUT)
    try:
        sock.connect(path)
    except OSError:  # none there, refused, not ours to open, or no answer in time
        return False
    finally:
        sock.close()
    return True


def docker_config_dir(env: Mapping[str, str], uid: int) -> Path:
    """``$DOCKER_CONFIG``, else ``.docker`` in ``$HOME`` or the user's home directory."""
    if env.get("DOCKER_CONFIG"):
        return Path(env["DOCKER_CONFIG"])
    home = env.get("HOME")
    if not home:
        with contextlib.suppress(KeyError):
            home = pwd.getpwuid(uid).pw_dir
    return Path(home or "/") / ".docker"


def discover(
    env: Mapping[str, str] | None = None,
    *,
    uid: int | None = None,
    config_dir: Path | None = None,
    sockets: Sequence[tuple[str, str]] | None = None,
    answers: Callable[[str], bool] = accepts,
) -> FoundEngine:
    """The engine to use; Unavailable (with its code) for a choice slicebox cannot follow.
    ``config_dir`` and ``sockets`` (path, what) stand in for the user's and the known ones."""
    env = os.environ if env is None else env
    uid = os.geteuid() if uid is None else uid
    if env.get("DOCKER_HOST"):
        return FoundEngine(endpoint=endpoint_from_env(env), source="DOCKER_HOST")
    directory = docker_config_dir(env, uid) if config_dir is None else config_dir
    name, named_by = _context_name(env, directory)
    if name and name != DEFAULT_CONTEXT:
        endpoint = _context_endpoint(directory, name, named_by)
        return FoundEngine(endpoint=endpoint, source=f"the Docker context {name!r}")
    return _first_socket(known_sockets(env, uid) if sockets is None else sockets, answers)


def _context_name(env: Mapping[str, str], directory: Path) -> tuple[str, str]:
    if env.get("DOCKER_CONTEXT"):
        return env["DOCKER_CONTEXT"], "DOCKER_CONTEXT"
    config = directory / "config.json"
    said = _json_file(config, "the Docker config")
    if said is None:
        return "", ""
    if not isinstance(said, dict):
        raise _bad_config(config, "is not a JSON object")
    name = said.get("currentContext") or ""
    if not isinstance(name, str):
        raise _bad_config(config, "has a currentContext that is not a name")
    return name, str(config)


def _context_endpoint(directory: Path, name: str, named_by: str) -> DockerEndpoint:
    digest = hashlib.sha256(name.encode()).hexdigest()
    meta_path = directory / "contexts" / "meta" / digest / "meta.json"
    meta = _json_file(meta_path, f"the Docker context {name!r}")
    host = _docker_host_of(meta)
    if host is None:
        raise Unavailable(
            f"the Docker context {name!r} ({named_by} names it) has no Docker endpoint in "
            f"{meta_path}; create it (`docker context create`), choose another "
            "(`docker context use`), or set DOCKER_HOST",
            code=CONTEXT_CODE,
        )
    if (directory / "contexts" / "tls" / digest / "docker").exists():
        raise Unavailable(
            f"the Docker context {name!r} uses TLS, which slicebox does not support; point "
            "DOCKER_HOST at the daemon's unix socket or a plain tcp://host:port reachable only "
            "by this host",
            code="docker_tls_unsupported",
        )
    try:
        return parse_docker_host(host)
    except Unavailable as exc:
        raise Unavailable(
            f"the Docker context {name!r} ({named_by}): {exc.message}", code=exc.code
        ) from exc


def _docker_host_of(meta: Any) -> str | None:
    if not isinstance(meta, dict):
        return None
    endpoints = meta.get("Endpoints")
    docker = endpoints.get("docker") if isinstance(endpoints, dict) else None
    host = docker.get("Host") if isinstance(docker, dict) else None
    return host if isinstance(host, str) and host else None


def _first_socket(
    candidates: Sequence[tuple[str, str]], answers: Callable[[str], bool]
) -> FoundEngine:
    tried: set[str] = set()
    existing: list[tuple[str, str]] = []
    for path, what in candidates:
        real = os.path.realpath(path)  # /var/run is /run on most hosts: one daemon, one probe
        if real in tried:
            continue
        tried.add(real)
        if answers(path):
            return FoundEngine(endpoint=DockerEndpoint(scheme="unix", address=path), source=what)
        if os.path.exists(path):
            existing.append((path, what))
    path, what = existing[0] if existing else (DOCKER_SOCKET, "Docker's default socket")
    endpoint = DockerEndpoint(scheme="unix", address=path)
    return FoundEngine(endpoint=endpoint, source=what, answered=False)


def _json_file(path: Path, what: str) -> Any:
    """The file's JSON, None when there is no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _bad_config(path, f"cannot be read ({exc.strerror})", what) from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _bad_config(path, "is not valid JSON", what) from exc


def _bad_config(path: Path, problem: str, what: str = "the Docker config") -> Unavailable:
    return Unavailable(
        f"{what} {path} {problem}; mend it, or set DOCKER_HOST to choose the engine",
        code=CONFIG_CODE,
    )
