"""The agent as a systemd service: socket activation, sd_notify, watchdog, reload, stop."""

from __future__ import annotations

import json
import shutil
import site
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from slicebox.model.audit import MESSAGE_IDS, AuditEvent
from tests.host.agentunits import SOCKET, curl_health, installed_agent, prop
from tests.host.helpers import sh, wait_for

pytestmark = pytest.mark.host


@pytest.fixture
def installed() -> Iterator[None]:
    with installed_agent(watchdog_sec=6):
        yield


def test_socket_activation_status_watchdog_reload_and_stop(installed: None) -> None:
    sh("systemctl", "start", "slicebox.socket")
    assert prop("slicebox.service", "ActiveState") == "inactive"
    mode = SOCKET.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o660
    assert sh("stat", "-c", "%G", str(SOCKET)).stdout.strip() == "slicebox"

    # The first call starts the service through the socket.
    assert curl_health()["status"] == "ok"
    assert prop("slicebox.service", "ActiveState") == "active"
    assert "answering on" in prop("slicebox.service", "StatusText")
    doctor = sh("slicebox", "--json", "doctor", check=False)
    assert doctor.returncode == 0, doctor.stdout
    assert all(check["ok"] for check in json.loads(doctor.stdout))

    # A live loop keeps pinging: well past WatchdogSec the agent has not been restarted...
    time.sleep(10)
    assert prop("slicebox.service", "NRestarts") == "0"
    # ...and a loop that makes no progress stops pinging: systemd restarts the agent.
    first_pid = prop("slicebox.service", "MainPID")
    sh("kill", "-STOP", first_pid)
    wait_for(lambda: prop("slicebox.service", "NRestarts") == "1", timeout=90, step=1)
    wait_for(lambda: prop("slicebox.service", "ActiveState") == "active", timeout=60, step=1)
    assert prop("slicebox.service", "MainPID") != first_pid
    assert curl_health()["status"] == "ok"

    sh("systemctl", "reload", "slicebox.service")
    wait_for(lambda: "reloaded" in prop("slicebox.service", "StatusText"), timeout=30)

    main_pid = prop("slicebox.service", "MainPID")
    sh("systemctl", "stop", "slicebox.service")
    assert prop("slicebox.service", "Result") == "success"
    stopping = sh(
        "journalctl",
        "--no-pager",
        "-o",
        "cat",
        f"_PID={main_pid}",
        f"MESSAGE_ID={MESSAGE_IDS[AuditEvent.AGENT_STOPPING]}",
    ).stdout
    assert "agent_stopping" in stopping


def test_doctor_names_what_is_missing_when_the_agent_is_down() -> None:
    result = sh("slicebox", "doctor", "--help", check=False)
    assert result.returncode == 0
    doctor = sh(
        "slicebox", "--socket", "/run/slicebox/nothing.sock", "--json", "doctor", check=False
    )
    checks = {check["name"]: check for check in json.loads(doctor.stdout)}
    assert doctor.returncode == 1
    assert not checks["agent"]["ok"]
    assert all(check["ok"] for name, check in checks.items() if name != "agent")


PLUGIN = "sbxtest_pydantic_plugin"
LOADED = "SBXTEST-PYDANTIC-PLUGIN-LOADED"


@contextmanager
def pydantic_plugin_installed() -> Iterator[None]:
    """A pydantic plugin installed on the host as a distribution installs one (its module and an
    entry point in the group ``pydantic``, in the site directory both the agent's and anyone's
    Python read); imported, it says so on stderr."""
    packages = Path(site.getsitepackages()[0])
    module, info = packages / f"{PLUGIN}.py", packages / f"{PLUGIN}-1.0.dist-info"
    info.mkdir()
    try:
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[pydantic]\nsbxtest = {PLUGIN}:plugin\n")
        module.write_text(
            f"import sys\nprint({LOADED!r}, sys.argv, file=sys.stderr, flush=True)\n"
            "class Plugin:\n"
            "    def new_schema_validator(self, *args, **kwargs):\n"
            "        return None, None, None\n"
            "plugin = Plugin()\n"
        )
        yield
    finally:
        shutil.rmtree(info)
        module.unlink(missing_ok=True)


def test_a_pydantic_plugin_on_the_host_runs_in_python_but_not_in_the_agent_nor_the_cli(
    installed: None,
) -> None:
    """Third-party code that would see every request validated (git tokens included): the
    agent and the CLI start without pydantic's plugins (slicebox.host.lean)."""
    model = "import pydantic\nclass M(pydantic.BaseModel):\n    x: int\nM(x=1)\n"
    with pydantic_plugin_installed():
        assert LOADED in sh("python3", "-c", model).stderr, "any other Python process loads it"
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        # The first call starts the agent: its config validated, its app built, a request
        # answered; then the CLI validates its request and the agent's answer.
        sh("systemctl", "start", "slicebox.socket")
        assert curl_health()["status"] == "ok"
        listed = sh("slicebox", "--json", "ps")
        assert listed.returncode == 0, listed.stderr
        assert LOADED not in listed.stderr

        def agent_said() -> str:
            argv = ["journalctl", "--no-pager", "-o", "cat", "-u", "slicebox.service"]
            return sh(*argv, "--since", since).stdout

        # Its stderr is read up to the line it logs after its config was validated.
        wait_for(lambda: "reconciled:" in agent_said(), timeout=60)
        assert LOADED not in agent_said()
