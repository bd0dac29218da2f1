"""``python -m slicebox.mcp`` as a process on stdio, as an MCP client starts it, and
``slicebox mcp``'s choice of where the server runs: the session's end by stdin closed or by
SIGTERM removes the sandboxes it made; no SDK and no MCP venv is ``mcp_unavailable``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from slicebox.cli import main as cli
from slicebox.cli import mcp as cli_mcp
from tests.unit.agentserver import Agent, served
from tests.unit.test_mcp import answer

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'agent'}:{ROOT}"}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with served(tmp_path) as running:
        yield running
        assert running.sandboxes() == [], "a test left a sandbox behind"


def server_argv(agent: Agent) -> list[str]:
    return [sys.executable, "-m", "slicebox.mcp", "--socket", agent.socket, "--ttl", "600"]


def test_stdin_closed_ends_the_session_and_its_sandboxes(agent: Agent) -> None:
    argv = server_argv(agent)
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=ENV)

    async def session() -> str:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            made = answer(await client.call_tool("sandbox_create", {}))
            assert agent.sandboxes() == [made["id"]]
            return str(made["id"])

    assert anyio.run(session)
    assert agent.sandboxes() == []


def _send(stdin: IO[bytes], message: dict[str, Any]) -> None:
    stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
    stdin.flush()


def test_sigterm_ends_the_session_and_its_sandboxes(agent: Agent) -> None:
    with subprocess.Popen(
        server_argv(agent), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV
    ) as server:
        assert server.stdin is not None
        assert server.stdout is not None
        try:
            hello = {"protocolVersion": "2025-06-18", "capabilities": {}}
            hello["clientInfo"] = {"name": "test", "version": "0"}
            _send(server.stdin, {"id": 1, "method": "initialize", "params": hello})
            assert json.loads(server.stdout.readline())["id"] == 1
            _send(server.stdin, {"method": "notifications/initialized"})
            call = {"name": "sandbox_create", "arguments": {}}
            _send(server.stdin, {"id": 2, "method": "tools/call", "params": call})
            made = json.loads(server.stdout.readline())["result"]["structuredContent"]
            assert agent.sandboxes() == [made["id"]]
            server.send_signal(signal.SIGTERM)  # stdin still open: the signal alone ends it
            assert server.wait(timeout=30) == 0
        finally:
            server.kill()  # a no-op once it ended; the block then closes its pipes and waits
    assert agent.sandboxes() == []


def test_no_sdk_and_no_mcp_venv_is_mcp_unavailable_with_the_commands_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli_mcp, "sdk_here", lambda: False)
    monkeypatch.setenv("SLICEBOX_MCP_PYTHON", "/nonexistent/bin/python")
    assert cli.main(["mcp"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("slicebox: mcp_unavailable: ")
    assert "/nonexistent/bin/python" in said
    assert "python3 -m venv --system-site-packages /opt/slicebox-mcp" in said
    assert "pip install 'mcp>=1.20,<2'" in said


def test_without_the_sdk_the_mcp_venvs_python_runs_the_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    ran: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        ran.append(argv)
        raise SystemExit(0)  # an exec does not return

    monkeypatch.setattr(cli_mcp, "sdk_here", lambda: False)
    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setenv("SLICEBOX_MCP_PYTHON", str(python))
    with pytest.raises(SystemExit):
        cli.main(["--socket", "/run/x.sock", "mcp", "--ttl", "90"])
    assert ran == [
        [str(python), "-m", "slicebox.mcp", "--socket", "/run/x.sock", "--project", "default",
         "--ttl", "90", "--max-transfer", str(32 * 1024 * 1024)],
    ]  # fmt: skip


def test_the_sdk_is_here_in_the_dev_venv() -> None:
    assert cli_mcp.sdk_here()


def test_stdin_that_epoll_refuses_ends_the_session_as_a_closed_pipe_does(tmp_path: Path) -> None:
    """/dev/null and a regular file go to the SDK's own reader: its end is seen, no hang."""
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    argv = [sys.executable, "-m", "slicebox.mcp", "--socket", str(tmp_path / "none.sock")]
    with empty.open("rb") as file:
        for stdin in (subprocess.DEVNULL, file):
            ran = subprocess.run(
                argv, stdin=stdin, capture_output=True, env=ENV, timeout=60, check=False
            )
            assert ran.returncode == 0, ran.stderr
