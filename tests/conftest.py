"""Test-suite policy.

Tests marked ``host`` need a real host: systemd as PID 1, cgroup v2 with controllers, Docker.
They run inside the project's guest (``tests/guest/run``). Where such a test is collected on a
machine that is not a real host it fails; it is never silently skipped. The build machine's run
deselects them explicitly with ``-m "not host"``.

Tests also marked ``load`` (the many-users load test) are real-host tests that CI's run does not
select yet (``-m "host and not load"`` in ``tests/run-all``): under the emulated 2-core guest the
load test takes 17 to 19 min and its latency and failure checks are not yet reliable there. Run
them with ``tests/guest/run python3 -m pytest -m load``.
"""

from __future__ import annotations

import pytest

from tests.realhost import real_host_problem


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "load: the many-users load test; a real-host test run on demand, not by CI yet"
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
