from __future__ import annotations

from slicebox.core.slices import SliceManager
from slicebox.model.config import parse_config
from slicebox.model.limits import INFINITY, Ceiling
from tests.fakes.systemd import FakeSystemd

MiB = 1024 * 1024


def test_ensure_starts_a_transient_slice_then_updates_it() -> None:
    systemd = FakeSystemd()
    slices = SliceManager(systemd)
    assert slices.ensure("slicebox-a.slice", Ceiling(memory_bytes=5, pids=7))
    assert systemd.properties["slicebox-a.slice"]["TasksMax"] == 7
    assert not slices.ensure("slicebox-a.slice", Ceiling(memory_bytes=9))
    assert systemd.properties["slicebox-a.slice"]["MemoryMax"] == 9
    assert systemd.properties["slicebox-a.slice"]["TasksMax"] == INFINITY
    assert [c for c, _ in systemd.calls] == ["start_transient", "set_properties"]


def test_an_installed_slice_is_configured_and_started_not_replaced() -> None:
    systemd = FakeSystemd()
    systemd.installed.add("slicebox.slice")
    assert SliceManager(systemd).ensure("slicebox.slice", Ceiling(pids=3))
    assert [c for c, _ in systemd.calls] == ["set_properties", "start"]
    assert "slicebox.slice" in systemd.running


def test_remove_if_empty_never_stops_a_slice_with_children() -> None:
    systemd = FakeSystemd()
    slices = SliceManager(systemd)
    slices.ensure("slicebox-a.slice", Ceiling())
    systemd.children["slicebox-a.slice"] = {"slicebox-a-b.slice"}
    assert not slices.remove_if_empty("slicebox-a.slice")
    assert "slicebox-a.slice" in systemd.running
    systemd.children["slicebox-a.slice"].clear()
    assert slices.remove_if_empty("slicebox-a.slice")
    assert "slicebox-a.slice" not in systemd.running
    assert not slices.remove_if_empty("slicebox-a.slice")


def test_update_leaves_absent_slices_absent() -> None:
    systemd = FakeSystemd()
    assert not SliceManager(systemd).update("slicebox-a.slice", Ceiling(pids=1))
    assert systemd.running == set()


def test_reapply_writes_the_new_config_to_every_running_slice() -> None:
    systemd = FakeSystemd()
    slices = SliceManager(systemd)
    for unit in ("slicebox.slice", "slicebox-al\\x2dice.slice", "slicebox-al\\x2dice-p.slice"):
        slices.ensure(unit, Ceiling())
    slices.ensure("slicebox-not-a-name-at-all.slice", Ceiling())
    config = parse_config(
        '[managed]\nmemory = "50%"\n[users.al-ice]\npids = 9\n[projects."al-ice/p"]\ncpus = 0.25\n'
    )
    updated = slices.reapply(config, host_memory=1000 * MiB)
    assert updated == ["slicebox.slice", "slicebox-al\\x2dice-p.slice", "slicebox-al\\x2dice.slice"]
    assert systemd.properties["slicebox.slice"]["MemoryMax"] == 500 * MiB
    assert systemd.properties["slicebox-al\\x2dice.slice"]["TasksMax"] == 9
    assert systemd.properties["slicebox-al\\x2dice-p.slice"]["CPUQuotaPerSecUSec"] == 250_000


def test_wait_stopped_times_out_without_sleeping_for_real() -> None:
    systemd = FakeSystemd()
    systemd.running.add("docker-x.scope")
    now = [0.0]
    slices = SliceManager(
        systemd, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    assert not slices.wait_stopped("docker-x.scope", timeout=1.0)
    systemd.running.clear()
    assert slices.wait_stopped("docker-x.scope")
