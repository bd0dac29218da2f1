from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from slicebox.core.slices import SliceManager
from slicebox.host import systemd as systemd_adapter
from slicebox.host.systemd import UnitStatus
from slicebox.model.config import parse_config
from slicebox.model.errors import HostError
from slicebox.model.limits import INFINITY, Ceiling
from tests.fakes.systemd import FakeSystemd
from tests.fakes.systemd_contract import check_refusals

MiB = 1024 * 1024
UNIT = "slicebox-al-new.slice"


def test_ensure_starts_a_transient_slice_then_updates_it() -> None:
    systemd = FakeSystemd()
    slices = SliceManager(systemd)
    assert slices.ensure("slicebox-a.slice", Ceiling(memory_bytes=5, pids=7))
    assert systemd.properties["slicebox-a.slice"]["TasksMax"] == 7
    assert not slices.ensure("slicebox-a.slice", Ceiling(memory_bytes=9))
    assert systemd.properties["slicebox-a.slice"]["MemoryMax"] == 9
    assert systemd.properties["slicebox-a.slice"]["TasksMax"] == INFINITY
    assert [c for c, _ in systemd.calls] == ["start_transient", "set_properties"]


def test_ceilings_are_set_once_per_activation_of_a_slice() -> None:
    """A create in a running slice sets nothing that slice already has; a slice started again
    meanwhile (by anyone: systemd then knows none of the ceilings of a transient slice) and a
    changed ceiling are set again."""
    systemd = FakeSystemd()
    slices = SliceManager(systemd)
    slices.ensure(UNIT, Ceiling(pids=7))  # created with its ceilings
    slices.ensure(UNIT, Ceiling(pids=7))  # not known to be set on this activation yet
    systemd.calls.clear()
    for _ in range(3):
        assert not slices.ensure(UNIT, Ceiling(pids=7))
    assert systemd.calls == []
    assert not slices.ensure(UNIT, Ceiling(pids=8))
    assert systemd.properties[UNIT]["TasksMax"] == 8
    systemd.stop(UNIT)
    systemd.start(UNIT)  # as a container's scope starts its slice: without ceilings
    systemd.calls.clear()
    assert not slices.ensure(UNIT, Ceiling(pids=8))
    assert systemd.calls == [("set_properties", UNIT)]
    assert systemd.properties[UNIT]["TasksMax"] == 8
    assert slices.update(UNIT, Ceiling(pids=9))
    assert not slices.ensure(UNIT, Ceiling(pids=9))
    assert systemd.properties[UNIT]["TasksMax"] == 9


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


def test_the_fake_refuses_what_systemd_refuses() -> None:
    check_refusals(FakeSystemd(), "slicebox-contract.slice", "slicebox-contract.service")


def test_list_units_without_active_only_also_lists_loaded_inactive_units() -> None:
    systemd = FakeSystemd()
    systemd.installed.add("slicebox.slice")
    SliceManager(systemd).ensure("slicebox-a.slice", Ceiling())
    assert systemd.list_units("slicebox*.slice", active_only=True) == ["slicebox-a.slice"]
    assert systemd.list_units("slicebox*.slice") == ["slicebox-a.slice", "slicebox.slice"]


class RacingSystemd(FakeSystemd):
    """Both callers look before either starts: the interleaving that made creates fail."""

    def __init__(self, callers: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(callers, timeout=5)

    def status(self, unit: str) -> UnitStatus:
        seen = super().status(unit)
        self.barrier.wait()
        return seen


def test_two_concurrent_ensures_of_a_new_slice_both_succeed() -> None:
    systemd = RacingSystemd(callers=2)
    slices = SliceManager(systemd)
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: slices.ensure(UNIT, Ceiling(pids=7)), range(2)))
    assert sorted(started) == [False, True]  # one created it, the other configured it
    assert systemd.list_units(UNIT, active_only=True) == [UNIT]
    assert systemd.properties[UNIT]["TasksMax"] == 7
    assert [c for c, _ in systemd.calls].count("start_transient") == 2


def test_a_slice_left_with_drop_ins_is_configured_and_started() -> None:
    systemd = FakeSystemd()
    systemd.set_properties(UNIT, [("TasksMax", 1)])  # inactive, but systemd holds drop-ins
    assert not SliceManager(systemd).ensure(UNIT, Ceiling(pids=9))
    assert systemd.list_units(UNIT, active_only=True) == [UNIT]
    assert systemd.properties[UNIT]["TasksMax"] == 9


def test_other_start_failures_still_fail() -> None:
    systemd = FakeSystemd()
    systemd.fail_start.add(UNIT)
    with pytest.raises(HostError, match="could not start"):
        SliceManager(systemd).ensure(UNIT, Ceiling())


def refusing(error: str) -> Callable[[bytes, list[Any]], Any]:
    """systemd's manager as far as a call that it refuses goes."""

    def method(name: bytes, args: list[Any]) -> Any:
        from pystemd.dbusexc import DBusBaseError

        raise DBusBaseError(error.encode(), b"refused")

    return method


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("org.freedesktop.systemd1.NoSuchProcess", "no_such_unit"),  # loaded, nothing runs
        ("org.freedesktop.DBus.Error.AccessDenied", "host_error"),
    ],
)
def test_a_kill_of_a_scope_with_nothing_left_is_no_such_unit(
    monkeypatch: pytest.MonkeyPatch, error: str, code: str
) -> None:
    pytest.importorskip("pystemd")
    monkeypatch.setattr(systemd_adapter, "_method", refusing(error))
    monkeypatch.setattr(systemd_adapter, "_drop_bus", lambda: None)
    with pytest.raises(HostError) as caught:
        systemd_adapter.PystemdSystemd().kill("docker-c1.scope", 9)
    assert caught.value.code == code
