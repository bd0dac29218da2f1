"""The ``slicebox`` command as an ordinary user meets it, through the real agent (a systemd
service) on a real host: bytes in and out unchanged, each stream on its own descriptor, the
command's exit code passed through, and doctor's honest words. Two containers in all."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.host.agentunits import installed_agent, remove_sandboxes
from tests.host.helpers import ordinary_user, sh, wait_for

pytestmark = pytest.mark.host

USER = "sbxcli"  # an ordinary user in group slicebox
MiB = 1024 * 1024


def as_user(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["runuser", "-u", USER, "--", "slicebox", *argv],
        input=stdin,
        capture_output=True,
        check=False,
        timeout=600,
    )


@pytest.fixture(scope="module")
def box() -> Iterator[str]:
    with installed_agent(), ordinary_user(USER):
        sh("systemctl", "start", "slicebox.socket")
        try:
            made = as_user("create", "--project", "cli")
            assert made.returncode == 0, made.stderr
            yield made.stdout.decode().strip()
        finally:
            remove_sandboxes()


def test_a_mebibyte_of_random_bytes_goes_through_cat_unchanged(box: str) -> None:
    data = os.urandom(MiB)
    ran = as_user("exec", "--output-cap", str(2 * MiB), box, "--", "cat", stdin=data)
    assert ran.returncode == 0, ran.stderr
    assert hashlib.sha256(ran.stdout).hexdigest() == hashlib.sha256(data).hexdigest()
    assert ran.stderr == b""


def test_text_whose_base64_needs_the_url_alphabet_and_padding_comes_back_exact(box: str) -> None:
    text = "hello?> ~ûÿ"
    wire = base64.urlsafe_b64encode((text + "\n").encode()).decode()
    assert {"-", "_"} <= set(wire), wire
    assert wire.endswith("="), wire
    ran = as_user("exec", box, "--", "echo", text)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, (text + "\n").encode(), b"")


def test_each_stream_on_its_own_descriptor_and_the_exit_code_passes(box: str) -> None:
    ran = as_user(
        "exec", box, "--", "sh", "-c", "printf 'to\\377out'; printf 'to err' >&2; exit 42"
    )
    assert (ran.returncode, ran.stdout, ran.stderr) == (42, b"to\xffout", b"to err")


def test_a_one_shot_run_streams_and_leaves_nothing(box: str) -> None:
    ran = as_user("run", "--project", "cli-run", "--", "sh", "-c", "echo hi; echo oh >&2; exit 3")
    assert (ran.returncode, ran.stdout, ran.stderr) == (3, b"hi\n", b"oh\n")
    # The streamed one-shot answers first and the agent removes its sandbox after.
    wait_for(lambda: [s["id"] for s in json.loads(as_user("--json", "ps").stdout)] == [box])


def test_doctor_as_an_ordinary_user_skips_what_it_cannot_check(box: str) -> None:
    human = as_user("doctor")
    assert human.returncode == 0, human.stdout
    assert b"skip docker" in human.stdout
    assert b"sudo slicebox doctor" in human.stdout
    checks = {c["name"]: c for c in json.loads(as_user("--json", "doctor").stdout)}
    assert (checks["docker"]["state"], checks["docker"]["ok"]) == ("skip", False)
    assert checks["agent"]["state"] == "ok"
