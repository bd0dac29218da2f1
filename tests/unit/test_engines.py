"""Finding the container engine: DOCKER_HOST, the Docker context, then the known sockets,
against real unix sockets and a Docker config tree in a temporary directory."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.backends.dockerendpoint import DockerEndpoint
from slicebox.backends.engines import (
    accepts,
    discover,
    docker_config_dir,
    known_sockets,
)
from slicebox.model.errors import Unavailable
from slicebox.model.paths import DOCKER_SOCKET


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[list[socket.socket]]:
    """Listening unix sockets a test opens with ``listen``; closed after it."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def listen(opened: list[socket.socket], path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(4)
    opened.append(sock)
    return str(path)


def stale(path: Path) -> str:
    """A socket file nothing listens on any more (a daemon that stopped uncleanly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()
    return str(path)


def context(config: Path, name: str, host: str, *, tls: bool = False) -> None:
    digest = hashlib.sha256(name.encode()).hexdigest()
    meta = config / "contexts" / "meta" / digest
    meta.mkdir(parents=True)
    endpoints = {"docker": {"Host": host, "SkipTLSVerify": False}}
    (meta / "meta.json").write_text(json.dumps({"Name": name, "Endpoints": endpoints}))
    if tls:
        (config / "contexts" / "tls" / digest / "docker").mkdir(parents=True)


def use(config: Path, name: str) -> None:
    config.mkdir(parents=True, exist_ok=True)
    (config / "config.json").write_text(json.dumps({"auths": {}, "currentContext": name}))


def test_docker_host_comes_first_over_a_context_and_the_sockets(
    tmp_path: Path, listening: list[socket.socket]
) -> None:
    config = tmp_path / "docker"
    context(config, "other", "unix:///other.sock")
    use(config, "other")
    system = listen(listening, tmp_path / "docker.sock")
    env = {"DOCKER_HOST": "tcp://127.0.0.1:2400", "DOCKER_CONTEXT": "other"}
    found = discover(env, config_dir=config, sockets=[(system, "the system's")])
    assert found.endpoint == DockerEndpoint(scheme="tcp", address="127.0.0.1", port=2400)
    assert found.source == "DOCKER_HOST"
    assert found.describe() == "tcp://127.0.0.1:2400 (DOCKER_HOST)"


def test_the_config_s_current_context_names_the_engine(
    tmp_path: Path, listening: list[socket.socket]
) -> None:
    config = tmp_path / "docker"
    context(config, "colima", "unix:///home/me/.colima/docker.sock")
    use(config, "colima")
    system = listen(listening, tmp_path / "docker.sock")
    found = discover({}, config_dir=config, sockets=[(system, "the system's")])
    assert found.endpoint.address == "/home/me/.colima/docker.sock"
    assert found.source == "the Docker context 'colima'"


def test_docker_context_in_the_environment_overrides_the_config_s(tmp_path: Path) -> None:
    config = tmp_path / "docker"
    context(config, "a", "unix:///a.sock")
    context(config, "b", "tcp://10.0.0.2:2375")
    use(config, "a")
    found = discover({"DOCKER_CONTEXT": "b"}, config_dir=config, sockets=[])
    assert found.endpoint == DockerEndpoint(scheme="tcp", address="10.0.0.2", port=2375)


def test_a_chosen_context_is_kept_although_its_daemon_does_not_answer(
    tmp_path: Path, listening: list[socket.socket]
) -> None:
    """A choice is never passed over for another engine: its failure is reported."""
    config = tmp_path / "docker"
    context(config, "down", f"unix://{tmp_path / 'down.sock'}")
    use(config, "down")
    system = listen(listening, tmp_path / "docker.sock")
    found = discover({}, config_dir=config, sockets=[(system, "the system's")])
    assert found.endpoint.address == str(tmp_path / "down.sock")


def test_the_default_context_means_the_known_sockets(
    tmp_path: Path, listening: list[socket.socket]
) -> None:
    config = tmp_path / "docker"
    use(config, "default")
    system = listen(listening, tmp_path / "docker.sock")
    found = discover({}, config_dir=config, sockets=[(system, "the system's")])
    assert found.endpoint.address == system


@pytest.mark.parametrize(
    ("host", "tls", "code"),
    [
        ("ssh://me@builder", False, "docker_host_unsupported"),
        ("tcp://10.0.0.3:2376", True, "docker_tls_unsupported"),
    ],
)
def test_a_context_slicebox_cannot_follow_is_refused_with_its_code(
    tmp_path: Path, host: str, tls: bool, code: str
) -> None:
    config = tmp_path / "docker"
    context(config, "remote", host, tls=tls)
    with pytest.raises(Unavailable) as refused:
        discover({"DOCKER_CONTEXT": "remote"}, config_dir=config, sockets=[])
    assert refused.value.code == code
    assert "'remote'" in refused.value.message


def test_an_unknown_context_says_who_named_it_and_what_to_do(tmp_path: Path) -> None:
    config = tmp_path / "docker"
    use(config, "gone")
    with pytest.raises(Unavailable) as refused:
        discover({}, config_dir=config, sockets=[])
    assert refused.value.code == "docker_context_unknown"
    message = refused.value.message
    assert "'gone'" in message
    assert str(config / "config.json") in message
    assert "docker context" in message
    assert "DOCKER_HOST" in message


@pytest.mark.parametrize("text", ["{not json", '["a list"]', '{"currentContext": 3}'])
def test_a_broken_docker_config_is_refused_not_ignored(tmp_path: Path, text: str) -> None:
    config = tmp_path / "docker"
    config.mkdir()
    (config / "config.json").write_text(text)
    with pytest.raises(Unavailable) as refused:
        discover({}, config_dir=config, sockets=[])
    assert refused.value.code == "docker_config_invalid"
    assert str(config / "config.json") in refused.value.message


def test_the_first_known_socket_that_answers_is_taken(
    tmp_path: Path, listening: list[socket.socket]
) -> None:
    """The system's socket left behind by a stopped daemon is passed over for the user's
    rootless daemon, and that over Podman's."""
    system = stale(tmp_path / "run" / "docker.sock")
    rootless = listen(listening, tmp_path / "user" / "docker.sock")
    podman = listen(listening, tmp_path / "podman" / "podman.sock")
    sockets = [
        (system, "the system's Docker socket"),
        (str(tmp_path / "none.sock"), "a socket that is not there"),
        (rootless, "the rootless Docker socket"),
        (podman, "Podman's socket"),
    ]
    found = discover({}, config_dir=tmp_path / "no-config", sockets=sockets)
    assert found.endpoint.address == rootless
    assert found.source == "the rootless Docker socket"
    assert found.answered


def test_with_none_answering_the_first_that_exists_is_named(tmp_path: Path) -> None:
    system = stale(tmp_path / "docker.sock")
    sockets = [(str(tmp_path / "none.sock"), "none"), (system, "the system's Docker socket")]
    found = discover({}, config_dir=tmp_path, sockets=sockets)
    assert found.endpoint.address == system
    assert not found.answered
    assert found.describe() == f"unix://{system} (the system's Docker socket, which did not answer)"
    nothing = discover({}, config_dir=tmp_path, sockets=[(str(tmp_path / "none.sock"), "none")])
    assert nothing.endpoint.address == DOCKER_SOCKET
    assert not nothing.answered


def test_one_daemon_behind_two_paths_is_asked_once(tmp_path: Path) -> None:
    real = stale(tmp_path / "run" / "docker.sock")
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to(tmp_path / "run")
    asked: list[str] = []

    def answers(path: str) -> bool:
        asked.append(path)
        return False

    sockets = [(str(tmp_path / "var" / "run" / "docker.sock"), "a"), (real, "b")]
    discover({}, config_dir=tmp_path, sockets=sockets, answers=answers)
    assert asked == [str(tmp_path / "var" / "run" / "docker.sock")]


def test_the_known_sockets_in_their_order() -> None:
    paths = [path for path, _ in known_sockets({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000)]
    assert paths == [
        "/var/run/docker.sock",
        "/run/docker.sock",
        "/run/user/1000/docker.sock",
        "/run/podman/podman.sock",
        "/run/user/1000/podman/podman.sock",
    ]
    # Without XDG_RUNTIME_DIR (a system service), the user's runtime directory by its uid.
    assert known_sockets({}, 0)[2][0] == "/run/user/0/docker.sock"


def test_the_docker_config_directory_as_docker_finds_it(tmp_path: Path) -> None:
    assert docker_config_dir({"DOCKER_CONFIG": "/etc/dc", "HOME": "/h"}, 0) == Path("/etc/dc")
    assert docker_config_dir({"HOME": "/home/me"}, 0) == Path("/home/me/.docker")
    # A service without HOME: the user's home directory from the user database.
    import pwd

    home = pwd.getpwuid(os.getuid()).pw_dir
    assert docker_config_dir({}, os.getuid()) == Path(home) / ".docker"


def test_accepts_only_a_socket_that_takes_a_connection(
    tmp_path: Path, listening: list[socket.socket]
) -> None:
    assert accepts(listen(listening, tmp_path / "up.sock"))
    assert not accepts(stale(tmp_path / "down.sock"))
    assert not accepts(str(tmp_path / "none.sock"))
