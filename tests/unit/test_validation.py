"""One reader of pydantic errors: each field keeps its own code wherever it is sent."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from slicebox.model import errors
from slicebox.model.api import Extend, RunRequest
from slicebox.model.config import parse_config
from slicebox.model.exec import ExecRequest
from slicebox.model.spec import parse_spec
from slicebox.model.validation import refusal

SPEC = {"user": "a", "project": "b"}


def refused(model: type[BaseModel], data: object) -> errors.InvalidRequest:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(data)
    return refusal(caught.value)


@pytest.mark.parametrize(
    ("fields", "code", "field", "kind"),
    [
        ({"memory": [1]}, "invalid_limit", "memory", errors.InvalidLimit),
        ({"cpus": {}}, "invalid_limit", "cpus", errors.InvalidLimit),
        ({"pids": None, "user": 3}, "invalid_name", "user", errors.InvalidName),
        ({"project": 7}, "invalid_name", "project", errors.InvalidName),
        ({"ttl_seconds": 0}, "invalid_ttl", "ttl_seconds", errors.InvalidRequest),
        ({"mounts": [{"source": "x", "target": "rel"}]}, "invalid_mount", "mounts.0.target", None),
        ({"mounts": [{"source": "x", "target": "/t", "kind": "nfs"}]}, "invalid_mount", None, None),
        ({"surprise": 1}, "invalid_field", "surprise", errors.InvalidRequest),
        ({"task_id": "bad id/"}, "invalid_field", "task_id", errors.InvalidRequest),
    ],
)
def test_a_spec_field_keeps_its_code(
    fields: dict[str, object], code: str, field: str | None, kind: type | None
) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        parse_spec(SPEC | fields)
    assert caught.value.code == code
    assert caught.value.field == (field or "mounts.0.kind")
    assert caught.value.message.startswith(f"{caught.value.field}: ")
    if kind is not None:
        assert type(caught.value) is kind


@pytest.mark.parametrize(
    ("data", "code", "field"),
    [
        ({"argv": []}, "invalid_command", "argv"),
        ({"argv": "ls"}, "invalid_command", "argv"),
        ({"argv": ["ls", "a\0b"]}, "invalid_command", "argv"),
        ({"argv": ["ls"], "shell": "maybe"}, "invalid_command", "shell"),
        ({"argv": ["ls"], "timeout": "soon"}, "invalid_timeout", "timeout"),
        ({"argv": ["ls"], "cwd": "rel"}, "invalid_field", "cwd"),
        ({}, "invalid_command", "argv"),
    ],
)
def test_an_exec_field_keeps_its_code(data: dict[str, object], code: str, field: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        ExecRequest.parse(data)
    assert (caught.value.code, caught.value.field) == (code, field)


def test_nested_fields_keep_their_code_and_full_name() -> None:
    error = refused(RunRequest, {"sandbox": {"project": "p", "pids": []}, "exec": {"argv": []}})
    assert (error.code, error.field) == ("invalid_limit", "sandbox.pids")
    assert error.message == (
        "sandbox.pids: Input should be a valid integer; "
        "exec.argv: argv is empty: give the program to run as its first item"
    )
    assert refused(Extend, {"ttl_seconds": 0}).code == "invalid_ttl"


def test_messages_say_what_to_do_not_how_pydantic_says_it() -> None:
    assert refused(ExecRequest, {"argv": ["ls"], "bogus": 1}).message == (
        "bogus: not a known field; remove it or check its spelling"
    )
    assert refused(RunRequest, {"exec": {"argv": ["ls"]}}).message == (
        "sandbox: required; give a value"
    )


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[project]\nmemory = "lots"', "project.memory"),
        ("[user]\nsurprise = 1", "user.surprise"),
        ("[users.memory]\ncpus = -1", "users.memory.cpus"),
        ("[reaper]\norphans = 'eat'", "reaper.orphans"),
    ],
)
def test_config_errors_name_the_setting(text: str, field: str) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        parse_config(text)
    assert caught.value.code == "invalid_config"
    assert caught.value.field == field
    assert f"<config>: {field}: " in caught.value.message
