"""The Docker backend's pure parts: the settings table, the error mapping, DOCKER_HOST.

The adapter's calls are checked against a daemon stand-in on a real unix socket that answers
the way the Engine API does (tests/fakes/engine.py); docker-py's own exceptions, which only an
image pull raises now, are mapped by ``map_error``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import requests

from slicebox.backends.base import Removal, SandboxInfo, SandboxRequest, SandboxState
from slicebox.backends.docker import HEAVY_CALLS, REMOVALS, DockerBackend
from slicebox.backends.dockerbody import (
    create_body,
    host_config,
    host_settings,
    run_flags,
    workspace_bytes,
)
from slicebox.backends.dockerendpoint import DockerEndpoint, endpoint_from_env, parse_docker_host
from slicebox.backends.dockererrors import map_error
from slicebox.backends.dockersnap import DockerSnapshots
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
from tests.fakes.engine import FakeEngine

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


def test_a_fork_runs_with_its_image_s_workspace_and_no_tmpfs_over_it() -> None:
    request = REQUEST.model_copy(update={"workspace_in_image": True})
    assert host_config(request)["Tmpfs"] == {}
    assert host_config(request)["Mounts"] == []
    assert not any("tmpfs" in flag for flag in run_flags(request))


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


def test_tcp_the_agent_s_unit_does_not_allow_says_how_to_allow_it() -> None:
    tcp = parse_docker_host("tcp://127.0.0.1:2400")
    refused = OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
    said = tcp.unreachable(refused).message
    assert "RestrictAddressFamilies=AF_INET AF_INET6" in said
    assert "tcp://127.0.0.1:2400" in said
    assert "RestrictAddressFamilies" not in tcp.unreachable(ConnectionRefusedError()).message


# --- the adapter against a daemon stand-in ------------------------------------------------


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[FakeEngine]:
    served = FakeEngine().serve(tmp_path / "docker.sock")
    yield served
    served.close()


def backend(engine: FakeEngine) -> DockerBackend:
    assert engine._server is not None
    return DockerBackend(DockerEndpoint(scheme="unix", address=engine._server.server_address))


def routes(engine: FakeEngine) -> list[str]:
    return [f"{method} {path}" for method, path, _, _ in engine.asked]


def test_listing_by_labels_is_one_call_that_carries_labels_and_state(engine: FakeEngine) -> None:
    docker_backend = backend(engine)
    made = docker_backend.create(REQUEST)
    docker_backend.create(REQUEST.model_copy(update={"name": "sbx-2", "labels": {"other": "1"}}))
    engine.asked.clear()
    found = docker_backend.find({"slicebox.managed": "true"})
    assert [(i.id, i.name, i.labels, i.state) for i in found] == [
        (made.id, "sbx-1", {"slicebox.managed": "true"}, SandboxState.RUNNING)
    ]
    assert routes(engine) == ["GET /v1.45/containers/json"]
    assert engine.asked[0][2]["filters"] == ['{"label": ["slicebox.managed=true"]}']


def test_a_snapshot_image_is_never_removed_by_force_and_one_a_container_runs_is_kept(
    engine: FakeEngine,
) -> None:
    """A forced removal untags an image a fork runs and leaves its bytes no one's (issue 59):
    the engine's refusal is the answer ``kept``, on which the core retires it instead."""
    assert engine._server is not None
    images = DockerSnapshots(DockerEndpoint(scheme="unix", address=engine._server.server_address))
    engine.images.add("slicebox-snapshot:abc")
    fork = backend(engine).create(REQUEST.model_copy(update={"image": "slicebox-snapshot:abc"}))
    assert images.remove_image("slicebox-snapshot:abc") is Removal.KEPT
    assert "force" not in engine.asked[-1][2]
    images.tag_image("slicebox-snapshot:abc", "slicebox-snapshot:abc-0123")
    assert engine.asked[-1][2] == {"repo": ["slicebox-snapshot"], "tag": ["abc-0123"]}
    backend(engine).remove(fork.id)
    assert images.remove_image("slicebox-snapshot:abc") is Removal.REMOVED
    assert images.remove_image("slicebox-snapshot:abc") is Removal.GONE
    assert "slicebox-snapshot:abc-0123" in engine.images


def test_remove_is_idempotent_when_gone_or_being_removed(engine: FakeEngine) -> None:
    docker_backend = backend(engine)
    made = docker_backend.create(REQUEST)
    assert docker_backend.remove(made.id) is True
    assert engine.asked[-1][2] == {"force": ["1"], "v": ["1"]}
    assert docker_backend.remove(made.id) is False  # 404
    engine.removing.add("c1")
    assert docker_backend.remove("c1") is False  # 409: another removal holds it


def test_a_failed_start_removes_the_container_and_explains(engine: FakeEngine) -> None:
    engine.start_error = (400, "unable to find user nosuchuser: no matching entries")
    with pytest.raises(InvalidRequest, match="nosuchuser") as failed:
        backend(engine).create(REQUEST)
    assert failed.value.code == "container_start_failed"
    assert routes(engine)[-1].startswith("DELETE /v1.45/containers/")
    assert engine.containers == {}


OVERRUN = "failed to create shim task: context deadline exceeded: unknown"
REMOVE_OVERRUN = "failed to delete container from containerd: context deadline exceeded"


def patient(engine: FakeEngine) -> tuple[DockerBackend, list[float]]:
    """A backend whose pauses between tries are noted, not slept."""
    docker_backend, pauses = backend(engine), list[float]()
    docker_backend._sleep = pauses.append
    return docker_backend, pauses


def test_a_removal_containerd_ran_out_of_time_for_is_tried_again(engine: FakeEngine) -> None:
    """containerd's own deadline on a busy host (a CI guest of one emulated CPU under five
    users' load) failed a destroy as host_error: the removal goes through on a later try."""
    docker_backend, pauses = patient(engine)
    made = docker_backend.create(REQUEST)
    engine.remove_failures = [(500, REMOVE_OVERRUN)] * 2
    assert docker_backend.remove(made.id) is True
    assert engine.containers == {}
    assert pauses == [1.0, 3.0]


def test_a_removal_that_overruns_every_time_fails_and_other_failures_at_once(
    engine: FakeEngine,
) -> None:
    docker_backend, pauses = patient(engine)
    made = docker_backend.create(REQUEST)
    engine.remove_failures = [(500, REMOVE_OVERRUN)] * 4
    with pytest.raises(HostError, match="context deadline exceeded"):
        docker_backend.remove(made.id)
    assert len(pauses) == 3
    engine.remove_failures = [(500, "driver failed to remove root filesystem")]
    with pytest.raises(HostError, match="root filesystem"):
        docker_backend.remove(made.id)
    assert len(pauses) == 3, "no second try for a failure that is not an overrun"


def test_a_start_containerd_ran_out_of_time_for_is_made_once_more(engine: FakeEngine) -> None:
    docker_backend, pauses = patient(engine)
    engine.start_failures = [(500, OVERRUN)]
    info = docker_backend.create(REQUEST)
    assert list(engine.containers) == [info.id]
    assert engine.containers[info.id]["Status"] == "running"
    assert pauses == [1.0]
    creates = [r for r in routes(engine) if r.endswith("/containers/create")]
    assert len(creates) == 2, "the first container was removed and made again"


def test_a_start_that_overruns_twice_is_the_host_s_error_not_the_caller_s(
    engine: FakeEngine,
) -> None:
    docker_backend, _ = patient(engine)
    engine.start_failures = [(500, OVERRUN)] * 2
    with pytest.raises(HostError, match="overloaded; retry the create later") as failed:
        docker_backend.create(REQUEST)
    assert failed.value.code == "host_error"
    assert engine.containers == {}


def test_create_sends_the_host_config_and_answers_running(engine: FakeEngine) -> None:
    info = backend(engine).create(REQUEST)
    assert (info.name, info.state) == ("sbx-1", SandboxState.RUNNING)
    sent = engine.containers[info.id]["Body"]
    assert sent["HostConfig"] == json.loads(json.dumps(host_config(REQUEST)))
    assert sent["Cmd"] == ["sleep", "infinity"]
    assert sent["Labels"] == REQUEST.labels
    assert engine.asked[0][:2] == ("GET", "/version")  # the version is asked once, first
    assert [route for route in routes(engine) if route == "GET /version"] == ["GET /version"]


def test_a_create_with_an_image_docker_lacks_is_image_unavailable_and_makes_nothing(
    engine: FakeEngine,
) -> None:
    """The core does not check an image it has seen before its create: it relies on this."""
    with pytest.raises(ImageUnavailable, match="No such image"):
        backend(engine).create(REQUEST.model_copy(update={"image": "nothere:1"}))
    assert not [route for route in routes(engine) if route.startswith("DELETE")]


def test_a_taken_name_is_its_own_conflict(engine: FakeEngine) -> None:
    backend(engine).create(REQUEST)
    with pytest.raises(HostError) as taken:
        backend(engine).create(REQUEST)
    assert taken.value.code == "sandbox_name_conflict"


def test_inspect_of_a_missing_container_is_none(engine: FakeEngine) -> None:
    docker_backend = backend(engine)

    async def inspected() -> SandboxInfo | None:
        try:
            return await docker_backend.inspect("gone")
        finally:
            await docker_backend.aclose()

    assert asyncio.run(inspected()) is None
    assert backend(engine).volume("gone") is None


def test_volumes_are_made_listed_and_kept_while_mounted(engine: FakeEngine) -> None:
    docker_backend = backend(engine)
    made = docker_backend.create_volume("ws-1", {"slicebox.volume": "true"})
    assert (made.name, made.labels) == ("ws-1", {"slicebox.volume": "true"})
    assert [v.name for v in docker_backend.volumes({"slicebox.volume": "true"})] == ["ws-1"]
    mount = Mount(kind=MountKind.VOLUME, source="ws-1", target="/workspace")
    container = docker_backend.create(REQUEST.model_copy(update={"mounts": (mount,)}))
    assert docker_backend.remove_volume("ws-1") is False  # in use: it stays
    docker_backend.remove(container.id)
    assert docker_backend.remove_volume("ws-1") is True
    assert docker_backend.remove_volume("ws-1") is False


def test_a_thread_keeps_one_connection_and_survives_the_daemon_closing_it(
    engine: FakeEngine,
) -> None:
    docker_backend = backend(engine)
    for _ in range(20):
        assert docker_backend.volume("gone") is None
    assert engine.connections == 1
    engine.drop_idle_connections()  # as a restarted daemon: the kept connection is dead
    time.sleep(0.05)
    assert docker_backend.volume("gone") is None  # no error: a new connection
    assert engine.connections == 2
    assert docker_backend.availability().available


def test_an_unreachable_daemon_is_unavailable_not_an_exception() -> None:
    missing = DockerBackend(DockerEndpoint(scheme="unix", address="/nonexistent/docker.sock"))
    found = missing.availability()
    assert not found.available
    assert found.kind == "docker"
    assert "not reachable" in found.detail
    with pytest.raises(Unavailable, match=r"is docker\.service running"):
        missing.find({})


def test_many_creates_and_removals_at_once_reach_docker_a_few_at_a_time(
    engine: FakeEngine,
) -> None:
    engine.slow = 0.05
    docker_backend = backend(engine)
    with ThreadPoolExecutor(16) as pool:
        names = [f"sbx-{n}" for n in range(16)]
        made = list(
            pool.map(lambda name: docker_backend.create(REQUEST.model_copy(update={"name": name})),
                     names)
        )  # fmt: skip
        assert engine.peak == HEAVY_CALLS
        engine.peak = 0
        assert all(pool.map(lambda info: docker_backend.remove(info.id), made))
    assert engine.peak == REMOVALS
    assert engine.containers == {}


@pytest.mark.parametrize(
    "request_",
    [
        REQUEST,
        REQUEST.model_copy(
            update={"env": {"A": "1", "B": "x=y"}, "user": "65534", "workdir": "/w"}
        ),
    ],
)
def test_the_create_body_is_docker_py_s_for_the_same_call(request_: SandboxRequest) -> None:
    import docker

    sent: list[dict[str, Any]] = []
    api = docker.APIClient(base_url="unix:///nonexistent", version="1.45")
    api._post_json = lambda url, data, params=None: sent.append(data)
    api._result = lambda response, as_json=False: {"Id": "c1"}
    api.create_container(
        request_.image,
        command=list(request_.command),
        name=request_.name,
        labels=request_.labels,
        environment=request_.env,
        user=request_.user,
        working_dir=request_.workdir,
        detach=True,
        host_config=host_config(request_),
    )
    theirs = {key: value for key, value in sent[0].items() if value is not None}
    assert json.loads(json.dumps(create_body(request_))) == json.loads(json.dumps(theirs))


def test_the_engine_says_whether_it_is_podman_and_so_how_it_names_scopes(
    engine: FakeEngine,
) -> None:
    docker_engine = backend(engine)
    said = docker_engine.availability()
    assert said.available
    assert said.detail.startswith("Docker 27.5.1 (API 1.45) at ")
    assert docker_engine.scope_prefix == "docker"
    engine.version = {
        "ApiVersion": "1.41",
        "Version": "5.4.2",
        "Components": [{"Name": "Podman Engine", "Version": "5.4.2"}, {"Name": "Conmon"}],
    }
    podman = backend(engine)
    assert podman.availability().detail.startswith("Podman 5.4.2 (API 1.41) at ")
    assert podman.scope_prefix == "libpod"


def test_a_bridge_sandbox_joins_slicebox_s_own_network_where_none_reaches_another(
    engine: FakeEngine,
) -> None:
    """Not docker0 (inter-container traffic on: alice's sandbox reached bob's)."""
    docker_backend = backend(engine)
    bridged = REQUEST.model_copy(update={"network": "bridge"})
    assert host_config(bridged)["NetworkMode"] == "slicebox-bridge"
    docker_backend.create(bridged)
    docker_backend.create(bridged.model_copy(update={"name": "sbx-2"}))
    made = engine.networks["slicebox-bridge"]
    assert made["Options"]["com.docker.network.bridge.enable_icc"] == "false"
    assert made["Labels"] == {"slicebox.managed": "true"}
    assert routes(engine).count("POST /v1.45/networks/create") == 1, "made once, then found"
    sent = [c["Body"]["HostConfig"]["NetworkMode"] for c in engine.containers.values()]
    assert sent == ["slicebox-bridge", "slicebox-bridge"]
    assert IPv4Network("172.17.0.0/16") in docker_backend.bridge_subnets()
    assert host_config(REQUEST)["NetworkMode"] == "none"
