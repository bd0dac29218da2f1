"""ExecRequest and ExecResult at the edge: what is accepted, and the error code of the rest."""

from __future__ import annotations

import base64
import json

import pytest

from slicebox.model.errors import InvalidCommand, InvalidRequest, InvalidTimeout
from slicebox.model.exec import ExecRequest, ExecResult


def test_defaults_follow_the_product_contract() -> None:
    request = ExecRequest.parse({"argv": ["ls"]})
    assert request.argv == ("ls",)
    assert request.cwd == "/workspace"
    assert request.timeout == 30.0
    assert request.output_cap == 50_000
    assert request.stdin == b""
    assert request.env == {}


def test_a_string_runs_through_sh_only_when_asked() -> None:
    request = ExecRequest.parse({"argv": "echo $HOME", "shell": True})
    assert request.argv == ("sh", "-c", "echo $HOME")


@pytest.mark.parametrize(
    ("data", "error", "words"),
    [
        ({"argv": "echo hi"}, InvalidCommand, "shell: true"),
        ({"argv": ["echo", "hi"], "shell": True}, InvalidCommand, "one string"),
        ({"argv": []}, InvalidCommand, "argv is empty"),
        ({"argv": ""}, InvalidCommand, "argv is empty"),
        ({"argv": "", "shell": True}, InvalidCommand, "argv is empty"),
        ({"argv": [""]}, InvalidCommand, "argv is empty"),
        ({"argv": ["a\0b"]}, InvalidCommand, "NUL"),
        ({}, InvalidCommand, "argv"),
        ({"argv": ["ls"], "timeout": -1}, InvalidTimeout, "more than 0"),
        ({"argv": ["ls"], "timeout": 0}, InvalidTimeout, "more than 0"),
        ({"argv": ["ls"], "timeout": float("inf")}, InvalidTimeout, "more than 0"),
        ({"argv": ["ls"], "timeout": 10**9}, InvalidTimeout, "at most"),
        ({"argv": ["ls"], "timeout": "soon"}, InvalidTimeout, "timeout"),
        ({"argv": ["ls"], "output_cap": -1}, InvalidRequest, "output_cap"),
        ({"argv": ["ls"], "cwd": "tmp"}, InvalidRequest, "absolute"),
        ({"argv": ["ls"], "env": {"A=B": "c"}}, InvalidRequest, "env"),
        ({"argv": ["ls"], "privileged": True}, InvalidRequest, "privileged"),
    ],
)
def test_bad_requests_get_a_stable_code_naming_the_field(
    data: dict[str, object], error: type[InvalidRequest], words: str
) -> None:
    with pytest.raises(error, match=words) as caught:
        ExecRequest.parse(data)
    assert type(caught.value) is error
    assert caught.value.http_status == 400


def test_json_edge_carries_stdin_as_base64() -> None:
    raw = json.dumps({"argv": ["cat"], "stdin": base64.b64encode(bytes(range(256))).decode()})
    assert ExecRequest.parse_json(raw).stdin == bytes(range(256))
    with pytest.raises(InvalidCommand):
        ExecRequest.parse_json('{"argv": []}')


def test_result_serialises_output_as_base64() -> None:
    result = ExecResult(
        stdout=b"\xff\x00",
        stderr=b"",
        exit_code=0,
        timed_out=False,
        oom_killed=False,
        stdout_truncated=False,
        stderr_truncated=False,
        stdout_dropped_bytes=0,
        stderr_dropped_bytes=0,
        duration=0.5,
    )
    data = json.loads(result.model_dump_json())
    assert base64.urlsafe_b64decode(data["stdout"] + "==") == b"\xff\x00"
    assert ExecResult.model_validate_json(result.model_dump_json()) == result


def test_a_shell_request_survives_its_own_serialization() -> None:
    request = ExecRequest.model_validate({"shell": True, "argv": "echo $HOME | wc -c"})
    again = ExecRequest.model_validate_json(request.model_dump_json())
    assert again == request
    assert again.argv == ("sh", "-c", "echo $HOME | wc -c")
