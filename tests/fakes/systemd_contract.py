"""What systemd refuses, as every :class:`~slicebox.host.systemd.Systemd` must report it.

Run against the fake by the unit tests and against real systemd by ``tests/host/test_slices.py``,
so the fake cannot drift from what the real adapter raises.
"""

from __future__ import annotations

import signal

import pytest

from slicebox.host.systemd import Systemd
from slicebox.model.errors import HostError


def check_refusals(systemd: Systemd, slice_unit: str, service_unit: str) -> None:
    """``slice_unit`` and ``service_unit`` must be unused names; the slice is stopped again."""
    assert systemd.invocation(slice_unit) == ""
    assert not systemd.is_active(slice_unit)
    systemd.start_transient(slice_unit, [("TasksMax", 50)], "contract")
    try:
        assert systemd.is_active(slice_unit)
        first = systemd.invocation(slice_unit)
        assert len(first) == 32, "an activation has a 128-bit id"
        assert systemd.invocation(slice_unit) == first
        with pytest.raises(HostError, match="already exists") as caught:
            systemd.start_transient(slice_unit, [("TasksMax", 60)], "contract")
        assert caught.value.code == "unit_exists"
        assert systemd.list_units(slice_unit, active_only=True) == [slice_unit]
        assert systemd.invocation(slice_unit) == first
    finally:
        systemd.stop(slice_unit)
    assert systemd.list_units(slice_unit, active_only=True) == []
    assert systemd.invocation(slice_unit) == ""  # stopped: no activation, whatever came before
    assert not systemd.is_active(slice_unit)
    systemd.start(slice_unit)  # as a container's scope starts it (systemd makes slices on demand)
    try:
        assert systemd.invocation(slice_unit) not in ("", first)
    finally:
        systemd.stop(slice_unit)
    systemd.stop(slice_unit)  # an unknown slice: systemd loads slices on demand
    assert not systemd.is_active(service_unit)  # never loaded, and not loaded by the asking
    with pytest.raises(HostError) as caught:
        systemd.stop(service_unit)
    assert caught.value.code == "no_such_unit"
    with pytest.raises(HostError) as caught:
        systemd.kill(service_unit, signal.SIGKILL)  # a scope that stopped is unloaded too
    assert caught.value.code == "no_such_unit"
