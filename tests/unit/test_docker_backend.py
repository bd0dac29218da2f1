"""The Docker backend's pure parts: the settings table, the error mapping, DOCKER_HOST.

The adapter's calls are checked against a stub of docker-py's low-level client that answers
the way the Engine API does (the stub raises docker-py's own exceptions).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import docker.errors
import pytest
import requests

from slicebox.backends.base import SandboxRequest, SandboxState
from slicebox.backends.docker import (
    HEAVY_CALLS,
    DockerBackend,
    host_config,
    host_settings,
    map_error,
    run_flags,
    workspace_bytes,
)
from slicebox.backends.dockerstream import DockerEndpoint, endpoint_from_env, parse_docker_host
from slicebox.model.errors import (
    HostError,
    ImageUnavailable,
    InvalidRequest,
    SandboxNotFound,
    SandboxNotRunning,
    SliceboxError,
    Unavailable,
)
from slicebox.model.limits import Limits
from slicebox.model.paths import DOCKER_SOCKET
from slicebox.model.spec import Mount, MountKind

MiB = 1024 * 1024
SLICE = "slicebox-al\\x2dice-p.slice"
REQUEST = SandboxRequest(
    name="sbx-1",
    image="alpine:3.19",
    command=("sleep", "infinity"),
    labels={"slicebox.managed": "true"},
    slice=SLICE,
    limits=Limits(cpus=0.5, memory_bytes=256 * MiB, pids=100),
)


def test_the_security_defaults_are_in_the_host_config() -> None:
    config = host_config(REQUEST)
    assert config["CapDrop"] == ["ALL"]
    assert config["CapAdd"] == []
    assert config["SecurityOpt"] == ["no-new-privileges:true"]
    assert config["Privileged"] is False
    assert config["NetworkMode"] == "none"
    assert config["Init"] is True
    assert (config["PidsLimit"], config["Memory"], config["MemorySwap"]) == (
        100,
        256 * MiB,
        256 * MiB,
    )
    assert config["NanoCpus"] == 500_000_000
    assert config["CgroupParent"] == SLICE


def test_cli_flags_say_the_same_as_the_host_config() -> None:
    flags = run_flags(REQUEST.model_copy(update={"env": {"A": "1"}, "user": "65534"}))
    assert flags == [
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges:true",
        "--network=none",
        "--init",
        "--pids-limit=100",
        f"--memory={256 * MiB}",
        f"--memory-swap={256 * MiB}",
        "--cpus=0.5",
        f"--cgroup-parent={SLICE}",
        f"--tmpfs=/workspace:rw,exec,nosuid,nodev,size={128 * MiB},mode=1777",
        "--env=A=1",
        "--user=65534",
    ]


def test_every_host_setting_has_a_flag() -> None:
    for setting in host_settings(REQUEST):
        assert setting.flag.startswith("--"), setting


def test_without_a_workspace_mount_a_bounded_tmpfs_serves_workspace() -> None:
    config = host_config(REQUEST)
    assert config["Mounts"] == []
    assert config["Tmpfs"] == {"/workspace": f"rw,exec,nosuid,nodev,size={128 * MiB},mode=1777"}
    assert workspace_bytes(REQUEST) < REQUEST.limits.memory_bytes


def test_a_workspace_mount_replaces_the_tmpfs_and_caps_are_added() -> None:
    mounts = (
        Mount(source="/srv/ws/alice", target="/workspace/", read_only=True),
        Mount(kind=MountKind.VOLUME, source="cache", target="/cache"),
    )
    request = REQUEST.model_copy(update={"mounts": mounts, "cap_add": ("NET_BIND_SERVICE",)})
    config = host_config(request)
    assert config["Mounts"] == [
        {"Type": "bind", "Source": "/srv/ws/alice", "Target": "/workspace/", "ReadOnly": True},
        {"Type": "volume", "Source": "cache", "Target": "/cache", "ReadOnly": False},
    ]
    assert config["Tmpfs"] == {}
    assert config["CapAdd"] == ["NET_BIND_SERVICE"]
    flags = run_flags(request)
    assert "--mount=type=bind,source=/srv/ws/alice,target=/workspace/,readonly" in flags
    assert "--cap-add=NET_BIND_SERVICE" in flags
    assert not any("tmpfs" in flag for flag in flags)


# --- errors ---------------------------------------------------------------------------------


def api_error(
    status: int, explanation: str, kind: type[docker.errors.APIError] = docker.errors.APIError
) -> docker.errors.APIError:
    response = requests.Response()
    response.status_code = status
    return kind("Docker says no", response=response, explanation=explanation)


MAPPED: list[tuple[Exception, type[SliceboxError], str]] = [
    (api_error(404, "No such image: x", docker.errors.ImageNotFound), ImageUnavailable, ""),
    (api_error(404, "No such container: c1", docker.errors.NotFound), SandboxNotFound, ""),
    (api_error(409, 'The container name "/sbx-1" is already in use'), HostError, "name_conflict"),
    (api_error(409, "removal of container c1 is already in progress"), HostError, "in_progress"),
    (api_error(409, "Container c1 is not running"), SandboxNotRunning, ""),
    (api_error(400, "invalid mount config"), InvalidRequest, "container_start_failed"),
    (api_error(500, "runc exploded"), HostError, "host_error"),
    (requests.exceptions.ConnectionError("refused"), Unavailable, "unavailable"),
    (docker.errors.DockerException("no daemon"), Unavailable, "unavailable"),
]


@pytest.mark.parametrize(("exc", "kind", "code"), MAPPED)
def test_docker_errors_map_into_the_slicebox_tree(
    exc: Exception, kind: type[SliceboxError], code: str
) -> None:
    mapped = map_error(exc, "sbx-1")
    assert isinstance(mapped, kind)
    assert code in mapped.code


def test_foreign_exceptions_are_not_mapped() -> None:
    assert map_error(TypeError("a bug"), "x") is None


# --- DOCKER_HOST ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "endpoint"),
    [
        (None, DockerEndpoint(scheme="unix", address=DOCKER_SOCKET)),
        ("", DockerEndpoint(scheme="unix", address=DOCKER_SOCKET)),
        ("unix:///run/d.sock", DockerEndpoint(scheme="unix", address="/run/d.sock")),
        ("tcp://10.0.0.1:2375", DockerEndpoint(scheme="tcp", address="10.0.0.1", port=2375)),
        ("tcp://docker.lan", DockerEndpoint(scheme="tcp", address="docker.lan", port=2375)),
        ("http://[::1]:2400", DockerEndpoint(scheme="tcp", address="::1", port=2400)),
    ],
)
def test_docker_host_values(value: str | None, endpoint: DockerEndpoint) -> None:
    assert parse_docker_host(value) == endpoint


def test_endpoints_give_docker_py_its_url() -> None:
    assert parse_docker_host("unix:///run/d.sock").base_url == "unix:///run/d.sock"
    assert parse_docker_host("tcp://[::1]:2400").base_url == "tcp://[::1]:2400"


@pytest.mark.parametrize(
    ("env", "code"),
    [
        ({"DOCKER_HOST": "https://h:2376"}, "docker_tls_unsupported"),
        ({"DOCKER_HOST": "tcp://h:2376", "DOCKER_TLS_VERIFY": "1"}, "docker_tls_unsupported"),
        ({"DOCKER_HOST": "ssh://me@h"}, "docker_host_unsupported"),
        ({"DOCKER_HOST": "tcp://h:port"}, "docker_host_unsupported"),
        ({"DOCKER_HOST": "unix://relative.sock"}, "docker_host_unsupported"),
    ],
)
def test_unsupported_docker_hosts_are_refused_with_their_code(
    env: dict[str, str], code: str
) -> None:
    with pytest.raises(Unavailable) as refused:
        endpoint_from_env(env)
    assert refused.value.code == code
    assert "DOCKER_HOST" in refused.value.message


# --- the adapter over a stub client ---------------------------------------------------------


class StubApi:
    """docker-py's APIClient as far as the adapter uses it, answering as the engine does."""

    api_version = "1.45"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.containers_listed: list[dict[str, Any]] = []
        self.remove_error: Exception | None = None
        self.start_error: Exception | None = None
        self.create_error: Exception | None = None
        self.created: dict[str, Any] = {}

    def containers(self, all: bool, filters: Mapping[str, list[str]]) -> list[dict[str, Any]]:
        self.calls.append(f"list {filters['label']}")
        return self.containers_listed

    def inspect_container(self, container: str) -> dict[str, Any]:
        self.calls.append(f"inspect {container}")
        raise api_error(404, f"No such container: {container}", docker.errors.NotFound)

    def create_container(self, image: str, **kwargs: Any) -> dict[str, str]:
        if self.create_error is not None:
            raise self.create_error
        self.created = {"image": image, **kwargs}
        return {"Id": "c1"}

    def start(self, container: str) -> None:
        if self.start_error is not None:
            raise self.start_error

    def remove_container(self, container: str, force: bool, v: bool) -> None:
        self.calls.append(f"remove {container}")
        if self.remove_error is not None:
            raise self.remove_error


def backend(api: StubApi) -> DockerBackend:
    return DockerBackend(DockerEndpoint(scheme="unix", address="/nonexistent"), client=api)


def test_listing_by_labels_is_one_call_that_carries_labels_and_state() -> None:
    api = StubApi()
    api.containers_listed = [
        {"Id": "c1", "Names": ["/sbx-1"], "Labels": {"a": "b"}, "State": "running"},
        {"Id": "c2", "Names": ["/sbx-2"], "Labels": None, "State": "weird"},
    ]
    found = backend(api).find({"slicebox.managed": "true"})
    assert [(i.id, i.name, i.labels, i.state) for i in found] == [
        ("c1", "sbx-1", {"a": "b"}, SandboxState.RUNNING),
        ("c2", "sbx-2", {}, SandboxState.UNKNOWN),
    ]
    assert api.calls == ["list ['slicebox.managed=true']"]


def test_remove_is_idempotent_when_gone_or_being_removed() -> None:
    api = StubApi()
    assert backend(api).remove("c1") is True
    api.remove_error = api_error(404, "No such container: c1", docker.errors.NotFound)
    assert backend(api).remove("c1") is False
    api.remove_error = api_error(409, "removal of container c1 is already in progress")
    assert backend(api).remove("c1") is False
    api.remove_error = api_error(500, "driver failed")
    with pytest.raises(HostError):
        backend(api).remove("c1")


def test_a_failed_start_removes_the_container_and_explains() -> None:
    api = StubApi()
    api.start_error = api_error(500, "unable to find user nosuchuser")
    with pytest.raises(InvalidRequest, match="nosuchuser") as failed:
        backend(api).create(REQUEST)
    assert failed.value.code == "container_start_failed"
    assert api.calls == ["remove c1"]


def test_create_sends_the_host_config_and_answers_running() -> None:
    api = StubApi()
    info = backend(api).create(REQUEST)
    assert (info.id, info.name, info.state) == ("c1", "sbx-1", SandboxState.RUNNING)
    assert api.created["host_config"] == host_config(REQUEST)
    assert api.created["command"] == ["sleep", "infinity"]
    assert api.created["labels"] == REQUEST.labels


def test_a_create_with_an_image_docker_lacks_is_image_unavailable_and_makes_nothing() -> None:
    """The core does not check an image it has seen before its create: it relies on this."""
    response = requests.Response()
    response.status_code = 404
    response._content = b'{"message": "No such image: alpine:3.19"}'
    with pytest.raises(docker.errors.APIError) as raised:  # as docker-py makes it of the answer
        docker.errors.create_api_error_from_http_exception(
            requests.exceptions.HTTPError(response=response)
        )
    api = StubApi()
    api.create_error = raised.value
    with pytest.raises(ImageUnavailable):
        backend(api).create(REQUEST)
    assert api.calls == [], "nothing to remove"


def test_inspect_of_a_missing_container_is_none() -> None:
    assert backend(StubApi()).inspect("gone") is None


def test_an_unreachable_daemon_is_unavailable_not_an_exception() -> None:
    missing = DockerBackend(DockerEndpoint(scheme="unix", address="/nonexistent/docker.sock"))
    found = missing.availability()
    assert not found.available
    assert found.kind == "docker"
    assert "not reachable" in found.detail


class SlowStarts(StubApi):
    """Starts and removals that take a while, counting how many run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.running = self.peak = 0
        self.lock = threading.Lock()

    def _busy(self) -> None:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(0.05)
        with self.lock:
            self.running -= 1

    def start(self, container: str) -> None:
        self._busy()

    def remove_container(self, container: str, force: bool, v: bool) -> None:
        self._busy()


def test_many_creates_and_removals_at_once_reach_docker_a_few_at_a_time() -> None:
    api = SlowStarts()
    docker_backend = backend(api)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: docker_backend.create(REQUEST), range(16)))
        list(pool.map(lambda n: docker_backend.remove(f"c{n}"), range(16)))
    assert api.peak == HEAVY_CALLS
