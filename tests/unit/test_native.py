"""The native backend's logic and the backend router, over fakes that answer as systemd and
Docker do (the real thing: ``tests/host/test_native.py`` in the guest)."""

from __future__ import annotations

import asyncio
import itertools
import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from slicebox.backends.base import SandboxRequest, SandboxState
from slicebox.backends.native.backend import NativeBackend
from slicebox.backends.native.envfiles import env_line
from slicebox.backends.native.names import (
    ANCHOR_PREFIX,
    glob_literal,
    is_native_exec,
    is_native_id,
    name_of,
    sandbox_slice,
)
from slicebox.backends.native.units import (
    LOCALHOST,
    MARK,
    describe,
    hardening,
    labels_of,
    slice_properties,
)
from slicebox.backends.router import Backends
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.systemd import ServiceStatus
from slicebox.model.config import parse_config
from slicebox.model.errors import InvalidRequest, SandboxNotFound, SandboxNotRunning, Unavailable
from slicebox.model.exec import ExecRequest
from slicebox.model.limits import INFINITY, Limits
from slicebox.model.names import scope_name
from slicebox.model.spec import Backend, Mount, SandboxSpec
from tests.fakes.docker import FakeDocker
from tests.fakes.native import FakeNativeSystemd
from tests.fakes.threadside import created

MiB = 1024 * 1024
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
PROJECT = "slicebox-al\\x2dice-p.slice"


def ended(code: int, status: int, result: str = "exit-code") -> ServiceStatus:
    return ServiceStatus(
        active_state="failed",
        sub_state="failed",
        result=result,
        main_pid=0,
        exited=True,
        code=code,
        status=status,
    )


def request(name: str = "sbx-000000000001", **fields: Any) -> SandboxRequest:
    base: dict[str, object] = {
        "name": name,
        "image": "",
        "command": ("sleep", "infinity"),
        "labels": {"slicebox.sandbox_id": name, "slicebox.user": "al-ice"},
        "slice": PROJECT,
        "limits": Limits(cpus=0.5, memory_bytes=128 * MiB, pids=64),
        "env": {"TOKEN": 's3"cr$t'},
        "backend": Backend.NATIVE,
    }
    return SandboxRequest.model_validate(base | fields)


@pytest.fixture
def systemd() -> FakeNativeSystemd:
    return FakeNativeSystemd()


@pytest.fixture
def native(systemd: FakeNativeSystemd, tmp_path: Path) -> NativeBackend:
    return NativeBackend(systemd, env_dir=tmp_path / "env", which=lambda name: "/bin/" + name)


# --- names, labels and properties --------------------------------------------------------------


def test_a_sandbox_slice_nests_in_its_project_slice_and_reads_back() -> None:
    unit = sandbox_slice(PROJECT, "sbx-0a1b")
    assert unit == "slicebox-al\\x2dice-p-sbx\\x2d0a1b.slice"  # one dash level below p
    assert name_of(unit) == "sbx-0a1b"
    assert is_native_id(unit)
    assert not is_native_id("0" * 64)
    assert scope_name(unit) == unit, "its cgroup is the slice's own"
    assert is_native_exec("slicebox-exec-sbx-0a1b-00ff.scope")


def test_systemd_patterns_take_backslashes_as_they_are() -> None:
    assert glob_literal("a\\x2db*?[") == "a\\x2db[*][?][[]"


def test_labels_live_in_the_slice_description_and_nothing_else_reads_as_them() -> None:
    labels = {"slicebox.user": "al-ice", "slicebox.sandbox_id": "sbx-1"}
    assert labels_of(describe(labels)) == labels
    assert labels_of("slicebox slicebox-al-ice.slice") is None
    assert labels_of(MARK + "not json") is None
    assert labels_of(MARK + "[1]") is None


def test_the_slice_carries_the_sandbox_s_limits() -> None:
    assert dict(slice_properties(request())) == {
        "MemoryMax": 128 * MiB,
        "MemorySwapMax": 0,
        "TasksMax": 64,
        "CPUQuotaPerSecUSec": 500_000,
        "IOAccounting": 1,
    }
    unlimited = request(limits=Limits(cpus=0, memory_bytes=MiB, pids=1))
    assert dict(slice_properties(unlimited))["CPUQuotaPerSecUSec"] == INFINITY


def test_every_unit_is_hardened() -> None:
    props = hardening("sbx-1")
    assert props["DynamicUser"] is True
    assert props["User"] == "slicebox-sbx-1"
    assert props["PrivateNetwork"] is True
    assert props["RestrictAddressFamilies"] == (True, ["AF_UNIX"])
    assert props["CapabilityBoundingSet"] == 0
    assert props["NoNewPrivileges"] is True
    assert props["ProtectSystem"] == "strict"
    assert props["ProtectHome"] == "yes"
    assert props["SystemCallFilter"] == (True, ["@system-service"])
    assert props["BindPaths"] == [("/run/slicebox/native/sbx-1", "/workspace", False, 16384)]


def test_environment_values_are_quoted_for_an_environment_file() -> None:
    assert env_line("A", 'x "y" $z `w` \\') == 'A="x \\"y\\" \\$z \\`w\\` \\\\"\n'


# --- lifecycle ---------------------------------------------------------------------------------


def test_create_makes_the_slice_then_the_anchor_in_it(
    native: NativeBackend, systemd: FakeNativeSystemd, tmp_path: Path
) -> None:
    info = native.create(request())
    unit = sandbox_slice(PROJECT, "sbx-000000000001")
    assert info.id == unit
    assert info.state is SandboxState.RUNNING
    assert systemd.properties[unit]["MemoryMax"] == 128 * MiB
    anchor = systemd.services[f"{ANCHOR_PREFIX}sbx-000000000001.service"]
    assert anchor["Slice"] == unit
    assert anchor["ExecStart"][0][1][-2:] == ["sleep", "infinity"]
    assert anchor["ExecStart"][0][1][4].endswith("sandboxinit.py"), "its init runs it"
    assert (anchor["Type"], anchor["PrivatePIDs"]) == ("notify", "yes")
    assert anchor["RestrictAddressFamilies"] == (True, ["AF_UNIX", "AF_INET", "AF_INET6"])
    assert anchor["IPAddressAllow"] == LOCALHOST, "its own loopback, nothing else"
    assert anchor["PrivateNetwork"] is True
    assert anchor["RuntimeDirectory"] == [
        "slicebox/native/sbx-000000000001",
        "slicebox/init/sbx-000000000001",
    ]
    assert "TOKEN" not in str(anchor), "the environment is no unit property"
    env = tmp_path / "env" / "sbx-000000000001.env"
    assert env.read_text() == 'TOKEN="s3\\"cr\\$t"\n'
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    assert stat.S_IMODE(env.parent.stat().st_mode) == 0o700


def test_it_is_found_by_labels_name_and_id_and_its_state_is_its_anchor_s(
    native: NativeBackend, systemd: FakeNativeSystemd
) -> None:
    made = native.create(request())
    assert native.find({"slicebox.user": "al-ice"}) == [made]
    assert native.find({"slicebox.user": "bob"}) == []
    assert asyncio.run(native.inspect("sbx-000000000001")) == made
    assert asyncio.run(native.inspect(made.id)) == made
    assert asyncio.run(native.inspect("sbx-000000000002")) is None
    systemd.end(f"{ANCHOR_PREFIX}sbx-000000000001.service", ended(2, 9, "signal"))
    found = asyncio.run(native.inspect(made.id))
    assert found is not None
    assert found.state is SandboxState.EXITED
    with pytest.raises(SandboxNotRunning):
        native.sandbox_pid(made.id)


def test_remove_stops_everything_of_it_and_a_second_remove_finds_it_gone(
    native: NativeBackend, systemd: FakeNativeSystemd, tmp_path: Path
) -> None:
    made = native.create(request())
    systemd.end(f"{ANCHOR_PREFIX}sbx-000000000001.service", ended(2, 9, "signal"))
    assert native.remove(made.id) is True
    assert native.find({}) == []
    assert systemd.service_states == {}, "failed units are forgotten too"
    assert not (tmp_path / "env" / "sbx-000000000001.env").exists()
    assert native.remove(made.id) is False
    with pytest.raises(SandboxNotFound):
        native.sandbox_pid(made.id)


def test_an_anchor_that_ends_at_once_leaves_nothing(
    native: NativeBackend, systemd: FakeNativeSystemd, tmp_path: Path
) -> None:
    systemd.ends_at_once[ANCHOR_PREFIX] = ended(1, 127)
    with pytest.raises(InvalidRequest) as refused:
        native.create(request())
    assert refused.value.code == "container_start_failed"
    assert native.find({}) == []
    assert systemd.service_states == {}
    assert list((tmp_path / "env").iterdir()) == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"network": "bridge"}, "network"), ({"cap_add": ("NET_RAW",)}, "cap_add")],
)
def test_what_it_cannot_give_is_refused(
    native: NativeBackend, fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        native.create(request(**fields))
    assert refused.value.code == "backend_unsupported"
    assert named in refused.value.message


def test_an_exec_in_a_stopped_sandbox_is_refused(
    native: NativeBackend, systemd: FakeNativeSystemd
) -> None:
    made = native.create(request())
    systemd.end(f"{ANCHOR_PREFIX}sbx-000000000001.service", ended(2, 9, "signal"))
    with pytest.raises(SandboxNotRunning):
        asyncio.run(native.exec_create(made.id, ExecRequest(argv=("id",))))


def test_the_async_pipes_read_output_and_feed_stdin(native: NativeBackend) -> None:
    """The attachment's reading and feeding, on real pipes (what systemd's end would be)."""
    from slicebox.backends.native.pipes import AsyncPipes

    async def go() -> tuple[bytes, bytes]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe()
        pipes = AsyncPipes(asyncio.get_running_loop(), out_r, err_r)
        pipes.feed(in_w, b"x" * 200_000)  # more than a pipe holds: fed as it is read
        got = bytearray()
        while len(got) < 200_000:
            got += await asyncio.to_thread(os.read, in_r, 65536)
        os.close(in_r)
        os.write(out_w, b"out")
        os.write(err_w, b"err")
        os.close(out_w)
        os.close(err_w)
        seen: dict[str, bytes] = {"stdout": b"", "stderr": b""}
        while (chunks := await pipes.read(1.0)) is not None:
            for chunk in chunks:
                seen[chunk.stream.value] += chunk.data
        pipes.close()
        return bytes(got[:3]), seen["stdout"] + seen["stderr"]

    head, output = asyncio.run(go())
    assert head == b"xxx"
    assert output in (b"outerr", b"errout")


# --- the router and the fallback ---------------------------------------------------------------


class Host:
    def __init__(self, env_dir: Path, config: str = "") -> None:
        self.systemd = FakeNativeSystemd()
        self.docker = FakeDocker(self.systemd)
        self.native = NativeBackend(self.systemd, env_dir=env_dir, which=lambda name: name)
        self.backends = Backends(self.docker, self.native)
        ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        self.manager = SandboxManager(
            self.backends,
            SliceManager(self.systemd),
            config=parse_config(config),
            host_memory=4096 * MiB,
            instance_id="run-1",
            clock=lambda: NOW,
            new_id=lambda: next(ids),
        )


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path / "env")


def spec(**fields: object) -> SandboxSpec:
    return SandboxSpec.model_validate({"user": "al-ice", "project": "p", **fields})


def test_docker_answering_runs_docker(host: Host) -> None:
    made = created(host.manager, spec())
    assert made.backend == "docker"
    assert host.docker.created == 1


def test_docker_down_falls_back_to_native_and_says_so(host: Host) -> None:
    host.docker.down = "connection refused"
    made = created(host.manager, spec(image="alpine:3.19"))
    assert made.backend == "native"
    assert made.lineage.launcher == ""
    assert is_native_id(made.container_id)
    assert host.manager.get(made.id).id == made.id, "looked up past the Docker that is down"
    assert [s.id for s in host.manager.find(user="al-ice")] == [made.id]
    assert host.manager.destroy(made.id) is not None
    assert host.manager.find(user="al-ice") == []


def test_no_fallback_when_the_config_says_not(tmp_path: Path) -> None:
    host = Host(tmp_path / "env", "allow_native_fallback = false\n")
    host.docker.down = "connection refused"
    with pytest.raises(Unavailable) as refused:
        created(host.manager, spec())
    assert refused.value.code == "backend_unavailable"
    assert "allow_native_fallback" in refused.value.message
    assert host.systemd.calls == [], "refused before any slice"


def test_a_pool_member_never_falls_back(host: Host) -> None:
    host.docker.down = "connection refused"
    with pytest.raises(Unavailable):
        created(host.manager, spec(), pool_key="k")


def test_native_refusals_come_before_any_slice(host: Host) -> None:
    with pytest.raises(InvalidRequest) as refused:
        created(host.manager, spec(backend="native", network="bridge"))
    assert refused.value.code == "backend_unsupported"
    assert refused.value.field == "network"
    assert host.systemd.calls == []


def test_a_native_one_shot_has_no_waiter(host: Host) -> None:
    made = created(host.manager, spec(backend="native"), one_shot=True)
    assert made.lineage.launcher == ""
    host.manager.end_operation(made.id)


def test_docker_s_answer_is_kept_for_a_few_seconds() -> None:
    systemd = FakeNativeSystemd()
    docker = FakeDocker(systemd)
    now = [0.0]
    backends = Backends(docker, NativeBackend(systemd, which=lambda n: n), clock=lambda: now[0])
    docker.down = "refused"
    assert backends.resolve(Backend.DOCKER, fallback=True) is Backend.NATIVE
    docker.down = None
    assert backends.resolve(Backend.DOCKER, fallback=True) is Backend.NATIVE, "kept"
    now[0] = 6.0
    assert backends.resolve(Backend.DOCKER, fallback=True) is Backend.DOCKER
    kinds = [a.kind for a in backends.availabilities()]
    assert kinds == [Backend.DOCKER, Backend.NATIVE, Backend.WASM, Backend.DAYTONA]


def test_the_start_asks_each_backend_once() -> None:
    """What the agent's start logs: one question to systemd for native and wasm together."""
    systemd = FakeNativeSystemd()
    asked: list[str] = []
    is_active = systemd.is_active

    def counted(unit: str) -> bool:
        asked.append(unit)
        return is_active(unit)

    systemd.is_active = counted  # type: ignore[method-assign]
    backends = Backends(FakeDocker(systemd), NativeBackend(systemd, which=lambda n: n))
    answers = backends.availabilities()
    assert [a.kind for a in answers] == [
        Backend.DOCKER,
        Backend.NATIVE,
        Backend.WASM,
        Backend.DAYTONA,
    ]
    assert asked == ["slicebox.slice"]


def test_a_listing_with_docker_down_is_the_native_sandboxes(host: Host) -> None:
    native = created(host.manager, spec(backend="native"))
    docker = created(host.manager, spec(project="q"))
    assert {s.id for s in host.manager.find(user="al-ice")} == {native.id, docker.id}
    host.docker.down = "refused"
    assert [s.id for s in host.manager.find(user="al-ice")] == [native.id]
    assert host.backends.volumes({}) == []


def test_a_host_workspace_runs_as_the_caller_and_a_restarted_agent_knows_it(
    native: NativeBackend, systemd: FakeNativeSystemd, tmp_path: Path
) -> None:
    workspace = Mount(source="/srv/ws/al-ice/w", target="/workspace")
    made = native.create(request(user="1000:1000", mounts=(workspace,)))
    anchor = systemd.services[f"{ANCHOR_PREFIX}sbx-000000000001.service"]
    assert (anchor["User"], anchor["Group"]) == ("1000", "1000")
    assert "DynamicUser" not in anchor
    assert anchor["BindPaths"] == [("/srv/ws/al-ice/w", "/workspace", False, 16384)]
    later = NativeBackend(systemd, env_dir=tmp_path / "env", which=lambda name: name)
    assert later._run_as_of(made.id).user == "1000:1000", "read back from its slice"
    read_only = Mount(source="/srv/ws/al-ice/w", target="/workspace", read_only=True)
    other = native.create(request("sbx-000000000002", user="1000:1000", mounts=(read_only,)))
    assert "BindReadOnlyPaths" in systemd.services[f"{ANCHOR_PREFIX}sbx-000000000002.service"]
    assert other.state is SandboxState.RUNNING


def test_other_mounts_than_the_workspace_are_refused(native: NativeBackend) -> None:
    with pytest.raises(InvalidRequest) as refused:
        native.create(request(mounts=(Mount(source="/srv/x", target="/data"),)))
    assert refused.value.code == "backend_unsupported"


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"workspace": {"kind": "volume"}}, "workspace"), ({"run_as": "1000:1000"}, "run_as")],
)
def test_a_native_spec_refuses_volumes_and_a_chosen_user(
    host: Host, fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        created(host.manager, spec(backend="native", **fields))
    assert refused.value.field == named


def test_an_anchor_systemd_could_not_start_says_why(
    native: NativeBackend, systemd: FakeNativeSystemd
) -> None:
    systemd.ends_at_once[ANCHOR_PREFIX] = ended(1, 217)
    with pytest.raises(InvalidRequest) as refused:
        native.create(request())
    assert "exit status 217: its user does not exist on this host" in refused.value.message


def test_jit_runtimes_are_the_operator_s_choice(tmp_path: Path) -> None:
    strict = Host(tmp_path / "a")
    made = created(strict.manager, spec(backend="native"))
    anchor = strict.systemd.services[f"{ANCHOR_PREFIX}{made.id}.service"]
    assert anchor["MemoryDenyWriteExecute"] is True
    jit = Host(tmp_path / "b", "native_allow_jit = true\n")
    made = created(jit.manager, spec(backend="native"))
    assert (
        jit.systemd.services[f"{ANCHOR_PREFIX}{made.id}.service"]["MemoryDenyWriteExecute"] is False
    )
    later = NativeBackend(jit.systemd, env_dir=tmp_path / "b", which=lambda name: name)
    assert later._run_as_of(made.container_id).jit, "read back from its slice"
