from __future__ import annotations

import pytest

from slicebox.core.policy import admit
from slicebox.model.config import Config, parse_config
from slicebox.model.errors import AdmissionRefused, SliceboxError
from slicebox.model.spec import Mount, MountKind, SandboxSpec, parse_spec

MiB = 1024 * 1024
CONFIG = parse_config(
    'bind_roots = ["/srv/ws"]\nallowed_networks = ["none", "bridge"]\n'
    '[user]\nmemory = "1GB"\ncpus = 2.0\n'
    '[projects."alice/tight"]\nmemory = "400MB"\npids = 40\n'
)


def base(**fields: object) -> SandboxSpec:
    return SandboxSpec.model_validate({"user": "alice", "project": "demo", **fields})


def test_defaults_are_secure_and_resolved() -> None:
    admitted = admit(base(), CONFIG, host_memory=4096 * MiB)
    assert admitted.image == "alpine:3.19"
    assert (admitted.limits.memory_bytes, admitted.limits.cpus, admitted.limits.pids) == (
        256 * MiB,
        0.5,
        100,
    )
    assert admitted.placement.names.project == "slicebox-alice-demo.slice"
    assert admitted.placement.user.memory_bytes == 1024 * MiB


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"privileged": True}, "policy_privileged"),
        ({"network": "host"}, "policy_host_namespace"),
        ({"network": "container:abc"}, "policy_network"),
        ({"pid_mode": "host"}, "policy_host_namespace"),
        ({"ipc_mode": "host"}, "policy_host_namespace"),
        ({"cap_add": ["CAP_SYS_ADMIN"]}, "policy_capability"),
        ({"cap_add": ["NET_RAW", "CHOWN"]}, "policy_capability"),
        ({"mounts": [Mount(source="/etc", target="/x")]}, "policy_mount"),
        ({"mounts": [Mount(source="/srv/ws/../../etc", target="/x")]}, "mount_escape"),
        ({"mounts": [Mount(source="/srv/wsx", target="/x")]}, "policy_mount"),
        ({"mounts": [Mount(source="relative", target="/x")]}, "policy_mount"),
        ({"mounts": [Mount(kind=MountKind.VOLUME, source="/abs", target="/x")]}, "policy_mount"),
        ({"memory": 0}, "invalid_limit"),
        ({"memory": "lots"}, "invalid_limit"),
        ({"cpus": "lots"}, "invalid_limit"),
        ({"cpus": 0}, "invalid_limit"),
        ({"pids": -1}, "invalid_limit"),
        ({"memory": "2GB"}, "admission_refused"),  # user ceiling 1GB
        ({"cpus": 3}, "admission_refused"),
        ({"project": "tight", "memory": "500MB"}, "admission_refused"),
        ({"project": "tight", "pids": 41}, "admission_refused"),
        ({"user": "../root"}, "invalid_name"),
        ({"ttl_seconds": 86401}, "ttl_too_long"),
        ({"ttl_seconds": 10**40}, "ttl_too_long"),
    ],
)
def test_refusals_have_stable_codes(fields: dict[str, object], code: str) -> None:
    with pytest.raises(SliceboxError) as caught:
        admit(base(**fields), CONFIG, host_memory=4096 * MiB)
    assert caught.value.code == code
    assert len(caught.value.message) > 20


def test_allowed_requests_pass() -> None:
    admitted = admit(
        base(
            project="tight",
            memory="400MB",
            pids=40,
            cap_add=["chown"],
            network="bridge",
            mounts=[
                Mount(source="/srv/ws/alice", target="/workspace"),
                Mount(kind=MountKind.VOLUME, source="cache-1", target="/cache"),
            ],
        ),
        CONFIG,
        host_memory=4096 * MiB,
    )
    assert admitted.limits.memory_bytes == 400 * MiB


def test_the_maximum_ttl_is_allowed_and_the_setting_moves_it() -> None:
    assert admit(base(ttl_seconds=86400), CONFIG, 4096 * MiB).spec.ttl_seconds == 86400
    short = parse_config("max_ttl_seconds = 600\ndefault_ttl_seconds = 60")
    with pytest.raises(SliceboxError, match="maximum of 600 seconds;") as caught:
        admit(base(ttl_seconds=601), short, 4096 * MiB)
    assert (caught.value.code, caught.value.field) == ("ttl_too_long", "ttl_seconds")


def test_no_bind_roots_means_no_bind_mounts() -> None:
    with pytest.raises(SliceboxError, match="bind_roots"):
        admit(base(mounts=[Mount(source="/srv/ws", target="/w")]), Config(), 4096 * MiB)


def test_spec_is_strict_and_names_fields() -> None:
    with pytest.raises(SliceboxError, match="surprise") as caught:
        parse_spec({"user": "a", "project": "b", "surprise": 1})
    assert (caught.value.code, caught.value.field) == ("invalid_field", "surprise")
    with pytest.raises(SliceboxError, match="ttl_seconds") as caught:
        parse_spec({"user": "a", "project": "b", "ttl_seconds": 0})
    assert caught.value.code == "invalid_ttl"
    with pytest.raises(SliceboxError, match="task_id"):
        parse_spec({"user": "a", "project": "b", "task_id": "bad id/"})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"memory": 3221230000},
            "memory 3.0 GiB exceeds the project ceiling of 2 GiB; ask for at most 2 GiB or "
            "raise the project ceiling in the config",
        ),
        (
            {"project": "tight", "memory": "500MB"},
            "memory 500 MiB exceeds the project ceiling of 400 MiB; ask for at most 400 MiB or "
            "raise the project ceiling in the config",
        ),
        ({"cpus": 2.5}, "cpus 2.5 exceeds the user ceiling of 2; ask for at most 2 or raise"),
        ({"project": "tight", "pids": 41}, "pids 41 exceeds the project ceiling of 40; ask"),
    ],
)
def test_admission_speaks_in_human_sizes(fields: dict[str, object], message: str) -> None:
    with pytest.raises(AdmissionRefused) as caught:
        admit(base(**fields), CONFIG, 4096 * MiB)
    assert caught.value.message.startswith(message)
    assert caught.value.field == next(iter(f for f in fields if f != "project"))


def test_admission_shows_exact_bytes_when_rounding_would_hide_the_difference() -> None:
    with pytest.raises(
        AdmissionRefused, match=r"memory 1073741825 bytes exceeds .* of 1073741824 bytes"
    ):
        admit(base(memory=2**30 + 1), CONFIG, 4096 * MiB)
