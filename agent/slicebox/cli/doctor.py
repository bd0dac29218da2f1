"""``slicebox doctor``: is this host fit for slicebox, and if not, what to fix.

Each check is a small function returning a ``Check`` (data), so the command, the agent's
health and the tests share one list. Paths are parameters so tests can point them at a
temporary tree.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from slicebox.cli.client import Client
from slicebox.model.errors import SliceboxError
from slicebox.model.paths import AGENT_SOCKET, CGROUP_MOUNT, DOCKER_SOCKET

REQUIRED_CONTROLLERS = ("cpu", "memory", "pids", "io")


class Check(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Host:
    proc: Path = Path("/proc")
    cgroup: Path = CGROUP_MOUNT
    agent_socket: str = AGENT_SOCKET
    docker_socket: str = DOCKER_SOCKET


def check_systemd(host: Host) -> Check:
    comm = _read(host.proc / "1" / "comm") or "unknown"
    return Check(
        name="systemd is PID 1",
        ok=comm == "systemd",
        detail=f"PID 1 is {comm}",
        fix="slicebox needs systemd as the init system to manage its slices",
    )


def check_cgroup2(host: Host) -> Check:
    controllers = _read(host.cgroup / "cgroup.controllers")
    return Check(
        name="cgroup v2",
        ok=controllers is not None,
        detail=f"{host.cgroup} is {'cgroup v2' if controllers is not None else 'not cgroup v2'}",
        fix="boot with systemd.unified_cgroup_hierarchy=1 (the default on current distributions)",
    )


def check_controllers(host: Host) -> Check:
    enabled = set((_read(host.cgroup / "cgroup.subtree_control") or "").split())
    missing = [name for name in REQUIRED_CONTROLLERS if name not in enabled]
    return Check(
        name="cgroup controllers",
        ok=not missing,
        detail=f"enabled: {' '.join(sorted(enabled)) or 'none'}",
        fix=f"enable {' '.join(missing)} in the root cgroup (systemd does so for slices with "
        "limits; check the kernel command line for cgroup_disable=)"
        if missing
        else "",
    )


def check_docker(host: Host) -> Check:
    sock = Path(host.docker_socket)
    if sock.exists() and not os.access(sock, os.R_OK | os.W_OK):
        return Check(
            name="docker",
            ok=True,
            detail=f"not checked: {sock} is not yours to use (the agent's is); run doctor as root",
        )
    try:
        import docker

        with docker.APIClient(timeout=10) as api:
            info = api.info()
    except Exception as exc:
        return Check(
            name="docker",
            ok=False,
            detail=f"cannot reach the Docker engine ({exc.__class__.__name__})",
            fix="start docker.service, or set DOCKER_HOST; slicebox falls back to native "
            "sandboxes only when allow_native_fallback is on",
        )
    driver, version = info.get("CgroupDriver"), info.get("CgroupVersion")
    return Check(
        name="docker",
        ok=driver == "systemd" and version == "2",
        detail=f"Docker {info.get('ServerVersion')}, cgroup driver {driver}, cgroup v{version}",
        fix='set "exec-opts": ["native.cgroupdriver=systemd"] in /etc/docker/daemon.json '
        "and restart docker",
    )


def check_agent(host: Host) -> Check:
    try:
        # The first call may start the agent through its socket: allow for its start-up.
        health = Client(host.agent_socket, timeout=90).request("GET", "/health")
    except SliceboxError as exc:
        return Check(
            name="agent", ok=False, detail=exc.message, fix="systemctl start slicebox.socket"
        )
    return Check(
        name="agent",
        ok=True,
        detail=f"sliceboxd {health['version']} answers; you are {health['user']}"
        + (" (admin)" if health["admin"] else ""),
    )


CHECKS: tuple[Callable[[Host], Check], ...] = (
    check_systemd,
    check_cgroup2,
    check_controllers,
    check_docker,
    check_agent,
)


def run_checks(host: Host | None = None) -> list[Check]:
    return [check(host or Host()) for check in CHECKS]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
