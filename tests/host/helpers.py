"""Small helpers for tests that run on a real host (the guest)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.host.pace import pace, patient

CGROUP_ROOT = Path("/sys/fs/cgroup")
TEST_IMAGE = "slicebox-test/busybox:latest"


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


def module_as(user: str, module: str, *argv: str) -> subprocess.Popen[str]:
    """``python3 -m module`` of the checkout, run in the background as ``user``: the agent
    knows it by SO_PEERCRED."""
    return subprocess.Popen(
        ["runuser", "-u", user, "--", "python3", "-m", module, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/src",
    )


def slicebox_as(user: str, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[bytes]:
    """The ``slicebox`` command as ``user``, its output captured as bytes."""
    return subprocess.run(
        ["runuser", "-u", user, "--", "slicebox", *argv],
        capture_output=True,
        check=False,
        timeout=timeout,
    )


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, step: float = 0.2) -> None:
    """Wait until ``predicate()``: ``timeout`` is only how long a test waits (never the property
    it proves), so it is scaled by the host's pace (:mod:`tests.host.pace`)."""
    limit = patient(timeout)
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"condition not met within {limit:.0f}s ({timeout}s at pace {pace():.2f})"
            )
        time.sleep(step)


def memory_events(cgroup: Path, name: str = "memory.events") -> dict[str, int]:
    """``memory.events`` (or ``memory.events.local``: the cgroup's own, not its children's)."""
    lines = (cgroup / name).read_text().splitlines()
    return {key: int(value) for key, value in (line.split() for line in lines)}


# Runtime drop-ins (set-property --runtime, SetUnitProperties) can outlive a stopped slice that
# has no unit file. Stopping a unit in a test therefore also removes them.
RUNTIME_DROP_INS = (Path("/run/systemd/system.control"), Path("/run/systemd/transient"))


def stop_unit(name: str) -> None:
    sh("systemctl", "stop", name, check=False)
    sh("systemctl", "reset-failed", name, check=False)
    for directory in RUNTIME_DROP_INS:
        shutil.rmtree(directory / f"{name}.d", ignore_errors=True)
    # A stopped transient slice can stay cached as not-found; Docker then cannot start a
    # container below it ("Unit slicebox.slice not found") until systemd reloads.
    if sh("systemctl", "show", "-P", "LoadState", name, check=False).stdout.strip() == "not-found":
        sh("systemctl", "daemon-reload")


@contextmanager
def ordinary_user(name: str) -> Iterator[None]:
    """A user in group slicebox, no more, for the block (one a killed run left is replaced)."""
    sh("userdel", name, check=False)
    sh("useradd", "--no-create-home", "--shell", "/bin/sh", "-G", "slicebox", name)
    try:
        yield
    finally:
        sh("userdel", name, check=False)


def journal_records(**match: str) -> list[dict[str, Any]]:
    """The journal's entries with these fields (``SLICEBOX_EVENT="exec"``...), as JSON."""
    matches = [f"{field}={value}" for field, value in match.items()]
    out = sh("journalctl", "--no-pager", "-o", "json", *matches, check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]
