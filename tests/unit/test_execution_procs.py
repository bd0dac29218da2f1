"""Finding and killing an exec's processes in a sandbox cgroup, on a fake /proc and cgroupfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from slicebox.host.procs import (
    CgroupHost,
    ProcInfo,
    cgroup_from_proc,
    exec_members,
    exec_session,
    parse_oom_kills,
    parse_stat,
)
from slicebox.model.errors import HostError


def test_parse_stat_survives_odd_command_names() -> None:
    info = parse_stat(12, "12 (a) b (c)) S 7 12 9 0 -1 4194560 0 0")
    assert info == ProcInfo(pid=12, ppid=7, session=9)


# The sandbox: init 1 -> main 2; an earlier daemon 30 (own session); the exec 10 (leads session
# 10) -> 11 -> 12; 13 was the exec's child, reparented to init when its parent died.
TABLE = [
    ProcInfo(1, 0, 1),
    ProcInfo(2, 1, 1),
    ProcInfo(30, 1, 30),
    ProcInfo(10, 0, 10),
    ProcInfo(11, 10, 10),
    ProcInfo(12, 11, 10),
    ProcInfo(13, 1, 10),
    ProcInfo(31, 30, 30),
]


def test_exec_members_are_descendants_and_session() -> None:
    assert exec_members({10}, exec_session(10, TABLE), TABLE) == {10, 11, 12, 13}


def test_exec_members_without_own_session_are_its_tree_only() -> None:
    table = [*TABLE[:3], ProcInfo(10, 0, 1), ProcInfo(11, 10, 1)]
    assert exec_session(10, table) is None
    assert exec_members({10}, None, table) == {10, 11}


def test_exec_members_of_a_vanished_exec_follow_killed_roots() -> None:
    table = [p for p in TABLE if p.pid != 10]
    assert exec_members({10, 11}, 10, table) == {11, 12, 13}


def test_parse_oom_kills_and_cgroup_line() -> None:
    assert parse_oom_kills("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n") == 2
    assert parse_oom_kills("low 0\n") is None
    assert (
        cgroup_from_proc("0::/slicebox.slice/docker-x.scope\n") == "/slicebox.slice/docker-x.scope"
    )
    with pytest.raises(HostError, match="cgroup v2"):
        cgroup_from_proc("1:memory:/x\n")


class FakeKernel:
    """A fake /proc and cgroup directory; SIGKILL removes the process (children reparent)."""

    def __init__(self, root: Path, table: list[ProcInfo]) -> None:
        self.proc = root / "proc"
        self.cgroup = root / "cg"
        self.cgroup.mkdir(parents=True)
        self.table = {p.pid: p for p in table}
        self.signalled: list[int] = []
        self.sync()

    def sync(self) -> None:
        (self.cgroup / "cgroup.procs").write_text("".join(f"{p}\n" for p in self.table))
        for p in self.table.values():
            (self.proc / str(p.pid)).mkdir(parents=True, exist_ok=True)
            stat = f"{p.pid} (x y) S {p.ppid} {p.pid} {p.session} 0 -1"
            (self.proc / str(p.pid) / "stat").write_text(stat)

    def kill(self, pid: int, sig: int) -> None:
        self.signalled.append(pid)
        self.table.pop(pid)
        for child in [c for c in self.table.values() if c.ppid == pid]:
            self.table[child.pid] = ProcInfo(child.pid, 1, child.session)
        self.sync()


def test_kill_exec_leaves_only_what_is_not_the_execs(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE)
    host = CgroupHost(
        cgroup_root=tmp_path, proc=kernel.proc, kill=kernel.kill, sleep=lambda s: None
    )
    assert host.kill_exec(kernel.cgroup, 10) == 4
    assert sorted(kernel.table) == [1, 2, 30, 31]
    assert sorted(kernel.signalled) == [10, 11, 12, 13]


def test_kill_exec_never_touches_pids_outside_the_cgroup(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE[:3])
    host = CgroupHost(
        cgroup_root=tmp_path, proc=kernel.proc, kill=kernel.kill, sleep=lambda s: None
    )
    host.kill_exec(kernel.cgroup, 999)
    assert kernel.signalled == []


def test_kill_exec_gives_up_on_unkillable_processes(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, TABLE)
    host = CgroupHost(
        cgroup_root=tmp_path, proc=kernel.proc, kill=lambda p, s: None, sleep=lambda s: None
    )
    with pytest.raises(HostError, match="survived"):
        host.kill_exec(kernel.cgroup, 10)


def test_cgroup_of_and_oom_kills_read_the_files(tmp_path: Path) -> None:
    (tmp_path / "proc" / "5").mkdir(parents=True)
    (tmp_path / "proc" / "5" / "cgroup").write_text("0::/a.slice/b.scope\n")
    host = CgroupHost(cgroup_root=tmp_path / "cg", proc=tmp_path / "proc")
    cgroup = host.cgroup_of(5)
    assert cgroup == tmp_path / "cg" / "a.slice" / "b.scope"
    assert host.oom_kills(cgroup) is None, "a missing file is no value, not 0"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.events").write_text("oom 1\noom_kill 1\n")
    assert host.oom_kills(cgroup) == 1
    with pytest.raises(HostError, match="vanished"):
        host.cgroup_of(6)
