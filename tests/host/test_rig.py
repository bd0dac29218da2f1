"""Facts about the real host that the rest of slicebox relies on.

Each test pins one fact of issue 2 and fails when it does not hold: if the guest (or a future
target host) changes, these say exactly which assumption broke.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

import docker
import pytest
from docker.models.containers import Container

from tests.host.helpers import (
    CGROUP_ROOT,
    TEST_IMAGE,
    memory_events,
    sh,
    stop_unit,
    unique,
    wait_for,
)

pytestmark = pytest.mark.host


def remove(container: Container) -> None:
    container.remove(force=True)


def test_pid1_is_systemd() -> None:
    assert Path("/proc/1/comm").read_text().strip() == "systemd"


def test_cgroup2_with_controllers_delegated() -> None:
    assert sh("stat", "-fc", "%T", str(CGROUP_ROOT)).stdout.strip() == "cgroup2fs"
    enabled = set((CGROUP_ROOT / "cgroup.subtree_control").read_text().split())
    assert {"cpu", "memory", "pids", "io"} <= enabled


def test_docker_uses_systemd_cgroup_driver_on_v2(client: docker.DockerClient) -> None:
    info = client.info()
    assert info["CgroupDriver"] == "systemd"
    assert info["CgroupVersion"] == "2"


def test_cgroup_parent_places_container_in_three_slices(client: docker.DockerClient) -> None:
    container = client.containers.run(
        TEST_IMAGE,
        ["sleep", "300"],
        detach=True,
        cgroup_parent="slicebox-a-b.slice",
        network_mode="none",
        mem_limit="64m",
        pids_limit=20,
    )
    try:
        expected = (
            CGROUP_ROOT
            / "slicebox.slice"
            / "slicebox-a.slice"
            / "slicebox-a-b.slice"
            / f"docker-{container.id}.scope"
        )
        assert expected.is_dir()
        pid = (
            container.attrs["State"]["Pid"]
            or client.api.inspect_container(container.id)["State"]["Pid"]
        )
        own = Path(f"/proc/{pid}/cgroup").read_text().strip()
        assert own == "0::/" + str(expected.relative_to(CGROUP_ROOT))
        assert (expected / "memory.max").read_text().strip() == str(64 * 1024 * 1024)
        assert (expected / "pids.max").read_text().strip() == "20"
    finally:
        remove(container)
        for unit in ("slicebox-a-b.slice", "slicebox-a.slice", "slicebox.slice"):
            stop_unit(unit)


def start_transient_slice(name: str, properties: dict[bytes, object]) -> Path:
    """Start a transient slice, wait until it is active, return its cgroup directory."""
    from pystemd.systemd1 import Manager, Unit  # only on a real host

    with Manager() as manager:
        manager.Manager.StartTransientUnit(name.encode(), b"fail", properties)
    with Unit(name.encode()) as unit:
        wait_for(lambda: unit.Unit.ActiveState == b"active")
        # A dash in a slice name means nesting: slicebox-x.slice lives in slicebox.slice.
        control_group: str = unit.Slice.ControlGroup.decode()
    return CGROUP_ROOT / control_group.lstrip("/")


def test_pystemd_starts_transient_slice_with_ceilings() -> None:
    from pystemd.systemd1 import Unit

    name = unique("slicebox-rigtest") + ".slice"
    try:
        cgroup = start_transient_slice(
            name,
            {
                b"MemoryMax": 96 * 1024 * 1024,
                b"TasksMax": 33,
                b"CPUQuotaPerSecUSec": 250_000,
                b"Description": b"slicebox rig test",
            },
        )
        with Unit(name.encode()) as unit:
            assert unit.Slice.MemoryMax == 96 * 1024 * 1024
            assert unit.Slice.TasksMax == 33
            assert unit.Slice.CPUQuotaPerSecUSec == 250_000
        assert cgroup == CGROUP_ROOT / "slicebox.slice" / name
        assert (cgroup / "memory.max").read_text().strip() == str(96 * 1024 * 1024)
        assert (cgroup / "pids.max").read_text().strip() == "33"
        assert (cgroup / "cpu.max").read_text().split()[0] == "25000"
    finally:
        stop_unit(name)


def test_kernel_oom_kills_process_over_slice_memory_max() -> None:
    name = unique("slicebox-rigoom") + ".slice"
    try:
        cgroup = start_transient_slice(name, {b"MemoryMax": 64 * 1024 * 1024})
        before = memory_events(cgroup)["oom_kill"]
        hog = sh(
            "systemd-run",
            "--wait",
            "--quiet",
            "--collect",
            f"--slice={name}",
            "python3",
            "-c",
            "b = b'x' * (256 * 1024 * 1024)",
            check=False,
        )
        assert hog.returncode != 0, "the hog should have been killed"
        assert memory_events(cgroup)["oom_kill"] > before
    finally:
        stop_unit(name)


def test_docker_exec_lands_in_container_cgroup_and_counts_pids(
    client: docker.DockerClient,
) -> None:
    container = client.containers.run(
        TEST_IMAGE,
        ["sleep", "300"],
        detach=True,
        cgroup_parent=unique("slicebox-rigx") + ".slice",
        network_mode="none",
        pids_limit=10,
        init=True,
    )
    try:
        inspect = client.api.inspect_container(container.id)
        scope_path = Path(f"/proc/{inspect['State']['Pid']}/cgroup").read_text().strip()[3:]
        cgroup = CGROUP_ROOT / scope_path.lstrip("/")
        exit_code, output = container.exec_run(["cat", "/proc/self/cgroup"])
        assert exit_code == 0
        # Inside the container's cgroup namespace its own cgroup is the root.
        assert output.decode().strip() == "0::/"
        container.exec_run(
            ["sh", "-c", "for i in $(seq 30); do sleep 60 & done; sleep 60"], detach=True
        )
        time.sleep(2)
        pids = int((cgroup / "pids.current").read_text())
        events = (cgroup / "pids.events").read_text()
        assert pids <= 10
        assert "max 0" not in events, events
        procs = (cgroup / "cgroup.procs").read_text().split()
        assert len(procs) >= 5, "exec'd processes must be in the container's cgroup"
    finally:
        parent = json.dumps(container.attrs["HostConfig"]["CgroupParent"])
        remove(container)
        stop_unit(json.loads(parent))


def unit_properties(unit: str, *names: str) -> dict[str, str]:
    shown = sh("systemctl", "show", unit, *(f"--property={name}" for name in names)).stdout
    return dict(line.split("=", 1) for line in shown.splitlines())


def test_cpu_bandwidth_key_was_switched_at_boot_before_docker() -> None:
    # Under QEMU's TCG the first CPU-limited cgroup can kill the guest's kernel (RIG.md); the
    # rig switches that key once at boot with one CPU online, before dockerd can start any.
    rig = unit_properties(
        "rig-cpu-bandwidth.service",
        "ActiveState",
        "SubState",
        "Result",
        "ExecMainStatus",
        "ExecMainExitTimestampMonotonic",
    )
    assert (rig["ActiveState"], rig["SubState"], rig["Result"]) == ("active", "exited", "success")
    assert rig["ExecMainStatus"] == "0"
    docker_started = unit_properties("docker.service", "ExecMainStartTimestampMonotonic")
    assert (
        0
        < int(rig["ExecMainExitTimestampMonotonic"])
        < int(docker_started["ExecMainStartTimestampMonotonic"])
    )
    # It took CPUs offline for a moment: every one of them is back.
    assert Path("/sys/devices/system/cpu/offline").read_text().strip() == ""


def kernel_symbol(name: str) -> int:
    for line in Path("/proc/kallsyms").read_text().splitlines():
        address, _, symbol = line.split()[:3]
        if symbol == name:
            return int(address, 16)
    raise AssertionError(f"{name} is not in /proc/kallsyms")


def read_kernel(address: int, size: int) -> bytes:
    """Read kernel memory through /proc/kcore, an ELF core file of the running kernel."""
    with Path("/proc/kcore").open("rb") as core:
        header = core.read(64)
        (phoff,) = struct.unpack_from("<Q", header, 32)
        phentsize, phnum = struct.unpack_from("<HH", header, 54)
        for index in range(phnum):
            core.seek(phoff + index * phentsize)
            kind, _, offset, vaddr, _, _, memsz, _ = struct.unpack("<IIQQQQQQ", core.read(56))
            if kind == 1 and vaddr <= address < vaddr + memsz:  # PT_LOAD
                core.seek(offset + address - vaddr)
                return core.read(size)
    raise AssertionError(f"{address:#x} is in no segment of /proc/kcore")


def test_cpu_bandwidth_key_stays_on_once_switched() -> None:
    # The boot unit's cgroup is gone, yet the key it switched must stay on: this kernel only
    # lowers it when a quota is set back to "max", not when a cgroup with a quota is removed.
    # Were that to change, the first CPU-limited container would patch the kernel text again.
    (enabled,) = struct.unpack("<i", read_kernel(kernel_symbol("__cfs_bandwidth_used"), 4))
    assert enabled >= 1


RUNC_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def test_containerd_runs_the_packaged_runc_from_a_sealed_copy() -> None:
    # runc 1.1 copies itself into a new memfd at every exec, which under TCG costs ~0.6 s of
    # guest CPU; the rig runs it from one sealed copy instead (tests/guest/image/rig-sealed-runc).
    # The copy must be the packaged binary, byte for byte, sealed the way runc checks for, and
    # the runc that containerd's PATH finds.
    holder = unit_properties("rig-sealed-runc.service", "ActiveState", "MainPID")
    assert holder["ActiveState"] == "active"
    copy = Path(f"/proc/{holder['MainPID']}/fd/3")
    with copy.open("rb") as sealed:
        assert fcntl.fcntl(sealed.fileno(), fcntl.F_GET_SEALS) == RUNC_SEALS
        assert (
            hashlib.sha256(sealed.read()).digest()
            == hashlib.sha256(Path("/usr/sbin/runc").read_bytes()).digest()
        )
    containerd = sh("systemctl", "show", "-P", "MainPID", "containerd.service").stdout.strip()
    environ = Path(f"/proc/{containerd}/environ").read_bytes().split(b"\0")
    paths = [entry[5:].decode() for entry in environ if entry.startswith(b"PATH=")]
    search = paths[0] if paths else os.defpath
    assert shutil.which("runc", path=search) == "/usr/local/sbin/runc"
    found, held = os.stat("/usr/local/sbin/runc"), copy.stat()
    assert (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino), "the copy, no wrapper"
    version = sh("/usr/local/sbin/runc", "--version").stdout
    assert version == sh("/usr/sbin/runc", "--version").stdout
