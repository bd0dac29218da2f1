"""Install the checkout's units into the guest's systemd for a test, and remove them after."""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

from slicebox.client import Client
from slicebox.model.errors import SliceboxError
from tests.host.helpers import sh

UNITS = Path(__file__).resolve().parents[2] / "units"
RUNTIME = Path("/run/systemd/system")
SOCKET = Path("/run/slicebox/slicebox.sock")
CONFIG = Path("/etc/slicebox/config.toml")


AGENT_UNITS = ("slicebox.service", "slicebox.socket", "run-slicebox-sandboxes.mount")
WORKSPACE_ROOTS = "/srv/sbx-ws"  # each test user's host workspaces go below <this>/<user>


def agent_config(reaper: str = "") -> str:
    """The test agents' config: the guest's image, and ``reaper`` settings after a grace of 0
    for empty slices, so a reaper pass after a test's destroys takes the slices they left
    (with the default they would stay 300 s) and proves that none leaks."""
    return (
        'default_image = "slicebox-test/busybox:latest"\n'
        f'bind_roots = ["{WORKSPACE_ROOTS}/{{user}}"]\n'
        f"[reaper]\nempty_slice_grace_seconds = 0\n{reaper}"
    )


TEST_CONFIG = agent_config()


def drop_in(
    watchdog_sec: int,
    start_limit: bool = True,
    environment: Mapping[str, str] | None = None,
    service: str = "",
) -> str:
    # The guest runs the checkout's console script; a short watchdog keeps tests quick.
    unit, restart = (
        ("", "") if start_limit else ("[Unit]\nStartLimitIntervalSec=0\n", "RestartSec=0\n")
    )
    env = "".join(f'Environment="{name}={value}"\n' for name, value in (environment or {}).items())
    return unit + (
        f"[Service]\n{restart}{env}{service}ExecStart=\n"
        f"ExecStart=/usr/local/bin/sliceboxd --config {CONFIG}\nWatchdogSec={watchdog_sec}\n"
    )


def prop(unit: str, name: str) -> str:
    return sh("systemctl", "show", "-P", name, unit).stdout.strip()


@contextmanager
def installed_agent(
    config: str = TEST_CONFIG,
    watchdog_sec: int = 20,
    *,
    start_limit: bool = True,
    environment: Mapping[str, str] | None = None,
    service: str = "",
) -> Iterator[None]:
    """The checkout's agent as a system service; ``environment`` and ``service`` (lines of
    [Service]) go into its test drop-in."""
    created_group = sh("getent", "group", "slicebox", check=False).returncode != 0
    if created_group:
        sh("groupadd", "--system", "slicebox")
    CONFIG.parent.mkdir(exist_ok=True)
    CONFIG.write_text(config)
    # The config's bind root, as an operator makes it (root's, 0755): `slicebox doctor` fails
    # on a root that is not there, and no test may depend on another having made it first.
    roots = Path(WORKSPACE_ROOTS)
    made_roots = not roots.exists()
    roots.mkdir(mode=0o755, exist_ok=True)
    for unit in AGENT_UNITS:
        shutil.copy(UNITS / unit, RUNTIME / unit)
    directory = RUNTIME / "slicebox.service.d"
    directory.mkdir(exist_ok=True)
    (directory / "test.conf").write_text(drop_in(watchdog_sec, start_limit, environment, service))
    sh("systemctl", "daemon-reload")
    try:
        yield
    finally:
        # The test removed its sandboxes; a pass takes the slices they left (grace 0 above).
        # A stopped agent is not started for it: the tests that stop theirs make no sandbox.
        if prop("slicebox.service", "ActiveState") == "active":
            reap()
        sh("systemctl", "stop", *AGENT_UNITS, check=False)
        sh("systemctl", "reset-failed", *AGENT_UNITS, check=False)
        shutil.rmtree(directory)
        for unit in AGENT_UNITS:
            (RUNTIME / unit).unlink()
        sh("systemctl", "daemon-reload")
        shutil.rmtree(CONFIG.parent)
        if made_roots:
            shutil.rmtree(roots, ignore_errors=True)
        if created_group:
            sh("groupdel", "slicebox")


def curl_health() -> dict[str, object]:
    out = sh(
        "curl", "-sf", "-m", "180", "--unix-socket", str(SOCKET), "http://localhost/v1/health"
    ).stdout
    return dict(json.loads(out))


def admin() -> Client:
    """The agent's client as root (an admin by SO_PEERCRED), in this process: a fixture's
    clean-up needs no CLI process (each costs seconds of Python start under emulation)."""
    return Client(str(SOCKET), timeout=600)


def reap() -> None:
    """One reaper pass, as ``slicebox reap`` asks it; an agent that cannot answer is left be."""
    with suppress(SliceboxError, OSError):
        admin().reap()


def remove_sandboxes(users: Collection[str] | None = None) -> None:
    """Destroy every sandbox the agent lists (of ``users`` only, when given): a fixture's
    clean-up, as ``slicebox ps`` and ``slicebox rm`` would; nothing when the agent is down."""
    try:
        listed = admin().list_sandboxes()
    except (SliceboxError, OSError):
        return
    for sandbox in listed:
        if users is None or sandbox.user in users:
            with suppress(SliceboxError):  # gone meanwhile
                admin().destroy(sandbox.id)
