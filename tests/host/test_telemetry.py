"""Telemetry on a real host: the kernel's counters show what sandboxes really did.

Three containers serve the whole module (container starts are slow under emulation):
``worker`` (network none, a 200 MB tmpfs) burns CPU, holds memory and writes to disk; ``small``
(bridge network, 48 MB limit) sends traffic and hits its own memory limit; ``capped`` lives in a
project whose slice has a 64 MB memory ceiling and a 20 % CPU quota.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import docker
import pytest
from docker.models.containers import Container
from pydantic import ValidationError

from slicebox.core.telemetry import (
    SandboxCgroups,
    SandboxMeta,
    TreeReader,
    UsageReader,
    scope_pid,
)
from slicebox.host.cgroupfs import CgroupFS, CgroupReader
from slicebox.host.netstats import NetnsCounters
from slicebox.model.usage import Level, LevelNode, ResourceUsage, oom_blame, throttle_blame
from tests.host.helpers import CGROUP_ROOT, TEST_IMAGE, stop_unit, unique, wait_for

pytestmark = pytest.mark.host

MiB = 1024 * 1024
USER = unique("tu")
WORK, CAPPED = unique("tp"), unique("tq")
BURN_SECONDS = 4


@dataclass(frozen=True)
class Sandbox:
    container: Container
    where: SandboxCgroups
    meta: SandboxMeta


def project_slice(project: str) -> str:
    return f"slicebox-{USER}-{project}.slice"


def start_slice(name: str, properties: dict[bytes, object]) -> None:
    from pystemd.systemd1 import Manager, Unit  # only on a real host

    with Manager() as manager:
        manager.Manager.StartTransientUnit(name.encode(), b"fail", properties)
    with Unit(name.encode()) as unit:
        wait_for(lambda: unit.Unit.ActiveState == b"active")


def sandbox(client: docker.DockerClient, project: str, **kwargs: object) -> Sandbox:
    container = client.containers.run(
        TEST_IMAGE,
        ["sleep", "900"],
        detach=True,
        init=True,
        cgroup_parent=project_slice(project),
        **kwargs,
    )
    init = client.api.inspect_container(container.id)["State"]["Pid"]
    scope = f"slicebox.slice/slicebox-{USER}.slice/{project_slice(project)}"
    where = SandboxCgroups.of_scope(f"{scope}/docker-{container.id}.scope")
    assert (CGROUP_ROOT / where.scope).is_dir()
    pid = scope_pid(CgroupFS(), where.scope)  # as the agent finds it: no Docker call
    assert pid is not None
    assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink(f"/proc/{init}/ns/net")
    meta = SandboxMeta("docker", datetime.now(UTC), 0.5, 256 * MiB, init_pid=pid)
    return Sandbox(container, where, meta)


@pytest.fixture(scope="module")
def boxes(client: docker.DockerClient) -> Iterator[dict[str, Sandbox]]:
    made: dict[str, Sandbox] = {}
    try:
        start_slice(
            project_slice(CAPPED),
            {b"MemoryMax": 64 * MiB, b"CPUQuotaPerSecUSec": 200_000, b"Description": b"test"},
        )
        made["worker"] = sandbox(
            client, WORK, network_mode="none", mem_limit="512m", tmpfs={"/hold": "size=200m"}
        )
        made["small"] = sandbox(client, WORK, network_mode="bridge", mem_limit="48m")
        made["capped"] = sandbox(client, CAPPED, network_mode="none", mem_limit="256m")
        yield made
    finally:
        for box in made.values():
            remove(box.container)
        cleanup_slices()


def remove(container: Container) -> None:
    with contextlib.suppress(docker.errors.NotFound):  # a test may have removed it already
        container.remove(force=True)


def cleanup_slices() -> None:
    for project in (WORK, CAPPED):
        stop_unit(project_slice(project))
    stop_unit(f"slicebox-{USER}.slice")
    if not (CGROUP_ROOT / "slicebox.slice").exists():
        return
    if not any(p.is_dir() for p in (CGROUP_ROOT / "slicebox.slice").iterdir()):
        stop_unit("slicebox.slice")


@pytest.fixture(scope="module")
def reader() -> UsageReader:
    return UsageReader(CgroupFS(), net=NetnsCounters())


def run(box: Sandbox, *argv: str) -> int:
    exit_code, _ = box.container.exec_run(list(argv))
    return int(exit_code)


def tree() -> LevelNode:
    return TreeReader(CgroupFS()).tree()


def node(cgroup: str) -> LevelNode:
    found = tree().find(cgroup)
    assert found is not None, f"{cgroup} is not in the level tree"
    return found


def test_cpu_seconds_rise_by_the_time_burned(
    boxes: dict[str, Sandbox], reader: UsageReader
) -> None:
    """One busy loop for BURN_SECONDS of wall time is BURN_SECONDS of CPU, give or take.

    The window starts after the exec is up: starting a docker exec (runc) costs seconds of CPU
    in the container's own cgroup under emulation, which is real usage but not the burn. The
    first netns read imports pyroute2 (seconds here), so the window reads cgroups only.
    """
    box = boxes["worker"]
    plain = UsageReader(CgroupFS())  # no netns read inside the timed window
    pids = plain.cgroups.pids_current
    idle = pids(box.where.scope)
    box.container.exec_run(["timeout", "15", "sh", "-c", "while :; do :; done"], detach=True)
    wait_for(lambda: (pids(box.where.scope) or 0) > (idle or 0))
    time.sleep(3)
    before, started = plain.usage(box.where, box.meta).cpu_seconds, time.monotonic()
    time.sleep(BURN_SECONDS)
    after, wall = plain.usage(box.where, box.meta).cpu_seconds, time.monotonic() - started
    assert before is not None
    assert after is not None
    print(f"burned {wall:.2f}s of wall time, cpu_seconds rose by {after - before:.2f}")
    assert 0.75 * wall <= after - before <= 1.25 * wall
    wait_for(lambda: pids(box.where.scope) == idle, timeout=30)


def test_held_memory_shows_in_sandbox_project_user_and_managed(
    boxes: dict[str, Sandbox], reader: UsageReader
) -> None:
    box = boxes["worker"]
    sandbox_before = CgroupReader(CgroupFS()).memory_current(box.where.scope) or 0
    assert run(box, "dd", "if=/dev/zero", "of=/hold/blob", "bs=1M", "count=100") == 0
    usage = reader.usage(box.where, box.meta)
    assert usage.memory_bytes is not None
    levels = node(box.where.scope).memory_current, *usage.memory_bytes.model_dump().values()
    print(f"memory.current sandbox/managed/user/project: {levels}")
    assert all(value is not None and value >= 100 * MiB for value in levels)
    assert levels[0] is not None
    assert levels[0] - sandbox_before >= 95 * MiB
    user = node(box.where.user)
    assert user.level is Level.USER
    assert user.memory_current is not None
    assert user.memory_current >= 100 * MiB


def test_fsynced_file_shows_in_disk_bytes_written(
    boxes: dict[str, Sandbox], reader: UsageReader
) -> None:
    box = boxes["worker"]
    before = reader.usage(box.where, box.meta).disk_bytes_written
    assert before is not None
    write = ("dd", "if=/dev/zero", "of=/tmp/file", "bs=1M", "count=50", "conv=fsync")
    assert run(box, *write) == 0
    after = reader.usage(box.where, box.meta).disk_bytes_written
    assert after is not None
    print(f"disk_bytes_written rose by {after - before}")
    assert after - before >= 50 * MiB


def test_network_none_reads_a_real_zero(boxes: dict[str, Sandbox], reader: UsageReader) -> None:
    box = boxes["worker"]
    assert reader.usage(box.where, box.meta).network_bytes == 0


class _Payload(http.server.BaseHTTPRequestHandler):
    body = b"x" * (2 * MiB)

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:  # the base's signature
        pass


@pytest.fixture
def gateway_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("172.17.0.1", 0), _Payload)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join()


def test_bridge_traffic_shows_in_network_bytes(
    boxes: dict[str, Sandbox], reader: UsageReader, gateway_server: int
) -> None:
    box = boxes["small"]
    before = reader.usage(box.where, box.meta).network_bytes
    assert before is not None
    url = f"http://172.17.0.1:{gateway_server}/"
    assert run(box, "wget", "-q", "-O", "/dev/null", url) == 0
    after = reader.usage(box.where, box.meta).network_bytes
    assert after is not None
    print(f"network_bytes rose by {after - before}")
    assert after - before >= 2 * MiB


def test_oom_at_the_sandbox_limit_is_blamed_on_the_sandbox(boxes: dict[str, Sandbox]) -> None:
    box = boxes["small"]
    assert run(box, "dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1") != 0
    sandbox_node = node(box.where.scope)
    assert sandbox_node.oom_kills is not None
    assert sandbox_node.oom_kills >= 1
    assert [n.level for n in oom_blame(tree(), box.where.scope)] == [Level.SANDBOX]
    assert node(box.where.project).ooms_caused == 0


def test_oom_in_the_project_is_blamed_on_the_project(boxes: dict[str, Sandbox]) -> None:
    box = boxes["capped"]
    assert run(box, "dd", "if=/dev/zero", "of=/dev/null", "bs=100M", "count=1") != 0
    snapshot = tree()
    sandbox_node, project = snapshot.find(box.where.scope), snapshot.find(box.where.project)
    assert sandbox_node is not None
    assert project is not None
    assert (sandbox_node.oom_kills or 0) >= 1, "the victim lived in the sandbox"
    assert sandbox_node.ooms_caused == 0, "its own 256 MB limit was never reached"
    assert project.memory_max == 64 * MiB
    assert [n.level for n in oom_blame(snapshot, box.where.scope)] == [Level.PROJECT]


def test_cpu_throttling_is_blamed_on_the_project_quota(boxes: dict[str, Sandbox]) -> None:
    box = boxes["capped"]
    run(box, "timeout", "2", "sh", "-c", "while :; do :; done")
    snapshot = tree()
    project, sandbox_node = snapshot.find(box.where.project), snapshot.find(box.where.scope)
    assert project is not None
    assert sandbox_node is not None
    assert project.cpu_quota == pytest.approx(0.2)
    assert (project.cpu_nr_throttled or 0) > 0
    assert sandbox_node.cpu_nr_throttled == 0
    assert [n.level for n in throttle_blame(snapshot, box.where.scope)] == [Level.PROJECT]


def test_strict_model_rejects_an_extra_key(boxes: dict[str, Sandbox], reader: UsageReader) -> None:
    box = boxes["worker"]
    wire = reader.usage(box.where, box.meta).to_wire()
    assert ResourceUsage.model_validate(wire).to_wire() == wire
    with pytest.raises(ValidationError, match="gpu_seconds"):
        ResourceUsage.model_validate({**wire, "gpu_seconds": 1.0})


def test_final_usage_is_read_before_the_cgroup_goes(
    boxes: dict[str, Sandbox], reader: UsageReader
) -> None:
    box = boxes["worker"]
    now = datetime.now(UTC)
    final = reader.final_usage(box.where, box.meta, now)
    remove(box.container)
    wait_for(lambda: not (CGROUP_ROOT / box.where.scope).exists())
    assert final.sandbox is not None
    assert final.sandbox.deleted_at == now
    assert (final.cpu_seconds or 0) >= 0.7 * BURN_SECONDS
    assert (final.disk_bytes_written or 0) >= 50 * MiB
    gone = reader.usage(box.where, box.meta)
    assert (gone.cpu_seconds, gone.disk_bytes_written, gone.network_bytes) == (None, None, None)
