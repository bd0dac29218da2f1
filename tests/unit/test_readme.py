"""The README is for a newcomer: short, and every command in it works.

Each ``slicebox`` line is parsed by the CLI's own parser; the Python example and the curl lines
run against the agent's real routes on a real socket (``tests.unit.agentserver``, the core over
fakes). The README's other commands are the ones a test already runs: ``tests/run-all`` is
``.ci/run``, ``tests/demo`` the main job, and ``packaging/build`` with ``apt install`` are
``tests/host/test_package.py``'s; a command outside that list fails here until a test runs it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import slicebox.client
from slicebox.cli.main import build_parser
from slicebox.client import Client
from slicebox.model.exec import OutputStream
from tests.unit.agentserver import Agent, served

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Run elsewhere: CI's own command, the demo, and test_package's build and install.
RUN_ELSEWHERE = {"tests/demo", "tests/run-all", "packaging/build", "apt"}


def blocks(language: str = "") -> list[str]:
    """The README's fenced blocks of ``language`` ("" for those without one)."""
    found: list[str] = []
    lines: list[str] = []
    inside: str | None = None
    for line in README.read_text().splitlines():
        if inside is None and line.startswith("```"):
            inside, lines = line[3:], []
        elif inside is not None and line == "```":
            if inside == language:
                found.append("\n".join(lines) + "\n")
            inside = None
        elif inside is not None:
            lines.append(line)
    return found


def commands() -> Iterator[list[str]]:
    """Each command of the README's shell blocks, as words (comments and ``$(...)`` kept
    apart), the slice-tree picture left out."""
    for block in blocks():
        if "slicebox.slice" in block:
            continue
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            code = line.split("  #")[0].strip()
            if not code:
                continue
            for part in re.split(r";\s*", code):
                inner = re.fullmatch(r"\w+=\$\((.*)\)", part)
                yield shlex.split(inner.group(1) if inner else part)


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) < 250


def test_every_page_the_readme_names_exists() -> None:
    for name in re.findall(r"`((?:docs|packaging)/[\w./-]+)`", README.read_text()):
        assert (ROOT / name).exists(), f"the README names {name}, which does not exist"


def test_every_slicebox_command_in_the_readme_parses() -> None:
    parser = build_parser()
    seen = []
    for line in commands():
        words = line[1:] if line[0] == "sudo" else line
        if words[0] != "slicebox":
            continue
        seen.append(words[1])
        parser.parse_args(words[1:])  # argparse exits (SystemExit) on what it does not know
    assert {"doctor", "run", "create", "exec", "usage", "top", "cp", "rm", "reap"} <= set(seen)


def test_the_readmes_other_commands_are_run_by_a_test() -> None:
    others = set()
    for words in commands():
        first = words[1] if words[0] == "sudo" else words[0]
        if first not in {"slicebox", "curl"} and "=" not in first:
            others.add(first)
    assert others == RUN_ELSEWHERE


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with served(tmp_path) as running:
        yield running


def test_the_readmes_python_example_runs(
    agent: Agent, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (example,) = blocks("python")

    class Here(Client):
        def __init__(self) -> None:
            super().__init__(agent.socket)

    monkeypatch.setattr(slicebox.client, "Client", Here)
    agent.script((OutputStream.STDOUT, b"1\n"))
    exec(compile(example, "README.md", "exec"), {})
    assert capsys.readouterr().out == "0 1\n"
    assert agent.sandboxes() == []  # the client destroyed what it made


def test_the_readmes_curl_lines_answer(agent: Agent) -> None:
    (block,) = [b for b in blocks() if "curl" in b]
    script = block.replace("/run/slicebox/slicebox.sock", agent.socket)
    agent.script((OutputStream.STDOUT, b"hi\n"))
    lines = [line for line in script.replace("\\\n", " ").splitlines() if line.strip()]
    assert lines[0].startswith("sock=")
    answers = []
    for line in lines[1:]:
        done = subprocess.run(
            ["bash", "-c", f"{lines[0]}\n{line} -w '\\n%{{http_code}}'"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        answers.append(done.stdout)
    assert answers[0].endswith("\n200")
    assert '"exit_code":0' in answers[1].replace(" ", "")
    assert '"stdout":"aGkK"' in answers[1].replace(" ", "")  # base64 of "hi\\n"
    assert answers[1].endswith("\n200")
