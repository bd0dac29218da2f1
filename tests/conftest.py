"""Test-suite policy.

Tests marked ``host`` need a real host: systemd as PID 1, cgroup v2 with controllers, Docker.
They run inside the project's guest (``tests/guest/run``). Where such a test is collected on a
machine that is not a real host it fails; it is never silently skipped. The build machine's run
deselects them explicitly with ``-m "not host"``.

Tests also marked ``load`` are real-host loads and soaks at their full size (five users'
100 sandboxes and 400 execs, 500 echoes) and the kill storms (twenty kill -9s under load), each
several to 35 min under emulation. CI's run has the load and the soak at CI's scale, which
prove the same properties on a fifth of the work, and selects the ``load`` ones out by name
(``-m "host and not load"`` in ``tests/run-all``), never by a skip; ``tests/guest/run python3
-m pytest -m load`` runs them (docs/testing.md).

Host tests live in ``tests/host`` and nowhere else (a collected ``host`` test elsewhere fails
the run), so a run that selects host tests alone (``-m "host..."`` or ``-m load``, the guest's)
does not collect ``tests/unit``: none of its tests would be selected, and importing its modules
costs the guest's run some ten seconds under emulation, and would need the optional SDKs a few
of them exercise (the Daytona SDK: ``test_daytona``, ``test_remote``), which the guest lacks.
Every other run collects them, so a build machine without the SDK fails loudly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.realhost import real_host_problem

UNIT = Path(__file__).parent / "unit"
HOST = Path(__file__).parent / "host"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    host_only = str(config.option.markexpr or "").startswith(("host", "load"))
    if host_only and collection_path == UNIT:
        return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "load: full-size loads and soaks, kill storms (real host; on demand with -m load)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    strays = [
        item.nodeid
        for item in items
        if item.get_closest_marker("host") is not None and HOST not in item.path.parents
    ]
    if strays:
        raise pytest.UsageError(
            f"host tests belong in tests/host (a guest's run collects nothing else): {strays}"
        )
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
