"""How the agent's backends are made, in one place: the daemon (``server.runtime.assemble``),
the expiry a deadline timer runs (``assemble_expiry``) and ``slicebox doctor`` build them here,
so what doctor checks is what the agent runs."""

import logging

from slicebox.backends.base import Availability
from slicebox.backends.daytona import DaytonaBackend
from slicebox.backends.docker import DockerBackend
from slicebox.backends.native.backend import NativeBackend, NativeSystemd
from slicebox.backends.router import Backends
from slicebox.core.blocking import on_core_loop
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.config import Config, DaytonaConfig

log = logging.getLogger(__name__)


def docker_backend() -> DockerBackend:
    """The container engine as ``DOCKER_HOST`` (or the engines found) names it."""
    return DockerBackend.from_env()


def native_backend(systemd: NativeSystemd | None = None, *, workers: int = 4) -> NativeBackend:
    """Sandboxes as systemd units on this host; ``workers``: its threads for D-Bus calls."""
    return NativeBackend(systemd if systemd is not None else PystemdSystemd(), workers=workers)


def daytona_backend(remote: DaytonaConfig, key: str) -> DaytonaBackend:
    """The Daytona API ``[daytona]`` names, with the key read from its file; its blocking calls
    are awaited on the core loop."""
    return DaytonaBackend(remote.api_url, key, remote.target, portal=on_core_loop)


def daytona_availability(remote: DaytonaConfig, key: str) -> Availability:
    """Whether that Daytona API answers (doctor's one question); the client that asked is
    closed after, as nothing asks it again."""
    backend = daytona_backend(remote, key)
    try:
        return backend.availability()
    finally:
        on_core_loop(backend.aclose)


def remote_backend(config: Config) -> DaytonaBackend | None:
    """The Daytona API the config names, if any; its key read from its file now. A key that
    cannot be read leaves the backend out (and says why): the rest of the agent runs on."""
    if config.daytona is None:
        return None
    try:
        key = config.daytona.api_key()
    except ValueError as exc:
        log.error("the daytona backend is not enabled: %s", exc)
        return None
    return daytona_backend(config.daytona, key)


def backends(
    config: Config | None, systemd: NativeSystemd, docker: DockerBackend | None = None
) -> Backends:
    """Every backend behind the router: Docker, native (with wasm), and the remote one
    ``config`` names (none without a config: the expiry command reads none)."""
    return Backends(
        docker if docker is not None else docker_backend(),
        native_backend(systemd),
        daytona=remote_backend(config) if config is not None else None,
    )
