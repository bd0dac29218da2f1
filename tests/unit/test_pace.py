"""The guest tests' pace (``tests/host/pace.py``): waiting limits scale with a slow host, never
below what they were set to, and the override is a number or a clear error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.host import pace


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    pace.pace.cache_clear()
    yield
    pace.pace.cache_clear()


def test_a_slow_host_waits_longer_in_proportion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLICEBOX_TEST_PACE", raising=False)
    monkeypatch.setattr(pace, "measure", lambda: pace.REFERENCE_SECONDS * 1.6)
    assert pace.pace() == pytest.approx(1.6)
    assert pace.patient(60) == pytest.approx(96)


def test_a_fast_host_keeps_the_limits_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLICEBOX_TEST_PACE", raising=False)
    monkeypatch.setattr(pace, "measure", lambda: pace.REFERENCE_SECONDS / 10)
    assert pace.patient(60) == 60


def test_the_environment_says_the_pace_for_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLICEBOX_TEST_PACE", "2.5")
    monkeypatch.setattr(pace, "measure", lambda: pytest.fail("measured although given"))
    assert pace.patient(10) == 25
    pace.pace.cache_clear()
    monkeypatch.setenv("SLICEBOX_TEST_PACE", "0.2")
    assert pace.pace() == 1.0


def test_an_override_that_is_no_number_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLICEBOX_TEST_PACE", "slow")
    with pytest.raises(ValueError, match="SLICEBOX_TEST_PACE must be a number, not 'slow'"):
        pace.pace()


def test_the_workload_is_measured_in_seconds() -> None:
    assert 0 < pace.measure() < 60
