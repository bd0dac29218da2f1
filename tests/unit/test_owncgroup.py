"""The agent's own memory limit, the default of the exec output budget, from a fake cgroupfs."""

from __future__ import annotations

from pathlib import Path

from slicebox.host.cgroupfs import CgroupFS
from slicebox.host.owncgroup import agent_memory_max, memory_limit, parse_proc_cgroup

MiB = 1024 * 1024


def test_the_proc_cgroup_line_of_cgroup_v2() -> None:
    hybrid = "12:memory:/system.slice/x\n0::/system.slice/slicebox.service\n"
    assert parse_proc_cgroup(hybrid) == "/system.slice/slicebox.service"
    assert parse_proc_cgroup("12:memory:/x\n") is None


def write(root: Path, cgroup: str, memory_max: str) -> None:
    (root / cgroup).mkdir(parents=True, exist_ok=True)
    (root / cgroup / "memory.max").write_text(memory_max + "\n")


def test_the_smallest_limit_on_the_way_up_bites(tmp_path: Path) -> None:
    write(tmp_path, "system.slice", "1073741824")
    write(tmp_path, "system.slice/slicebox.service", "max")
    assert memory_limit(CgroupFS(tmp_path), "/system.slice/slicebox.service") == 1024 * MiB
    write(tmp_path, "system.slice/slicebox.service", str(512 * MiB))
    assert memory_limit(CgroupFS(tmp_path), "/system.slice/slicebox.service") == 512 * MiB
    assert memory_limit(CgroupFS(tmp_path), "/user.slice/gone.scope") is None


def test_the_agents_own_limit_or_none(tmp_path: Path) -> None:
    write(tmp_path, "system.slice/slicebox.service", str(768 * MiB))
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/slicebox.service\n")
    assert agent_memory_max(CgroupFS(tmp_path), proc) == 768 * MiB
    assert agent_memory_max(CgroupFS(tmp_path), tmp_path / "missing") is None
