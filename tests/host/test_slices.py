"""The slice manager on real systemd: ceilings reach the kernel and stay there.

Pins the design choice of :mod:`slicebox.core.slices`: transient slices plus runtime drop-ins keep
their ceilings through ``systemctl daemon-reload``; a re-applied config changes them live.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slicebox.core.slices import SliceManager
from slicebox.host.systemd import PystemdSystemd, UnitStatus
from slicebox.model.config import parse_config
from slicebox.model.limits import Ceiling
from slicebox.model.names import MANAGED_SLICE, slice_names
from tests.fakes.systemd_contract import check_refusals
from tests.host.helpers import sh, unique, wait_for
from tests.host.sliceboxhost import active, cleanup_slices, read

pytestmark = pytest.mark.host
MiB = 1024 * 1024


@pytest.fixture
def manager() -> SliceManager:
    return SliceManager(PystemdSystemd())


@pytest.fixture
def tree() -> Iterator[tuple[str, str]]:
    user, project = unique("u-"), "proj-a.b_c"
    managed_was_active = active(MANAGED_SLICE)
    yield user, project
    names = slice_names(user, project)
    cleanup_slices(names.project, names.user)
    if not managed_was_active:
        cleanup_slices(MANAGED_SLICE)


def ensure_tree(manager: SliceManager, user: str, project: str, project_mem: int) -> None:
    names = slice_names(user, project)
    manager.ensure(names.managed, Ceiling(memory_bytes=2048 * MiB))
    manager.ensure(names.user, Ceiling(memory_bytes=900 * MiB, cpus=1.5, pids=300))
    manager.ensure(
        names.project,
        Ceiling(memory_bytes=project_mem, memory_high_bytes=project_mem - 10 * MiB, pids=70),
    )


def test_ensure_writes_ceilings_where_names_say(
    manager: SliceManager, tree: tuple[str, str]
) -> None:
    user, project = tree
    ensure_tree(manager, user, project, 400 * MiB)
    cgroups = slice_names(user, project).cgroups()
    shown = sh("systemctl", "show", "-P", "ControlGroup", slice_names(user, project).project)
    assert "/sys/fs/cgroup" + shown.stdout.strip() == str(cgroups.project)
    assert read(cgroups.project, "memory.max").strip() == str(400 * MiB)
    assert read(cgroups.project, "memory.high").strip() == str(390 * MiB)
    assert read(cgroups.project, "pids.max").strip() == "70"
    assert read(cgroups.user, "cpu.max").split()[0] == "150000"
    assert read(cgroups.user, "memory.max").strip() == str(900 * MiB)


def test_ceilings_survive_daemon_reload_and_updates_too(
    manager: SliceManager, tree: tuple[str, str]
) -> None:
    user, project = tree
    ensure_tree(manager, user, project, 400 * MiB)
    names = slice_names(user, project)
    sh("systemctl", "daemon-reload")
    cgroups = names.cgroups()
    assert read(cgroups.project, "memory.max").strip() == str(400 * MiB)
    assert read(cgroups.project, "pids.max").strip() == "70"
    assert manager.update(names.project, Ceiling(memory_bytes=300 * MiB, pids=50))
    sh("systemctl", "daemon-reload")
    assert read(cgroups.project, "memory.max").strip() == str(300 * MiB)
    assert read(cgroups.project, "pids.max").strip() == "50"
    assert read(cgroups.user, "memory.max").strip() == str(900 * MiB)


def test_agent_restart_reapplies_changed_config_live(tree: tuple[str, str]) -> None:
    user, project = tree
    ensure_tree(SliceManager(PystemdSystemd()), user, project, 400 * MiB)
    config = parse_config(
        f'[users."{user}"]\nmemory = "700MB"\npids = 222\n'
        f'[projects."{user}/{project}"]\nmemory = "123MB"\ncpus = 0.25\n'
    )
    restarted = SliceManager(PystemdSystemd())  # a new agent run, nothing in memory
    updated = restarted.reapply(config, host_memory=4096 * MiB)
    names = slice_names(user, project)
    assert {names.user, names.project} <= set(updated)
    sh("systemctl", "daemon-reload")
    cgroups = names.cgroups()
    assert read(cgroups.project, "memory.max").strip() == str(123 * MiB)
    assert read(cgroups.project, "cpu.max").split()[0] == "25000"
    assert read(cgroups.project, "pids.max").strip() == "1024"  # the [project] default
    assert read(cgroups.user, "memory.max").strip() == str(700 * MiB)
    assert read(cgroups.user, "pids.max").strip() == "222"


def test_remove_if_empty_keeps_a_slice_with_children(
    manager: SliceManager, tree: tuple[str, str]
) -> None:
    user, project = tree
    ensure_tree(manager, user, project, 400 * MiB)
    names = slice_names(user, project)
    assert not manager.remove_if_empty(names.user)
    assert active(names.user)
    assert active(names.project)
    assert manager.remove_if_empty(names.project)
    assert not active(names.project)
    assert manager.remove_if_empty(names.user)
    assert not active(names.user)
    assert not Path(str(names.cgroups().user)).exists()


def transient_managed_slice_gone() -> None:
    """The managed slice as an earlier module may have left it: a transient unit, active or
    only still loaded (stopped, but held by a failed unit below it, whose transient file would
    win over an installed one). Stopped, those failed units reset (and named, for the log),
    until systemd has dropped it."""
    if sh("systemctl", "show", "-P", "Transient", MANAGED_SLICE).stdout.strip() != "yes":
        return
    cleanup_slices(MANAGED_SLICE)
    failed = sh("systemctl", "list-units", "--all", "--state=failed", "--plain", "--no-legend")
    below = [line.split()[0] for line in failed.stdout.splitlines() if "sbx" in line]
    if below:
        print(f"failed units an earlier module left: {below}")
        sh("systemctl", "reset-failed", *below, check=False)
    wait_for(
        lambda: sh("systemctl", "show", "-P", "Transient", MANAGED_SLICE).stdout.strip() != "yes",
        timeout=60,
    )


def test_installed_managed_slice_takes_runtime_ceilings(manager: SliceManager) -> None:
    transient_managed_slice_gone()
    unit_file = Path("/run/systemd/system") / MANAGED_SLICE
    unit_file.write_text((Path(__file__).parents[2] / "slices" / MANAGED_SLICE).read_text())
    try:
        sh("systemctl", "daemon-reload")
        assert manager.ensure(MANAGED_SLICE, Ceiling(memory_bytes=1500 * MiB, pids=4000))
        shown = sh("systemctl", "show", "-P", "Transient", MANAGED_SLICE).stdout.strip()
        assert shown == "no", "an installed slice is configured, not replaced by a transient one"
        sh("systemctl", "daemon-reload")
        managed = slice_names("x", "y").cgroups().managed
        assert read(managed, "memory.max").strip() == str(1500 * MiB)
        assert read(managed, "pids.max").strip() == "4000"
    finally:
        cleanup_slices(MANAGED_SLICE)
        unit_file.unlink()
        sh("systemctl", "daemon-reload")


def test_real_systemd_refuses_what_the_fake_refuses(tree: tuple[str, str]) -> None:
    user, _ = tree
    names = slice_names(user, "contract")
    try:
        check_refusals(PystemdSystemd(), names.project, f"{unique('sbx-none-')}.service")
    finally:
        cleanup_slices(names.project, names.user)


class RacingSystemd(PystemdSystemd):
    """Each caller's first look waits for the other's: both see the slice absent."""

    def __init__(self, callers: int) -> None:
        super().__init__()
        self._barrier = threading.Barrier(callers, timeout=60)
        self._looked: set[int] = set()

    def status(self, unit: str) -> UnitStatus:
        seen = super().status(unit)
        if threading.get_ident() not in self._looked:
            self._looked.add(threading.get_ident())
            self._barrier.wait()
        return seen


def test_two_creates_in_a_new_project_at_once_both_succeed(tree: tuple[str, str]) -> None:
    user, project = tree
    unit = slice_names(user, project).project
    manager = SliceManager(RacingSystemd(callers=2))
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: manager.ensure(unit, Ceiling(pids=77)), range(2)))
    assert sorted(started) == [False, True]
    assert active(unit)
    assert read(slice_names(user, project).cgroups().project, "pids.max").strip() == "77"
