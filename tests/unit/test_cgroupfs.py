"""The cgroup v2 reader over a temporary tree: parsing, and None (never 0) for no value."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from slicebox.host.cgroupfs import (
    CgroupFS,
    CgroupReader,
    CpuStat,
    MemoryEvents,
    parse_cpu_max,
    parse_flat_keyed,
    parse_io_stat,
    parse_value,
)

SCOPE = "slicebox.slice/slicebox-u.slice/slicebox-u-p.slice/docker-abc.scope"

CPU_STAT = """usage_usec 2500000
user_usec 2000000
system_usec 500000
nr_periods 40
nr_throttled 7
throttled_usec 350000
nr_bursts 0
burst_usec 0
"""

IO_STAT = """254:0 rbytes=1552384 wbytes=52428800 rios=19 wios=400 dbytes=0 dios=0
254:16 rbytes=0 wbytes=4096 rios=0 wios=1 dbytes=0 dios=0
"""


def write(root: Path, cgroup: str, files: dict[str, str]) -> None:
    directory = root / cgroup
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


@pytest.fixture
def reader(tmp_path: Path) -> CgroupReader:
    write(
        tmp_path,
        SCOPE,
        {
            "memory.current": "104857600\n",
            "memory.peak": "209715200\n",
            "memory.max": "max\n",
            "memory.high": "max\n",
            "memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n",
            "memory.events.local": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 1\noom_group_kill 0\n",
            "cpu.stat": CPU_STAT,
            "cpu.stat.local": "throttled_usec 900\n",
            "cpu.max": "50000 100000\n",
            "pids.current": "3\n",
            "pids.peak": "9\n",
            "pids.max": "100\n",
            "pids.events": "max 2\n",
            "io.stat": IO_STAT,
        },
    )
    return CgroupReader(CgroupFS(tmp_path))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("123\n", 123), ("0\n", 0), ("max\n", None), ("", None), (None, None)],
)
def test_parse_value_max_and_missing_are_none_zero_is_zero(
    text: str | None, expected: int | None
) -> None:
    assert parse_value(text) == expected


def test_parse_flat_keyed_and_cpu_max_and_io_stat() -> None:
    assert parse_flat_keyed("a 1\nb 22\n") == {"a": 1, "b": 22}
    assert parse_flat_keyed(None) is None
    assert parse_cpu_max("max 100000\n") == (None, 100000)
    assert parse_cpu_max("25000 100000\n") == (25000, 100000)
    assert parse_cpu_max(None) is None
    assert parse_io_stat("") == {}
    stat = parse_io_stat(IO_STAT)
    assert stat is not None
    assert stat["254:0"]["wbytes"] == 52428800


def test_reads_every_counter_of_a_scope(reader: CgroupReader) -> None:
    assert reader.memory_current(SCOPE) == 100 * 1024 * 1024
    assert reader.memory_peak(SCOPE) == 200 * 1024 * 1024
    assert reader.memory_max(SCOPE) is None
    assert reader.memory_high(SCOPE) is None
    assert reader.memory_events(SCOPE) == MemoryEvents(max=3, oom=1, oom_kill=1)
    assert reader.memory_events_local(SCOPE) == MemoryEvents(oom_kill=1)
    assert reader.cpu_stat(SCOPE) == CpuStat(2500000, 2000000, 500000, 40, 7, 350000)
    assert reader.cpu_usage_usec(SCOPE) == 2500000
    assert reader.cpu_throttled_by_ancestors_usec(SCOPE) == 900
    assert reader.cpu_quota_cpus(SCOPE) == 0.5
    assert (reader.pids_current(SCOPE), reader.pids_peak(SCOPE)) == (3, 9)
    assert reader.pids_max(SCOPE) == 100
    assert reader.pids_events(SCOPE) == {"max": 2}
    assert reader.io_bytes_written(SCOPE) == 52428800 + 4096


def test_vanished_cgroup_reads_none_everywhere(reader: CgroupReader) -> None:
    gone = SCOPE.replace("abc", "gone")
    assert reader.memory_current(gone) is None
    assert reader.memory_events(gone) is None
    assert reader.cpu_stat(gone) is None
    assert reader.cpu_quota_cpus(gone) is None
    assert reader.pids_max(gone) is None
    assert reader.io_bytes_written(gone) is None
    assert reader.files.children(gone) == []


def test_missing_controller_file_is_none_but_empty_io_stat_is_zero(tmp_path: Path) -> None:
    write(tmp_path, "a.slice", {"io.stat": "", "memory.current": "0\n"})
    reader = CgroupReader(CgroupFS(tmp_path))
    assert reader.io_bytes_written("a.slice") == 0
    assert reader.memory_current("a.slice") == 0
    assert reader.pids_current("a.slice") is None
    assert reader.cpu_max("a.slice") is None


def test_enodev_reads_as_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "a.slice", {"memory.current": "5\n"})

    def no_device(fd: int, size: int) -> bytes:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(os, "read", no_device)
    assert CgroupReader(CgroupFS(tmp_path)).memory_current("a.slice") is None


def test_other_os_errors_are_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "a.slice", {"memory.current": "5\n"})

    def broken(fd: int, size: int) -> bytes:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "read", broken)
    with pytest.raises(OSError, match="I/O error"):
        CgroupReader(CgroupFS(tmp_path)).memory_current("a.slice")


def test_children_lists_only_directories_sorted(tmp_path: Path) -> None:
    write(tmp_path, "m.slice/b.slice", {})
    write(tmp_path, "m.slice/a.slice", {})
    write(tmp_path, "m.slice", {"memory.current": "1\n"})
    assert CgroupFS(tmp_path).children("m.slice") == ["a.slice", "b.slice"]
