"""``slicebox doctor``: is this host fit for slicebox, and if not, what to fix.

Each check is a small function returning a ``Check`` (data), so the command, the agent's
health and the tests share one list. Paths are parameters so tests can point them at a
temporary tree. A check has three states: ``ok``, ``fail`` (with the fix), and ``skip`` when it
could not be made from here (with why, and how to make it): a check not made is not a pass,
nor a failure of the host.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable, Iterable, Iterator
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, NamedTuple

from pydantic import ConfigDict, RootModel, computed_field

from slicebox.client import Client
from slicebox.model.base import Model
from slicebox.model.errors import SliceboxError
from slicebox.model.paths import AGENT_SOCKET, CGROUP_MOUNT, CONFIG_PATH

if TYPE_CHECKING:
    from slicebox.backends.base import Availability
    from slicebox.backends.engines import FoundEngine
    from slicebox.host.beneath import BindRoot

REQUIRED_CONTROLLERS = ("cpu", "memory", "pids", "io")


class State(StrEnum):
    OK = "ok"
    FAIL = "fail"
    SKIP = "skip"


class Check(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    state: State
    detail: str
    fix: str = ""  # for a failure, what to do; for a skip, how to make the check

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """Scripts that read ``ok`` see only a check that was made and passed."""
        return self.state is State.OK


class CheckList(RootModel[list[Check]]):
    model_config = ConfigDict(defer_build=True)  # as slicebox.model.base.Model


def passed(name: str, detail: str) -> Check:
    return Check(name=name, state=State.OK, detail=detail)


def verdict(name: str, ok: bool, detail: str, fix: str) -> Check:
    return Check(name=name, state=State.OK if ok else State.FAIL, detail=detail, fix=fix)


def _discover() -> FoundEngine:
    # Imported when doctor runs, not with every CLI command: the Docker stream module it sits
    # beside would add its import to every command's start-up.
    from slicebox.backends.engines import discover

    return discover()


def _native() -> Availability:
    from slicebox.server.backends import native_backend  # the agent's own composition

    return native_backend(workers=1).availability()


class Host(NamedTuple):
    proc: Path = Path("/proc")
    cgroup: Path = CGROUP_MOUNT
    agent_socket: str = AGENT_SOCKET
    # The container engine as the agent finds it, in this command's environment.
    engine: Callable[[], FoundEngine] = _discover
    # Whether the native backend can run sandboxes here (systemd answers, the programs it
    # runs are there).
    native: Callable[[], Availability] = _native
    config: Path = CONFIG_PATH
    top: Path = Path("/")  # where the walk above a bind root starts (tests: their own tree)
    owner: int = 0  # who may own a bind root and what is above it


def check_systemd(host: Host) -> Check:
    comm = _read(host.proc / "1" / "comm") or "unknown"
    return verdict(
        "systemd is PID 1",
        comm == "systemd",
        f"PID 1 is {comm}",
        "slicebox needs systemd as the init system to manage its slices",
    )


def check_cgroup2(host: Host) -> Check:
    controllers = _read(host.cgroup / "cgroup.controllers")
    return verdict(
        "cgroup v2",
        controllers is not None,
        f"{host.cgroup} is {'cgroup v2' if controllers is not None else 'not cgroup v2'}",
        "boot with systemd.unified_cgroup_hierarchy=1 (the default on current distributions)",
    )


def check_controllers(host: Host) -> Check:
    enabled = set((_read(host.cgroup / "cgroup.subtree_control") or "").split())
    missing = [name for name in REQUIRED_CONTROLLERS if name not in enabled]
    return verdict(
        "cgroup controllers",
        not missing,
        f"enabled: {' '.join(sorted(enabled)) or 'none'}",
        f"enable {' '.join(missing)} in the root cgroup (systemd does so for slices with "
        "limits; check the kernel command line for cgroup_disable=)"
        if missing
        else "",
    )


def check_docker(host: Host) -> Check:
    try:
        found = host.engine()
    except SliceboxError as exc:
        return verdict("docker", False, exc.message, "set DOCKER_HOST, or mend the Docker context")
    endpoint, where = found.endpoint, found.describe()
    sock = Path(endpoint.address) if endpoint.scheme == "unix" else None
    if sock is not None and sock.exists() and not os.access(sock, os.R_OK | os.W_OK):
        return Check(
            name="docker",
            state=State.SKIP,
            detail=f"not checked: {sock} is not yours to use (the agent uses it as root)",
            fix="run `sudo slicebox doctor` to check the Docker engine",
        )
    try:
        import docker

        with docker.APIClient(base_url=endpoint.base_url, timeout=10) as api:
            info = api.info()
    except Exception as exc:
        return verdict(
            "docker",
            False,
            f"cannot reach the Docker engine at {where} ({exc.__class__.__name__})",
            "start docker.service, or set DOCKER_HOST; slicebox falls back to native "
            "sandboxes only when allow_native_fallback is on",
        )
    driver, version = info.get("CgroupDriver"), info.get("CgroupVersion")
    return verdict(
        "docker",
        driver == "systemd" and version == "2",
        f"Docker {info.get('ServerVersion')} at {where}, cgroup driver {driver}, cgroup v{version}",
        'set "exec-opts": ["native.cgroupdriver=systemd"] in /etc/docker/daemon.json '
        "and restart docker",
    )


def check_agent(host: Host) -> Check:
    try:
        # The first call may start the agent through its socket: allow for its start-up.
        health = Client(host.agent_socket, timeout=90).health()
    except SliceboxError as exc:
        return verdict("agent", False, exc.message, "systemctl start slicebox.socket")
    admin = " (admin)" if health.admin else ""
    engine = f"; its engine: {health.engine}" if health.engine else ""
    said = f"sliceboxd {health.version} answers; you are {health.user}{admin}{engine}"
    return passed("agent", said)


def check_native(host: Host) -> Check:
    """The native backend: can it run sandboxes, and does a Docker create fall back to it."""
    from slicebox.model.config import load_config

    answer = host.native()
    try:
        fallback = load_config(host.config).allow_native_fallback
        said = (
            "a Docker create falls back to it while Docker is unavailable"
            if fallback
            else "no fallback to it (allow_native_fallback = false)"
        )
    except SliceboxError:
        said = "the fallback is the agent's config's to say (not readable here)"
    return verdict(
        "native backend",
        answer.available,
        f"{answer.detail}; {said}",
        "the native backend needs systemd as PID 1 and the host's /bin/sh and sleep",
    )


def check_wasm(host: Host) -> Check:
    """The wasm backend: optional (slicebox[wasm]); where the native backend runs and the
    Extism SDK imports, it runs plugins. Without the SDK nothing is wrong: it says so."""
    from slicebox.backends import wasm

    answer = wasm.availability(host.native())
    if answer.available:
        return passed("wasm backend", answer.detail)
    if "slicebox[wasm]" in answer.detail:
        detail = "not installed (optional: pip install extism for the agent's Python)"
        return passed("wasm backend", detail)
    return verdict("wasm backend", False, answer.detail, "it runs where the native backend does")


def check_daytona(host: Host) -> Check:
    """The daytona backend: optional; when the config names a Daytona API, does it answer."""
    from slicebox.model.config import load_config

    try:
        remote = load_config(host.config).daytona
    except SliceboxError:
        remote = None
    if remote is None:
        detail = "not configured (optional: [daytona] api_url and api_key_file enable it)"
        return passed("daytona backend", detail)
    if not os.access(str(remote.api_key_file), os.R_OK):
        return Check(
            name="daytona backend",
            state=State.SKIP,
            detail=f"not checked: {remote.api_key_file} is not yours to read (the agent's key)",
            fix="run `sudo slicebox doctor` to check the Daytona API",
        )
    try:
        key = remote.api_key()
    except ValueError as exc:
        return verdict("daytona backend", False, str(exc), "fix the key file (root's, mode 0600)")
    from slicebox.server.backends import daytona_availability

    answer = daytona_availability(remote, key)
    return verdict(
        "daytona backend", answer.available, answer.detail, "check [daytona] and the network"
    )


BIND_ROOTS_FIX = (
    "make each bind root and every directory above it owned by root and writable by nobody "
    "else (chown root: DIR; chmod go-w DIR), with no symlink on the way; below a root with "
    "{user}, each user's own directory must be theirs and nothing on the way a symlink"
)


def check_bind_roots(host: Host) -> Check:
    """Whether nobody but root can redirect a bind root: the agent walks each root from ``/``
    following nothing, and refuses a root with a symlink on its path, a directory above the
    user's own one that is not root's or is writable by others, or a user's own directory that
    is not theirs (host.beneath.open_root); this checks the same, for every user's directory
    already there."""
    from slicebox.model.config import load_config  # only here: every other command skips it

    try:
        roots = load_config(host.config).bind_roots
    except SliceboxError as exc:
        return Check(
            name="bind roots",
            state=State.SKIP,
            detail=f"not checked: {exc.message}",
            fix="run `sudo slicebox doctor` to read the agent's config",
        )
    if not roots:
        return passed("bind roots", "none configured: bind mounts are refused")
    problems = [problem for root in roots if (problem := unsafe_root(str(root), host))]
    shown = ", ".join(str(root) for root in roots)
    return verdict("bind roots", not problems, "; ".join(problems) or shown, BIND_ROOTS_FIX)


def unsafe_root(root: str, host: Host) -> str | None:
    """What makes ``root`` unsafe (host.beneath.open_root, as the agent walks it): a symlink on
    its path, a directory above ``{user}`` owned by someone else or writable by its group or
    others (unless sticky), a missing one, or a user's own directory there that is not theirs
    or has a symlink below it on the way to the root."""
    from slicebox.host.beneath import BindRoot, root_problem

    template = PurePosixPath(root)
    at = next((i for i, part in enumerate(template.parts) if "{user}" in part), None)
    fixed = PurePosixPath(*template.parts[:at]) if at is not None else template
    static = BindRoot(path=fixed, top=str(host.top), trusted=host.owner)
    if found := root_problem(static):
        return f"{root}: {found[0]}"
    if at is None:
        return None
    problems = [
        f"{root}: {why}"
        for name, uid in _users_at(Path(fixed), template.parts[at])
        if (found := root_problem(_users_root(template, at, name, uid, host)))
        for why, missing in [found]
        if not missing
    ]
    return "; ".join(problems) or None


def _users_root(template: PurePosixPath, at: int, name: str, uid: int, host: Host) -> BindRoot:
    from slicebox.host.beneath import BindRoot

    path = PurePosixPath(*(part.replace("{user}", name) for part in template.parts))
    return BindRoot(path=path, user_part=at, uid=uid, top=str(host.top), trusted=host.owner)


def _users_at(directory: Path, pattern: str) -> Iterator[tuple[str, int]]:
    """The users whose own directory ``pattern`` (``{user}`` in it) names in ``directory``: its
    entries that match, for every name the user database knows."""
    head, _, tail = pattern.partition("{user}")
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for entry in names:
        if not (entry.startswith(head) and entry.endswith(tail)) or len(entry) <= len(head + tail):
            continue
        name = entry[len(head) : len(entry) - len(tail)]
        try:
            yield name, pwd.getpwnam(name).pw_uid
        except KeyError:
            continue


CHECKS: tuple[Callable[[Host], Check], ...] = (
    check_systemd,
    check_cgroup2,
    check_controllers,
    check_docker,
    check_native,
    check_wasm,
    check_daytona,
    check_agent,
    check_bind_roots,
)


def run_checks(host: Host | None = None) -> list[Check]:
    return [check(host or Host()) for check in CHECKS]


_LABELS = {State.OK: "ok", State.FAIL: "FAIL", State.SKIP: "skip"}  # a failure stands out


def failed(checks: Iterable[Check]) -> bool:
    return any(check.state is State.FAIL for check in checks)


def lines(checks: Iterable[Check]) -> Iterator[str]:
    """The human report: a failure says what to fix, a skip how to make the check."""
    for check in checks:
        yield f"{_LABELS[check.state]:<4} {check.name:<20} {check.detail}"
        if check.state is not State.OK and check.fix:
            label = "fix:" if check.state is State.FAIL else "to check:"
            yield f"     {'':<20} {label} {check.fix}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
