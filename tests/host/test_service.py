"""The agent as a systemd service: socket activation, sd_notify, watchdog, reload, stop."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator

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
