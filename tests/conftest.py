"""Test-suite policy.

Tests marked ``host`` need a real host: systemd as PID 1, cgroup v2 with controllers, Docker.
They run inside the project's guest (``tests/guest/run``). Where such a test is collected on a
machine that is not a real host it fails; it is never silently skipped. The build machine's run
deselects them explicitly with ``-m "not host"``.

Tests also marked ``load`` (five users' load, twenty kill -9s under it) are real-host soaks
that take 20-35 min each under emulation: CI's run selects them out by name (``-m "host and
not load"`` in ``tests/run-all``), never by a skip, and ``tests/guest/run python3 -m pytest -m
load`` runs them.

The guest has the agent's Debian packages, not the optional SDKs a few unit modules exercise
(the Daytona SDK: ``test_daytona``, ``test_remote``). A run that selects host tests (``-m
"host..."``, the guest's) does not collect those modules, none of whose tests it would select
anyway; every other run collects them, so a build machine without the SDK fails loudly.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.realhost import real_host_problem

NEEDS_DAYTONA = frozenset({"test_daytona.py", "test_remote.py"})


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    host_run = str(config.option.markexpr or "").startswith("host")
    if host_run and collection_path.name in NEEDS_DAYTONA:
        return importlib.util.find_spec("daytona_api_client") is None or None
    return None


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
