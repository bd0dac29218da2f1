"""``slicebox mcp`` as an ordinary user meets it (issue 42): the SDK's own stdio client (in the
MCP venv, /opt/slicebox-mcp, where the guest image puts the SDK) starts ``slicebox mcp``, which
runs under Debian's python, finds no SDK there and runs its server in that venv; every tool
goes to the real agent as that user. Another user's sandbox is ``not_found``; the session's end
removes what it made and leaves none of its processes. Two containers in all."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.host.agentunits import admin, installed_agent, remove_sandboxes
from tests.host.helpers import ordinary_user, sh, wait_for

pytestmark = pytest.mark.host

USER, OTHER = "sbxmcp", "sbxmcpother"  # ordinary users in group slicebox
VENV_PYTHON = "/opt/slicebox-mcp/bin/python"


def mine(user: str) -> list[str]:
    return [view.id for view in admin().list_sandboxes() if view.user == user]


@pytest.fixture(scope="module")
def session() -> Iterator[dict[str, Any]]:
    """One MCP session's report (tests/host/mcpdriver.py), with another user's sandbox id."""
    with installed_agent(), ordinary_user(USER), ordinary_user(OTHER):
        sh("systemctl", "start", "slicebox.socket")
        try:
            made = sh("runuser", "-u", OTHER, "--", "slicebox", "create", "--project", "mcp")
            other = made.stdout.strip()
            ran = subprocess.run(
                ["runuser", "-u", USER, "--", VENV_PYTHON, "-m", "tests.host.mcpdriver", other],
                capture_output=True,
                text=True,
                check=False,
                timeout=600,
                cwd="/src",
            )
            assert ran.returncode == 0, ran.stderr
            yield {**json.loads(ran.stdout), "other_id": other}
        finally:
            remove_sandboxes([USER, OTHER])


def test_the_tools_are_listed_with_valid_schemas(session: dict[str, Any]) -> None:
    assert {"sandbox_create", "sandbox_exec", "run", "file_read", "tree_download"} <= set(
        session["tools"]
    )


def test_an_exec_streams_progress_and_a_timeout_answers_124(session: dict[str, Any]) -> None:
    streamed = session["streamed"]
    assert streamed["result"]["stdout"] == "line 1\nline 2\nline 3\n"
    assert len(streamed["reports"]) >= 2, "progress came as the output did, not at the end"
    assert streamed["reports"][0][1] == "stdout: line 1\n"
    timeout = session["timeout"]
    assert (timeout["exit_code"], timeout["timed_out"], timeout["is_error"]) == (124, True, False)


def test_files_and_trees_go_both_ways_byte_exact(session: dict[str, Any]) -> None:
    assert session["binary_exact"] is True
    assert session["binary_encoding"] == "base64"
    assert session["uploaded"]["is_error"] is False
    assert session["tree_back"] == session["tree_sent"]
    names = {entry["name"]: entry["kind"] for entry in session["listed"]["entries"]}
    assert names == {"a.txt": "file", "lib": "directory"}


def test_usage_and_destroy_and_another_users_sandbox_is_not_found(
    session: dict[str, Any],
) -> None:
    assert session["usage"]["sandbox"]["backend"] == "docker"
    assert session["usage"]["memory_bytes"]["user"] > 0
    assert session["destroyed"]["destroyed"] is True
    assert (session["other"]["is_error"], session["other"]["code"]) == (True, "not_found")
    assert session["tree_resource"] is True
    assert mine(OTHER) == [session["other_id"]]  # untouched


def test_the_sessions_end_removes_what_it_made_and_its_processes(session: dict[str, Any]) -> None:
    wait_for(lambda: mine(USER) == [], timeout=60)
    assert sh("pgrep", "-u", USER, check=False).stdout == ""
