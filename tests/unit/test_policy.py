from __future__ import annotations

import pytest

from slicebox.core.policy import admit
from slicebox.model.config import Config, parse_config
from slicebox.model.errors import SliceboxError
from slicebox.model.spec import Mount, MountKind, SandboxSpec, parse_spec

MiB = 1024 * 1024
CONFIG = parse_config(
    'bind_roots = ["/srv/ws"]\n[user]\nmemory = "1GB"\ncpus = 2.0\n'
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
        ({"mounts": [Mount(source="/srv/ws/../../etc", target="/x")]}, "policy_mount"),
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


def test_no_bind_roots_means_no_bind_mounts() -> None:
    with pytest.raises(SliceboxError, match="bind_roots"):
        admit(base(mounts=[Mount(source="/srv/ws", target="/w")]), Config(), 4096 * MiB)


def test_spec_is_strict_and_names_fields() -> None:
    with pytest.raises(SliceboxError, match="surprise") as caught:
        parse_spec({"user": "a", "project": "b", "surprise": 1})
    assert caught.value.code == "invalid_request"
    with pytest.raises(SliceboxError, match="ttl_seconds"):
        parse_spec({"user": "a", "project": "b", "ttl_seconds": 0})
    with pytest.raises(SliceboxError, match="task_id"):
        parse_spec({"user": "a", "project": "b", "task_id": "bad id/"})
