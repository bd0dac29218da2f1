from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from slicebox.model.config import (
    DEFAULT_EXEC_OUTPUT_BUDGET,
    Config,
    load_config,
    parse_config,
    read_host_memory,
)
from slicebox.model.errors import ConfigError, InvalidLimit
from slicebox.model.pulls import credential_for, registry_of

MiB = 1024 * 1024


def test_missing_file_means_defaults(tmp_path: Path) -> None:
    config = load_config(tmp_path / "absent.toml")
    assert config == Config()
    assert config.default_image == "alpine:3.19"
    assert config.sandbox.limits().memory_bytes == 256 * MiB
    assert config.managed_ceiling(host_memory=4000 * MiB).memory_bytes == 3000 * MiB


def test_overrides_replace_only_the_fields_they_set(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        'bind_roots = ["/srv/ws"]\n'
        '[user]\nmemory = "1GB"\npids = 500\n'
        '[users.alice]\nmemory = "3GB"\n'
        '[projects."alice/demo"]\ncpus = 0.5\n'
    )
    config = load_config(path)
    assert config.bind_roots == (PurePosixPath("/srv/ws"),)
    alice = config.user_ceiling("alice", 1)
    assert (alice.memory_bytes, alice.pids) == (3072 * MiB, 500)
    assert config.user_ceiling("bob", 1).memory_bytes == 1024 * MiB
    demo = config.project_ceiling("alice", "demo", 1)
    assert (demo.cpus, demo.memory_bytes, demo.pids) == (0.5, 2048 * MiB, 1024)
    assert config.project_ceiling("alice", "other", 1).cpus is None


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[project]\nmemory = "lots"', "project.memory"),
        ("[user]\npids = 0", "user.pids"),
        ("[users.x]\ncpus = -1", "users.x.cpus"),
        ("surprise = 1", "surprise"),
        ("default_ttl_seconds = 0", "default_ttl_seconds"),
        ("max_ttl_seconds = 0", "max_ttl_seconds"),
        ("max_ttl_seconds = 1000000000000", "max_ttl_seconds"),  # past the one-year ceiling
        ("max_ttl_seconds = 600", "default_ttl_seconds"),  # the default 3600 is over it
    ],
)
def test_bad_settings_are_named(text: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field) as caught:
        parse_config(text)
    assert caught.value.field == field


def test_the_default_ttl_may_not_exceed_the_maximum() -> None:
    assert (Config().default_ttl_seconds, Config().max_ttl_seconds) == (3600, 86400)
    with pytest.raises(ConfigError) as caught:
        parse_config("default_ttl_seconds = 90000")
    assert caught.value.message == (
        "<config>: default_ttl_seconds: 90000 is more than max_ttl_seconds (86400); lower "
        "default_ttl_seconds or raise max_ttl_seconds; fix these settings"
    )
    assert parse_config("max_ttl_seconds = 100000\ndefault_ttl_seconds = 90000")


def test_bad_toml() -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config("[unclosed")


def test_host_memory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        4015112 kB\nMemFree: 1 kB\n")
    assert read_host_memory(meminfo) == 4015112 * 1024


def test_the_budget_defaults_to_half_the_agents_memory_limit() -> None:
    config = parse_config("")
    assert config.exec_output_budget_bytes(1024 * MiB) == 512 * MiB
    assert config.exec_output_budget_bytes(None) == DEFAULT_EXEC_OUTPUT_BUDGET == 256 * MiB
    assert parse_config('exec_output_budget = "64MB"').exec_output_budget_bytes(None) == 64 * MiB
    assert parse_config("exec_output_budget = 1000").exec_output_budget_bytes(MiB) == 1000


@pytest.mark.parametrize("value", ['"lots"', "0", '"50%"'])
def test_a_bad_budget_is_refused_at_load_naming_it(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"exec_output_budget = {value}")
    assert caught.value.field == "exec_output_budget"


@pytest.mark.parametrize(
    ("image", "user", "granted"),
    [
        ("registry.example.com:5000/team/app:1", "alice", True),
        ("registry.example.com:5000/team/app:1", "bob", False),  # not granted to bob
        ("other.example.com/team/app", "alice", False),  # another registry
        ("team/app", "alice", False),  # Docker Hub's
        ("registry.example.com/team/app", "alice", False),  # no port: another registry
    ],
)
def test_a_pull_sends_only_what_the_operator_granted_that_user_for_that_registry(
    image: str, user: str, granted: bool
) -> None:
    config = Config.model_validate(
        {
            "registry_credentials": [
                {
                    "registry": "registry.example.com:5000",
                    "users": ["alice"],
                    "auth_file": "/etc/slicebox/registries/team/config.json",
                }
            ]
        }
    )
    found = credential_for(config.registry_credentials, user, image)
    assert (found is not None) is granted


@pytest.mark.parametrize(
    ("image", "registry"),
    [
        ("alpine", "docker.io"),
        ("library/alpine:3.19", "docker.io"),
        ("localhost/a", "localhost"),
        ("localhost:5000/a/b@sha256:" + "f" * 64, "localhost:5000"),
        ("ghcr.example/a/b", "ghcr.example"),
    ],
)
def test_an_image_s_registry_is_read_as_the_docker_client_reads_it(
    image: str, registry: str
) -> None:
    assert registry_of(image) == registry


def test_the_socket_s_caps_are_the_operator_s_and_checked() -> None:
    """[socket]: the agent serves its socket with these caps (server.api.socket_limits);
    a per-uid cap over its total, or a total past the descriptors' room, is refused."""
    from slicebox.server.api import SOCKET_LIMITS, socket_limits

    assert socket_limits(parse_config("").socket) == SOCKET_LIMITS, "the defaults are the old"
    text = '[socket]\nconnections_per_uid = 4\nin_flight = 40\nbody_bytes_per_uid = "4MB"\n'
    limits = socket_limits(parse_config(text).socket)
    assert (limits.connections_per_uid, limits.in_flight, limits.body_bytes_per_uid) == (
        4,
        40,
        4 * 1024 * 1024,
    )
    assert limits.always == SOCKET_LIMITS.always, "health is answered over the caps still"
    for bad, said in (
        ("connections_per_uid = 2000", "connections_per_uid is over connections"),
        ("connections = 20000", "less than or equal to 8192"),
        ('body_bytes_per_uid = "1MB"', "refuses an honest create"),
    ):
        with pytest.raises(ConfigError, match=said):
            parse_config(f"[socket]\n{bad}\n")
    with pytest.raises(InvalidLimit, match="not a size"):
        parse_config('[socket]\nbody_bytes = "lots"\n')
