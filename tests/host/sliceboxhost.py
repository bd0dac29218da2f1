"""Fixtures' building blocks for real-host tests of the slice tree (guest only)."""

from __future__ import annotations

import shutil
from pathlib import Path

from slicebox.core.sandboxes import SandboxManager
from slicebox.model.errors import SliceboxError
from slicebox.model.names import PODMAN_MONITOR, parse_slice
from slicebox.model.paths import CGROUP_ROOT as PURE_ROOT
from tests.host.helpers import CGROUP_ROOT, sh, stop_unit, wait_for

CONTROL_DIRS = (Path("/run/systemd/system.control"), Path("/run/systemd/transient"))


def read(cgroup: object, name: str) -> str:
    return (CGROUP_ROOT / str(cgroup).removeprefix(str(PURE_ROOT)).lstrip("/") / name).read_text()


def events(cgroup: object, name: str = "memory.events") -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in read(cgroup, name).splitlines())}


def slicebox_units(pattern: str = "slicebox*") -> list[str]:
    out = sh("systemctl", "list-units", "--all", "--plain", "--no-legend", pattern).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def active(unit: str) -> bool:
    return sh("systemctl", "is-active", unit, check=False).stdout.strip() == "active"


def cleanup_slices(*units: str) -> None:
    """Stop slices deepest first and drop any runtime drop-ins they left."""
    for unit in sorted(units, key=lambda u: -u.count("-")):
        stop_unit(unit)
        for directory in CONTROL_DIRS:
            shutil.rmtree(directory / f"{unit}.d", ignore_errors=True)


def reap_empty_slices(manager: SandboxManager, user: str) -> None:
    """What a reaper pass without a grace does to the user's slices once their sandboxes are
    gone (a destroy leaves them): stop each that holds nothing, projects first. A slice that
    still holds something stays, for the test's leftovers check to find. Under Podman, first
    until the container monitors whose container is gone have left: after an exec session one
    stays for Podman's exit_command_delay (10 s in the guest; the reaper's pass then takes the
    slice)."""
    wait_for(lambda: not _orphan_monitors(), timeout=180, step=1)
    units = [unit for unit in slicebox_units("slicebox-*.slice") if _owner(unit) == user]
    for unit in sorted(units, key=lambda u: -u.count("-")):
        manager.stop_slice_if_idle(unit)


def _orphan_monitors() -> list[Path]:
    """Podman's container monitors whose container's scope is gone (none under Docker)."""
    monitors = CGROUP_ROOT.glob(f"slicebox.slice/*/*/{PODMAN_MONITOR}*.scope")
    return [
        monitor
        for monitor in monitors
        if not (monitor.parent / monitor.name.replace(PODMAN_MONITOR, "libpod-", 1)).exists()
    ]


def _owner(unit: str) -> str | None:
    try:
        return parse_slice(unit)[0]
    except SliceboxError:  # the managed slice, or a name slicebox does not make
        return None
