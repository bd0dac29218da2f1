"""The Docker backend's requests and answers as data: what a sandbox request asks of the
Engine API, and what its answers say, with no call made here (pure; table-tested).

- The create settings. :func:`host_settings` turns a :class:`SandboxRequest` into data, one
  :class:`Setting` per HostConfig field with its ``docker run`` flag beside it, security
  defaults included (all capabilities dropped, no-new-privileges, network ``none`` unless asked,
  an init, pids/memory/swap/cpu limits, the project slice as cgroup parent). The Engine API's
  HostConfig (:func:`host_config`) and the equivalent CLI flags (:func:`run_flags`, the bench's
  baseline) are both derived from that one list, so they cannot drift apart.
- The workspace. Exec's default cwd is ``/workspace``, which stock images (alpine) lack. When no
  mount targets it, the sandbox gets a tmpfs there: it costs no disk and no cleanup, it is gone
  with the container, and its pages are charged to the sandbox's memory cgroup, so the sandbox's
  own memory limit bounds it. Its size is half that limit, so filling it answers ENOSPC to the
  writer instead of an OOM kill of the sandbox; mode 1777 (as /tmp) lets whatever user the
  sandbox runs as write there. Programs may run from it (``exec``, where Docker's tmpfs default
  is ``noexec``), as they may from a bind-mounted workspace: an agent builds and runs code
  there, and noexec would guard nothing that no-new-privileges and no capabilities do not.
  A fork's ``/workspace`` is its snapshot image's own (``workspace_in_image``): no tmpfs, the
  engine's copy-on-write layer, bounded like the rest of the root filesystem, not by memory.
- The bodies of a container's and an exec's create, as docker-py builds them for the same
  calls, and the answers of an inspect, a list, an exec inspect and a volume as slicebox's
  records.

Kept apart from :mod:`slicebox.backends.docker`, which makes the calls, so that the bench and
the tests read the very settings a create sends without a daemon.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import quote

from slicebox.backends.base import (
    WORKSPACE,
    SandboxInfo,
    SandboxRequest,
    SandboxState,
    VolumeInfo,
    mounts_workspace,
)
from slicebox.model.exec import ExecRequest, ExecState
from slicebox.model.limits import nano_cpus
from slicebox.model.spec import Mount, MountKind

NO_NEW_PRIVILEGES = "no-new-privileges:true"
# What ``"network": "bridge"`` joins: one network of slicebox's with inter-container traffic
# off, so no sandbox reaches another (alice's not bob's); its bridge device's name.
BRIDGE_NETWORK, BRIDGE = "slicebox-bridge", "sbx-bridge"


class Setting(NamedTuple):
    """One create setting: its HostConfig field and value, and the same as ``docker run``."""

    key: str  # the Engine API HostConfig field
    value: object  # its value there
    flag: str  # the equivalent ``docker run`` flag
    args: tuple[str, ...] | None = None  # one flag per argument; None: a bare switch


def host_settings(request: SandboxRequest) -> list[Setting]:
    """The create settings of ``request``, security defaults first (pure; table-tested)."""
    limits, caps = request.limits, request.cap_add
    mounts = [_mount(m) for m in request.mounts]
    tmpfs = _workspace(request)
    network = docker_network(request.network)
    return [
        Setting("CapDrop", ["ALL"], "--cap-drop", ("ALL",)),
        Setting("CapAdd", list(caps), "--cap-add", caps),
        Setting("SecurityOpt", [NO_NEW_PRIVILEGES], "--security-opt", (NO_NEW_PRIVILEGES,)),
        Setting("Privileged", False, "--privileged", ()),
        Setting("NetworkMode", network, "--network", (network,)),
        *_egress_settings(request),
        Setting("Init", True, "--init"),
        Setting("PidsLimit", limits.pids, "--pids-limit", (str(limits.pids),)),
        Setting("Memory", limits.memory_bytes, "--memory", (str(limits.memory_bytes),)),
        # swap limit = memory limit: no swap beyond the memory limit
        Setting("MemorySwap", limits.memory_bytes, "--memory-swap", (str(limits.memory_bytes),)),
        Setting("NanoCpus", nano_cpus(limits.cpus), "--cpus", (repr(limits.cpus),)),
        Setting("CgroupParent", request.slice, "--cgroup-parent", (request.slice,)),
        Setting("Mounts", [api for api, _ in mounts], "--mount", tuple(cli for _, cli in mounts)),
        Setting("Tmpfs", tmpfs, "--tmpfs", tuple(f"{k}:{v}" for k, v in tmpfs.items())),
    ]


def docker_network(network: str) -> str:
    """The Docker network a sandbox's network mode joins: ``bridge`` is slicebox's own, whose
    containers cannot reach each other (docker0 lets every user's sandboxes talk)."""
    return BRIDGE_NETWORK if network == "bridge" else network


def _egress_settings(request: SandboxRequest) -> list[Setting]:
    """DNS through the agent's resolver, on an egress network (core.egress); the address
    itself is the endpoint's (``create_body``), ``docker run --ip``'s."""
    if not request.dns:
        return []
    return [Setting("Dns", list(request.dns), "--dns", request.dns)]


def host_config(request: SandboxRequest) -> dict[str, object]:
    """The Engine API HostConfig of ``request``."""
    return {setting.key: setting.value for setting in host_settings(request)}


def run_flags(request: SandboxRequest) -> list[str]:
    """``docker run`` flags equivalent to what :class:`DockerBackend` creates (no labels)."""
    flags: list[str] = []
    for setting in host_settings(request):
        if setting.args is None:
            flags.append(setting.flag)
        flags += [f"{setting.flag}={arg}" for arg in setting.args or ()]
    flags += [f"--env={key}={value}" for key, value in request.env.items()]
    flags += [f"--user={request.user}"] if request.user else []
    flags += [f"--ip={request.address}"] if request.address else []
    return flags + ([f"--workdir={request.workdir}"] if request.workdir else [])


def workspace_bytes(request: SandboxRequest) -> int:
    return request.limits.memory_bytes // 2


def _workspace(request: SandboxRequest) -> dict[str, str]:
    """A tmpfs at /workspace unless a mount provides it or the image does (a fork's: see the
    module docstring)."""
    if request.workspace_in_image or mounts_workspace(request.mounts):
        return {}
    return {WORKSPACE: f"rw,exec,nosuid,nodev,size={workspace_bytes(request)},mode=1777"}


def _mount(mount: Mount) -> tuple[dict[str, object], str]:
    kind = "volume" if mount.kind is MountKind.VOLUME else "bind"
    api: dict[str, object] = {
        "Type": kind,
        "Source": mount.source,
        "Target": mount.target,
        "ReadOnly": mount.read_only,
    }
    cli = f"type={kind},source={mount.source},target={mount.target}"
    return api, cli + (",readonly" if mount.read_only else "")


def create_body(request: SandboxRequest) -> dict[str, Any]:
    """The container create's body, as docker-py's ``create_container`` builds it for the same
    call (``detach=True``: nothing attached, no stdin, no tty), without its nulls."""
    body: dict[str, Any] = {
        "Tty": False,
        "OpenStdin": request.open_stdin,
        "StdinOnce": request.open_stdin,
        "AttachStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "Cmd": list(request.command),
        "Image": request.image,
        "NetworkDisabled": False,
        "HostConfig": host_config(request),
        "Labels": dict(request.labels),
    }
    if request.address:
        endpoint = {"IPAMConfig": {"IPv4Address": request.address}}
        body["NetworkingConfig"] = {"EndpointsConfig": {request.network: endpoint}}
    env = [f"{key}={value}" for key, value in request.env.items()] or None
    optional = {"Env": env, "User": request.user, "WorkingDir": request.workdir}
    return body | {key: value for key, value in optional.items() if value is not None}


def exec_body(request: ExecRequest, streamed_stdin: bool) -> dict[str, Any]:
    """The exec create's body, as docker-py's ``exec_create`` builds it for the same call."""
    return {
        "User": "",
        "Privileged": False,
        "Tty": False,
        "AttachStdin": bool(request.stdin) or streamed_stdin,
        "AttachStdout": True,
        "AttachStderr": True,
        "Cmd": list(request.argv),
        "Env": [f"{name}={value}" for name, value in request.env.items()],
        "WorkingDir": request.cwd,
    }


def segment(name: str) -> str:
    """``name`` as one path segment."""
    return quote(name, safe="")


def label_filter(labels: Mapping[str, str]) -> str:
    """A list's filter on ``labels``, as the Engine API takes it (JSON in the query)."""
    return json.dumps({"label": [f"{key}={value}" for key, value in labels.items()]})


# --- answers --------------------------------------------------------------------------------


def inspected(attrs: Mapping[str, Any]) -> SandboxInfo:
    """A container inspect's answer as SandboxInfo."""
    return SandboxInfo(
        id=attrs["Id"],
        name=str(attrs.get("Name", "")).lstrip("/"),
        labels=(attrs.get("Config") or {}).get("Labels") or {},
        state=SandboxState.parse((attrs.get("State") or {}).get("Status")),
        image_id=str(attrs.get("Image") or ""),
    )


def listed(entry: Mapping[str, Any]) -> SandboxInfo:
    """A list entry as SandboxInfo: the listing carries labels and state, no inspect needed."""
    names = entry.get("Names") or [""]
    return SandboxInfo(
        id=entry["Id"],
        name=str(names[0]).lstrip("/"),
        labels=entry.get("Labels") or {},
        state=SandboxState.parse(entry.get("State")),
        image_id=str(entry.get("ImageID") or ""),
    )


def exec_state(data: Mapping[str, Any]) -> ExecState:
    """An exec inspect's answer as ExecState."""
    return ExecState(
        pid=int(data.get("Pid") or 0),
        running=bool(data.get("Running")),
        exit_code=data.get("ExitCode"),
    )


def volume_info(attrs: Mapping[str, Any]) -> VolumeInfo:
    """A volume's answer (inspect, create or list entry) as VolumeInfo."""
    return VolumeInfo(
        name=str(attrs["Name"]),
        labels=attrs.get("Labels") or {},
        mountpoint=str(attrs.get("Mountpoint") or ""),
    )
