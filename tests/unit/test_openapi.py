"""The API contract: the repo's OpenAPI copy matches what is served, and no input gets a 500."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slicebox.server.openapi import document
from tests.unit.agentserver import served
from tests.unit.test_service import World

DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
PATHS = [
    ("GET", "/v1/health"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/{id}"),
    ("DELETE", "/v1/sandboxes/{id}"),
    ("POST", "/v1/sandboxes/{id}/exec"),
    ("POST", "/v1/sandboxes/{id}/exec/stream"),
    ("GET", "/v1/sandboxes/{id}/usage"),
    ("DELETE", "/v1/tasks/{id}"),
    ("POST", "/v1/run"),
    ("GET", "/v1/usage/tree"),
    ("PUT", "/v1/sandboxes"),
    ("GET", "/v1/nothing/here"),
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
known_keys = st.sampled_from(
    [
        "project",
        "user",
        "image",
        "memory",
        "cpus",
        "pids",
        "network",
        "argv",
        "shell",
        "timeout",
        "stdin",
        "env",
        "cwd",
        "sandbox",
        "exec",
        "privileged",
        "mounts",
        "ttl_seconds",
    ]
)
shaped = st.dictionaries(known_keys, json_values, max_size=6)
bodies = st.one_of(
    shaped.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
)
ids = st.sampled_from(["sbx-000000000001", "sbx-nothing", "..", "%2e%2e", "a" * 300])


def test_the_repo_copy_is_what_the_agent_serves() -> None:
    assert json.loads(DOCUMENT.read_text()) == document(), (
        "docs/openapi.json is stale: run python3 -m slicebox.server.openapi > docs/openapi.json"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, World]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    world = World(tmp)
    world.create(world.service_identity())  # one sandbox exists: sbx-000000000001
    with served(tmp, world) as agent:
        yield Path(agent.socket), world


def send(path: Path, method: str, target: str, body: bytes) -> tuple[int, bytes]:
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(path))
        s.sendall(head + body)
        answer = b"".join(iter(lambda: s.recv(65536), b""))
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(route=st.sampled_from(PATHS), sandbox=ids, body=bodies)
def test_no_input_gets_a_500(
    server: tuple[Path, World], route: tuple[str, str], sandbox: str, body: bytes
) -> None:
    path, _ = server
    method, template = route
    status, answer = send(path, method, template.replace("{id}", sandbox), body)
    assert status < 500, answer
    if status >= 400:
        envelope = json.loads(answer)
        assert set(envelope) >= {"code", "message"}
