"""The ``slicebox`` command against the agent's real app on a unix socket (core over fakes)."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.cli import main as cli
from slicebox.model.api import Destroyed, RunResult, SandboxView
from slicebox.model.exec import ExecResult, OutputStream, StreamChunk
from slicebox.model.reaper import Report
from slicebox.model.usage import LevelNode, ResourceUsage
from tests.fakes.exec_fakes import FakeExec
from tests.unit.agentserver import Agent, served

OUT, ERR = OutputStream.STDOUT, OutputStream.STDERR
Fd = pytest.CaptureFixture[bytes]
# Bytes whose base64 needs the url-safe alphabet ('-', '_') and padding: "-__-Pj8=".
ODD = bytes([0xFB, 0xFF, 0xFE, 0x3E, 0x3F])


class Stdin:
    """What ``sys.stdin`` is to the CLI: a terminal, or a pipe of bytes."""

    def __init__(self, data: bytes = b"", tty: bool = False) -> None:
        self.buffer = io.BytesIO(data)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    monkeypatch.setattr(sys, "stdin", Stdin())
    with served(tmp_path) as running:
        yield running
        assert running.sandboxes() == [], "a test left a sandbox behind"


def slicebox(agent: Agent, *argv: str) -> int:
    return cli.main(["--socket", agent.socket, *argv])


def created(agent: Agent, capfdbinary: Fd) -> str:
    assert slicebox(agent, "create", "--project", "web") == 0
    return capfdbinary.readouterr().out.decode().strip()


def test_exec_writes_bytes_to_their_own_fds_and_passes_the_exit_code(
    agent: Agent, capfdbinary: Fd
) -> None:
    box = created(agent, capfdbinary)
    agent.script((OUT, ODD), (ERR, b"\0err\n"), (OUT, b"hello?>\n"), exit_code=7)
    assert slicebox(agent, "exec", box, "--", "sh", "-c", "anything") == 7
    written = capfdbinary.readouterr()
    assert (written.out, written.err) == (ODD + b"hello?>\n", b"\0err\n")
    assert slicebox(agent, "rm", box) == 0


def test_stdin_goes_as_bytes_with_the_output_cap(
    agent: Agent, capfdbinary: Fd, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = created(agent, capfdbinary)
    monkeypatch.setattr(sys, "stdin", Stdin(ODD * 3))
    run = agent.script((OUT, ODD * 3))
    assert slicebox(agent, "exec", "--output-cap", "1234", box, "--", "cat") == 0
    assert run.stdin == ODD * 3
    assert run.request is not None
    assert (run.request.argv, run.request.output_cap) == (("cat",), 1234)
    assert capfdbinary.readouterr().out == ODD * 3
    monkeypatch.setattr(sys, "stdin", Stdin(b"typed by a person", tty=True))
    run = agent.script()
    assert slicebox(agent, "exec", box, "--", "cat") == 0
    assert run.stdin == b""  # a terminal is not input for the command
    slicebox(agent, "rm", box)


def test_a_timeout_and_a_cap_are_said_on_stderr(agent: Agent, capfdbinary: Fd) -> None:
    box = created(agent, capfdbinary)
    silent_after = FakeExec([[StreamChunk(stream=OUT, data=b"12345")]])  # then runs on
    agent.world.exec_api.run = silent_after
    argv = ["exec", "--timeout", "2", "--output-cap", "2", box, "--", "sleep", "99"]
    assert slicebox(agent, *argv) == 124
    written = capfdbinary.readouterr()
    assert written.out == b"12"
    assert b"stdout truncated, 3 bytes dropped" in written.err
    assert b"timed out and was killed" in written.err
    slicebox(agent, "rm", box)


def test_json_exec_is_the_result_model(agent: Agent, capfdbinary: Fd) -> None:
    box = created(agent, capfdbinary)
    agent.script((OUT, ODD), exit_code=3)
    assert slicebox(agent, "--json", "exec", box, "--", "x") == 3
    result = ExecResult.model_validate_json(capfdbinary.readouterr().out)
    assert (result.stdout, result.exit_code) == (ODD, 3)
    slicebox(agent, "rm", box)


def test_run_streams_and_leaves_nothing(agent: Agent, capfdbinary: Fd) -> None:
    agent.script((OUT, ODD), (ERR, b"e"), exit_code=9)
    assert slicebox(agent, "run", "--project", "web", "--env", "A=1=2", "--", "x") == 9
    written = capfdbinary.readouterr()
    assert (written.out, written.err) == (ODD, b"e")
    agent.script((OUT, b"j"))
    assert slicebox(agent, "--json", "run", "--project", "web", "--", "x") == 0
    outcome = RunResult.model_validate_json(capfdbinary.readouterr().out)
    assert outcome.result.stdout == b"j"


def test_every_other_command_answers_in_models(agent: Agent, capfdbinary: Fd) -> None:
    def answer(*argv: str) -> bytes:
        assert slicebox(agent, "--json", *argv) == 0
        return capfdbinary.readouterr().out

    box = SandboxView.model_validate_json(answer("create", "--project", "web", "--ttl", "60"))
    kept = SandboxView.model_validate_json(answer("create", "--workspace", "volume:w", "--keep"))
    assert kept.workspace_volume.endswith("-w")
    assert Destroyed.model_validate_json(answer("rm", kept.id)).destroyed
    assert [v["id"] for v in json.loads(answer("ps"))] == [box.id]
    assert SandboxView.model_validate_json(answer("extend", box.id, "600")).expires_at
    assert ResourceUsage.model_validate_json(answer("usage", box.id)).sandbox is not None
    assert LevelNode.model_validate_json(answer("usage")).unit == "slicebox.slice"
    assert LevelNode.model_validate_json(answer("top", "--count", "1")).unit == "slicebox.slice"
    assert Report.model_validate_json(answer("reap", "--dry-run")).dry_run
    for argv in (["ps"], ["usage"], ["reap", "--dry-run"], ["extend", box.id, "60"]):
        assert slicebox(agent, *argv) == 0
    assert box.id in capfdbinary.readouterr().out.decode()
    assert Destroyed.model_validate_json(answer("rm", box.id)).destroyed
    assert slicebox(agent, "rm", box.id) == 0
    assert capfdbinary.readouterr().out == f"{box.id} already gone\n".encode()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["exec", "sbx-nothing", "--", "x"], b"not_found: no sandbox sbx-nothing"),
        (["exec", "--output-cap", "-1", "sbx-1", "--", "x"], b"output_cap"),
        (["exec", "sbx-1", "--"], b"argv is empty"),
        (["run", "--env", "NOVALUE", "--", "x"], b"--env takes NAME=VALUE"),
        (["create", "--root-task", "not an id"], b"invalid_field: root_task_id"),
        (["create", "--memory", "lots"], b"invalid_limit"),
        (["create", "--ttl", "1000000000000"], b"ttl_too_long: ttl_seconds is more than"),
        (["run", "--ttl", "86401", "--", "x"], b"ttl_too_long: ttl_seconds is more than"),
        (
            ["create", "--workspace", "host"],
            b"workspace: a host workspace needs",
        ),
        (["create", "--workspace", "disk:x"], b"invalid_workspace: workspace.kind"),
        (["create", "--keep"], b"--keep and --read-only need --workspace"),
        (["create", "--run-as", "0"], b"policy_root: sandboxes of"),
        (["create", "--allow", "pypi.org", "--allow", "*"], b"no bare '*'"),
    ],
)
def test_mistakes_exit_2_with_the_code_and_what_to_do(
    agent: Agent, capfdbinary: Fd, argv: list[str], said: bytes
) -> None:
    assert slicebox(agent, *argv) == 2
    assert said in capfdbinary.readouterr().err


def test_extending_past_the_maximum_says_the_maximum(agent: Agent, capfdbinary: Fd) -> None:
    box = created(agent, capfdbinary)
    assert slicebox(agent, "extend", box, str(10**30)) == 2
    assert b"ttl_too_long: ttl_seconds is more than this agent's maximum of 86400" in (
        capfdbinary.readouterr().err
    )
    assert slicebox(agent, "rm", box) == 0


def test_a_bad_option_gets_the_same_code_as_the_agent_gives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--socket", "/nonexistent/agent.sock", "extend", "sbx-1", "0"]) == 2
    assert "invalid_ttl: ttl_seconds" in capsys.readouterr().err
