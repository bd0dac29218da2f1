"""The agent's process imports pystemd's and pyroute2's modules without their packages' init."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slicebox.host.lean import skip_package_inits

AGENT = Path(__file__).resolve().parents[2] / "agent"

# Every module of the two libraries the agent imports (host/systemd.py, journal.py, netstats.py).
USED = """
import sys
from slicebox.host.lean import skip_package_inits
print(skip_package_inits())
import slicebox.server.daemon, slicebox.cli.asyncclient
from pystemd.dbuslib import DBus, apply_signature, path_encode
from pystemd.dbusexc import DBusBaseError, DBusNoSuchUnitError
from pystemd.systemd1.unit_signatures import KNOWN_UNIT_SIGNATURES, signature_array
from pystemd import journal
from pyroute2.iproute.linux import IPRoute
from pyroute2.netns import setns
print(list(signature_array({b"MemoryMax": 1})))
print(sorted({"aiohttp", "docker", "requests", "urllib3", "lxml", "pystemd.base", "pyroute2.ndb"}
             & set(sys.modules)))
"""


def test_the_agent_loads_the_modules_it_uses_and_not_the_rest_of_their_packages() -> None:
    pytest.importorskip("pystemd.dbuslib")
    pytest.importorskip("pyroute2")
    ran = subprocess.run(
        [sys.executable, "-c", USED],
        env={"PYTHONPATH": str(AGENT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    registered, typed, loaded = ran.stdout.splitlines()
    assert registered == "['pystemd', 'pystemd.systemd1', 'pyroute2']"
    assert "MemoryMax" in typed
    assert loaded == "[]"  # no HTTP framework or docker-py, no lxml, no pyroute2 databases


def test_a_package_already_imported_is_left_as_it_is() -> None:
    assert "pytest" in sys.modules
    assert skip_package_inits(["pytest", "no_such_package", "no_such_package.child"]) == []
