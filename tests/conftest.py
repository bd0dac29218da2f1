"""Test-suite policy.

Tests marked ``host`` need a real host: systemd as PID 1, cgroup v2 with controllers, Docker.
They run inside the project's guest (``tests/guest/run``). Where such a test is collected on a
machine that is not a real host it fails; it is never silently skipped. The build machine's run
deselects them explicitly with ``-m "not host"``.

Tests also marked ``load`` (five users' load, twenty kill -9s under it) are real-host soaks
that take 20-35 min each under emulation: CI's run selects them out by name (``-m "host and
not load"`` in ``tests/run-all``), never by a skip, and ``tests/guest/run python3 -m pytest -m
load`` runs them.
"""

from __future__ import annotations

import pytest

from tests.realhost import real_host_problem


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "load: the kill storms under load (real host; run on demand with -m load)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    problem = real_host_problem()
    if problem is None:
        return
    for item in items:
        if item.get_closest_marker("host") is not None:
            item.add_marker(pytest.mark.usefixtures("_require_real_host"))


@pytest.fixture
def _require_real_host() -> None:
    problem = real_host_problem()
    if problem is not None:
        pytest.fail(f"this test needs a real host ({problem}); run it with tests/guest/run")
