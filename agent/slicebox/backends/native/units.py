"""What a native sandbox's units are made of: pure tables of systemd properties.

Its slice's limits, the hardening its anchor runs with (and every process of the sandbox
inherits from it), who it runs as (:class:`RunAs`: a dynamic user, or the caller's ids for a
host workspace), its anchor (the sandbox's init, or a wasm sandbox's worker), each exec's
scope, and the slice's ``Description`` that carries its labels and ``RunAs`` (where a native
sandbox's lineage lives without a state file). Nothing here asks systemd anything: the backend
starts what these describe, and tests and the benchmark read them as they are.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ConfigDict

from slicebox.backends import wasm
from slicebox.backends.base import SandboxRequest
from slicebox.backends.native.names import INIT_RUNTIME, dynamic_user, init_socket
from slicebox.host.systemd import ServiceStatus
from slicebox.model.base import Model
from slicebox.model.limits import INFINITY, Property, cpu_quota_usec
from slicebox.model.paths import AGENT_SOCKET, NESTED_ROOT
from slicebox.model.wasm import WasmRun

MARK = "slicebox-native "  # a native sandbox slice's Description: this, then its labels
WORKSPACE = "/workspace"
WORKSPACES = "slicebox/native"  # below /run: the anchor's RuntimeDirectory
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The exec's program is found, and its cwd entered, by a shell: a missing program answers 127
# and a missing cwd 126 with the shell's words on stderr, as a Docker exec does.
SHELL = "/bin/sh"
EXEC_WRAPPER = 'cd -- "$1" || exit 126; shift; exec "$@"'
INIT_SCRIPT = Path(__file__).with_name("sandboxinit.py")  # run as a script: stdlib only
# The init is the OOM killer's last choice in its sandbox (its children reset theirs to 0):
# with it every process of the sandbox would go.
INIT_OOM_SCORE = -900
AGENT_UID = 0  # whom the init takes orders from: the agent, root
MS_REC = 16384
CLD_EXITED = 1


class RunAs(Model):
    """Who a native sandbox's units run as, and its workspace: its own dynamic user and a
    runtime directory, or (a host workspace) the caller's uid:gid and their directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str = ""  # "uid:gid"; "": a dynamic user
    workspace: str = ""  # the host directory bound at /workspace; "": its runtime directory
    read_only: bool = False
    jit: bool = False  # writable+executable memory allowed (no MemoryDenyWriteExecute)
    wasm: WasmRun | None = None  # a wasm sandbox: its execs call this plugin (backends.wasm)


def run_as_of(request: SandboxRequest) -> RunAs:
    """A host workspace (the one bind a native sandbox takes) runs as the caller's ids."""
    binds = [m for m in request.mounts if m.target.rstrip("/") == WORKSPACE]
    # Wasmtime compiles the module to machine code: its pages are made executable.
    jit = request.allow_jit or request.wasm is not None
    if not binds:
        return RunAs(jit=jit, wasm=request.wasm)
    bind = binds[0]
    return RunAs(
        user=request.user or "",
        workspace=bind.source,
        read_only=bind.read_only,
        jit=jit,
        wasm=request.wasm,
    )


def describe(labels: Mapping[str, str], run_as: RunAs | None = None) -> str:
    data = {"labels": dict(labels), "run_as": (run_as or RunAs()).model_dump()}
    return MARK + json.dumps(data, sort_keys=True, separators=(",", ":"))


def _described(description: str) -> dict[str, Any] | None:
    if not description.startswith(MARK):
        return None
    try:
        data = json.loads(description[len(MARK) :])
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("labels"), dict):
        return None
    return data


def labels_of(description: str) -> dict[str, str] | None:
    """The labels a native sandbox slice's Description holds; None for any other slice."""
    data = _described(description)
    if data is None:
        return None
    return {str(key): str(value) for key, value in data["labels"].items()}


def run_as_described(description: str) -> RunAs:
    data = _described(description)
    try:
        return RunAs.model_validate((data or {}).get("run_as") or {})
    except ValueError:
        return RunAs()


def slice_properties(request: SandboxRequest) -> list[Property]:
    """The sandbox slice's limits: what ``--memory``, ``--memory-swap``, ``--pids-limit`` and
    ``--cpus`` give a container, as systemd properties."""
    limits = request.limits
    return [
        ("MemoryMax", limits.memory_bytes),
        ("MemorySwapMax", 0),
        ("TasksMax", limits.pids),
        ("CPUQuotaPerSecUSec", cpu_quota_usec(limits.cpus) if limits.cpus else INFINITY),
        ("IOAccounting", 1),  # io.stat, for disk_bytes_written
    ]


def identity(name: str, run_as: RunAs, *, anchor: bool) -> dict[str, Any]:
    """Who the anchor runs as and what is bound at /workspace. The workspace is the anchor's
    runtime directory alone: another unit joined to it (the benchmark's bare exec) that
    declared it too would have systemd move it to /run/private (a preserved runtime directory
    of a dynamic user goes there), away from the anchor's removal."""
    if not run_as.user:
        workspace = {
            "DynamicUser": True,
            "User": dynamic_user(name),
            "BindPaths": [(f"/run/{WORKSPACES}/{name}", WORKSPACE, False, MS_REC)],
        }
        if anchor:
            workspace["RuntimeDirectory"] = [f"{WORKSPACES}/{name}"]
            workspace["RuntimeDirectoryMode"] = 0o700
        return workspace
    uid, _, gid = run_as.user.partition(":")
    bind = "BindReadOnlyPaths" if run_as.read_only else "BindPaths"
    return {
        "User": uid,
        "Group": gid or uid,
        bind: [(run_as.workspace, WORKSPACE, False, MS_REC)],
    }


def hardening(
    name: str, run_as: RunAs | None = None, *, anchor: bool = False, loopback: bool = False
) -> dict[str, Any]:
    """What the sandbox's anchor runs with, and so every process of the sandbox: its exposure,
    as ``systemd-analyze security`` rates it, is held at 2 ("OK") or below by the native guest
    test. ``loopback``: IPv4 and IPv6 sockets on the sandbox's own loopback (``_network``)."""
    return {
        **identity(name, run_as or RunAs(), anchor=anchor),
        **_network(run_as, loopback=loopback),
        # The agent's and the engine's sockets are out of reach whatever groups the sandbox's
        # user has (a host workspace's sandbox runs as its caller, group slicebox included):
        # a sandbox reaches the agent only through a socket made for it (core.nesting).
        "InaccessiblePaths": [f"-{path}" for path in OUT_OF_REACH],
        "PrivateTmp": True,
        "PrivateDevices": True,
        "PrivateIPC": True,
        "PrivateUsers": True,
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "ProtectProc": "invisible",
        "ProcSubset": "pid",
        "NoNewPrivileges": True,
        "CapabilityBoundingSet": 0,
        "AmbientCapabilities": 0,
        "RestrictNamespaces": 0,
        "SystemCallFilter": (True, ["@system-service"]),
        "SystemCallErrorNumber": errno.EPERM,
        "SystemCallArchitectures": ["native"],
        "LockPersonality": True,
        "MemoryDenyWriteExecute": run_as is None or not run_as.jit,
        "ProtectKernelTunables": True,
        "ProtectKernelModules": True,
        "ProtectKernelLogs": True,
        "ProtectControlGroups": True,
        "ProtectClock": True,
        "ProtectHostname": True,
        "RestrictRealtime": True,
        "RestrictSUIDSGID": True,
        "RemoveIPC": True,
        "DevicePolicy": "closed",
        "KeyringMode": "private",
        "UMask": 0o077,
        # The kernel's OOM killer takes what it takes, as in a container; the unit goes on.
        "OOMPolicy": "continue",
        "KillMode": "control-group",
        "KillSignal": 9,
    }


OUT_OF_REACH = (AGENT_SOCKET, "/run/docker.sock", "/run/containerd/containerd.sock")
INET = ["AF_UNIX", "AF_INET", "AF_INET6"]
ANY = [(socket.AF_INET, [0] * 4, 0), (socket.AF_INET6, [0] * 16, 0)]
LOCALHOST = [(socket.AF_INET, [127, 0, 0, 0], 8), (socket.AF_INET6, [0] * 15 + [1], 128)]


def _network(run_as: RunAs | None, *, loopback: bool = False) -> dict[str, Any]:
    """No network: a network namespace of its own, whose one link is its loopback, and every
    address denied. A native sandbox (``loopback``) may open IPv4 and IPv6 sockets there, as a
    container with network ``none`` may: a server one exec starts (``python3 -m http.server``)
    answers the next exec on 127.0.0.1, while the namespace has no route anywhere else and the
    cgroup's filter still drops every packet to or from another address. A wasm sandbox's
    worker has AF_UNIX alone; one with allowed hosts, whose plugin reaches them through its
    runtime's HTTP call (the only network a plugin has, and the runtime refuses every host not
    allowed), shares the host's."""
    if run_as is not None and run_as.wasm is not None and run_as.wasm.allowed_hosts:
        return {"RestrictAddressFamilies": (True, INET)}
    if loopback:
        return {
            "PrivateNetwork": True,
            "IPAddressDeny": ANY,
            "IPAddressAllow": LOCALHOST,
            "RestrictAddressFamilies": (True, INET),
        }
    return {
        "PrivateNetwork": True,
        "IPAddressDeny": ANY,
        "RestrictAddressFamilies": (True, ["AF_UNIX"]),
    }


# systemd's own exit statuses for a unit it could not start (systemd.exec(5)).
_SETUP_FAILURES = {
    200: "its working directory is missing",
    203: "its program is missing",
    216: "its group does not exist on this host",
    217: "its user does not exist on this host",
    226: "its namespaces could not be set up (a bind source missing?)",
}


def how_it_ended(status: ServiceStatus | None) -> str:
    if status is None:
        return "gone"
    why = _SETUP_FAILURES.get(status.status) if status.code == CLD_EXITED else None
    return f"{status.result}, exit status {status.status}" + (f": {why}" if why else "")


def inner_directories(request: SandboxRequest) -> list[str]:
    """A nested sandbox's socket directory (core.innerdirs), which a native sandbox sees at
    its own path: the host's ``/run`` is its own, with every other sandbox's hidden."""
    return [
        m.source
        for m in request.mounts
        if m.kind.value == "bind"
        and m.read_only
        and m.source == m.target
        and Path(m.source).parent == NESTED_ROOT
    ]


def _inner_mounts(request: SandboxRequest) -> dict[str, Any]:
    """The nested sandboxes' directory empty in the sandbox, but for its own socket's."""
    inner = inner_directories(request)
    if not inner:
        return {}
    return {
        "TemporaryFileSystem": [(str(NESTED_ROOT), "ro")],
        "BindReadOnlyPaths": [(path, path, False, MS_REC) for path in inner],
    }


def refusal(request: SandboxRequest) -> str | None:
    """What a native sandbox cannot give that ``request`` asks for; None when nothing."""
    if request.network != "none":
        return f"network {request.network!r} (a native sandbox has no network)"
    inner = inner_directories(request)
    mounts = [m for m in request.mounts if m.source not in inner]
    if any(m.target.rstrip("/") != WORKSPACE or m.kind.value != "bind" for m in mounts):
        return "mounts, workspace volumes and credentials"
    if request.cap_add:
        return "cap_add (a native sandbox has no capability)"
    if request.open_stdin:
        return "a launched one-shot (its waiter)"
    return None


def anchor_properties(
    request: SandboxRequest, unit: str, run_as: RunAs, env_file: Path, runtime: Path
) -> dict[str, Any]:
    """The anchor's unit: the sandbox's init in its slice, or a wasm sandbox's worker;
    ``runtime``: where the init's socket is (``/run/slicebox/init``), or the worker's."""
    if run_as.wasm is not None:
        return worker_properties(request, unit, run_as, env_file, runtime)
    return init_properties(request, unit, run_as, env_file, runtime)


def init_argv(request: SandboxRequest, runtime: Path) -> list[str]:
    """The init (``sandboxinit``), run by the host's python3 isolated from the environment
    (``-I``: the sandbox's own PYTHONPATH is its commands', not the init's) and without the
    site module (``-S``: it imports the standard library alone, and starts sooner)."""
    path = init_socket(runtime, request.name)
    cwd = request.workdir or WORKSPACE
    argv = [sys.executable, "-I", "-S", "-B", str(INIT_SCRIPT), str(path), str(AGENT_UID), cwd]
    return [*argv, *request.command]


def init_properties(
    request: SandboxRequest, unit: str, run_as: RunAs, env_file: Path, runtime: Path
) -> dict[str, Any]:
    """A native sandbox's anchor: its init, PID 1 of a PID namespace of its own
    (``PrivatePIDs``), ready once it listens on its socket in a runtime directory of its own
    (root's and its user's alone). Its environment is the sandbox's: every exec inherits it."""
    properties = hardening(request.name, run_as, anchor=True, loopback=True)
    runtime_dirs = [*properties.get("RuntimeDirectory", []), f"{INIT_RUNTIME}/{request.name}"]
    argv = init_argv(request, runtime)
    inner = _inner_mounts(request)
    if inner:
        inner["BindReadOnlyPaths"] += properties.get("BindReadOnlyPaths", [])
    return {
        **properties,
        **inner,
        "RuntimeDirectory": runtime_dirs,
        "RuntimeDirectoryMode": 0o700,
        "PrivatePIDs": "yes",
        "OOMScoreAdjust": INIT_OOM_SCORE,
        "Description": f"slicebox native sandbox {request.name}",
        "Slice": unit,
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": [(argv[0], argv, False)],
        "EnvironmentFiles": [(str(env_file), True)],
        "Environment": [f"PATH={DEFAULT_PATH}", f"HOME={WORKSPACE}"],
        "StandardInput": "null",
        "StandardOutput": "journal",
        "StandardError": "journal",
    }


def worker_properties(
    request: SandboxRequest, unit: str, run_as: RunAs, env_file: Path, wasm_runtime: Path
) -> dict[str, Any]:
    """A wasm sandbox's anchor: the worker, ready once it listens on its socket in a
    runtime directory of its own (root's and its user's alone)."""
    properties = hardening(request.name, run_as, anchor=True)
    path = wasm.socket_path(wasm_runtime, request.name)
    argv = wasm.anchor_argv(path, WORKSPACE)
    runtime = [*properties.get("RuntimeDirectory", []), f"{wasm.RUNTIME}/{request.name}"]
    return {
        **properties,
        "RuntimeDirectory": runtime,
        "RuntimeDirectoryMode": 0o700,
        "Description": f"slicebox wasm sandbox {request.name}",
        "Slice": unit,
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": [(argv[0], argv, False)],
        "EnvironmentFiles": [(str(env_file), True)],
        "Environment": [
            f"PATH={DEFAULT_PATH}",
            f"HOME={WORKSPACE}",
            f"PYTHONPATH={wasm.python_path()}",
        ],
        "WorkingDirectory": WORKSPACE,
        "StandardInput": "null",
        "StandardOutput": "journal",
        "StandardError": "journal",
    }


def scope_properties(backend_id: str, name: str, pidfd: int) -> dict[str, Any]:
    """An exec's scope in the sandbox slice, made of its one process (a pidfd, never a pid
    number: see ``claims``). What that process forks stays in the scope's cgroup, which the
    sandbox cannot leave: a stop kills all of it at once (SIGKILL to the cgroup, a fork bomb
    included), and the scope lives while anything of it runs, so what an exec leaves in the
    background outlives the exec. An OOM kill in it is the kernel's business: the scope goes
    on."""
    return {
        "Description": f"slicebox exec in {name}",
        "Slice": backend_id,
        "PIDFDs": [pidfd],
        "KillMode": "control-group",
        "KillSignal": 9,
        "OOMPolicy": "continue",
        "CollectMode": "inactive-or-failed",
    }
