"""A fast, racy-safe reader of cgroup v2 counters.

The OS boundary is :class:`CgroupFiles`: read one small file of one cgroup, list a cgroup's
child directories. :class:`CgroupFS` implements it over a directory (``/sys/fs/cgroup`` on a
real host, a temporary tree in tests). Everything else here is pure parsing on top of it.

A cgroup can vanish between listing and reading it (a sandbox destroyed mid-scan), a controller
can be disabled (the file is missing) and a limit can be ``max``. All three read as ``None``,
never ``0``: a zero is a real reading, a ``None`` says "no value".
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple, Protocol

from slicebox.model.paths import CGROUP_MOUNT

log = logging.getLogger(__name__)

DEFAULT_ROOT = CGROUP_MOUNT

# Errors that mean "this cgroup or file is gone or not there", not "the host is broken". A
# pressure file of a kernel whose PSI is off (``psi=0``) answers EOPNOTSUPP: no value either.
_VANISHED = frozenset({errno.ENOENT, errno.ENODEV, errno.ESRCH, errno.ENOTDIR, errno.EOPNOTSUPP})


class CgroupFiles(Protocol):
    """Reads of cgroup files, relative to the cgroup root (``""`` is the root itself)."""

    def read(self, cgroup: str, name: str) -> str | None:
        """The file's text, or None when the cgroup or the file is not there."""
        ...

    def children(self, cgroup: str) -> list[str]:
        """Names of the child cgroups; empty when the cgroup is not there."""
        ...


def populated(files: CgroupFiles, cgroup: str) -> bool:
    """Whether any process is in ``cgroup`` or beneath it (``cgroup.events``); False for a
    cgroup that is gone, as a container's scope is once its last process has exited."""
    events = files.read(cgroup, "cgroup.events")
    return events is not None and "populated 1" in events.splitlines()


class CgroupFS:
    """:class:`CgroupFiles` over a real directory. No subprocesses, one syscall per step.

    Paths are plain strings on purpose: pathlib's joining costs more than the read itself, and
    telemetry reads thousands of these small files per poll.
    """

    def __init__(self, root: Path | str = DEFAULT_ROOT) -> None:
        self.root = str(root).rstrip("/")

    def path(self, cgroup: str) -> str:
        relative = cgroup.strip("/")
        return f"{self.root}/{relative}" if relative else self.root

    def read(self, cgroup: str, name: str) -> str | None:
        try:
            fd = os.open(f"{self.path(cgroup)}/{name}", os.O_RDONLY)
        except OSError as exc:
            _vanished_or_raise(exc)
            return None
        try:
            # Every file read here is far below this size; one read gets all of it.
            return os.read(fd, 65536).decode()
        except OSError as exc:
            _vanished_or_raise(exc)
            return None
        finally:
            os.close(fd)

    def children(self, cgroup: str) -> list[str]:
        try:
            with os.scandir(self.path(cgroup)) as entries:
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except OSError as exc:
            _vanished_or_raise(exc)
            return []


def _vanished_or_raise(exc: OSError) -> None:
    if exc.errno not in _VANISHED:
        raise exc


# --- parsers: text -> values -----------------------------------------------------------------


def parse_value(text: str | None) -> int | None:
    """A single-value file (memory.current, memory.max, pids.max...): ``max`` is None."""
    if text is None:
        return None
    word = text.strip()
    if not word or word == "max":
        return None
    return int(word)


def parse_flat_keyed(text: str | None) -> dict[str, int] | None:
    """``key value`` lines (memory.events, cpu.stat, memory.stat, pids.events)."""
    if text is None:
        return None
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def parse_cpu_max(text: str | None) -> tuple[int | None, int] | None:
    """cpu.max ``$QUOTA $PERIOD``: (quota_usec or None for ``max``, period_usec)."""
    if text is None or not text.split():
        return None
    words = text.split()
    quota = None if words[0] == "max" else int(words[0])
    return quota, int(words[1]) if len(words) > 1 else 100_000


def parse_io_stat(text: str | None) -> dict[str, dict[str, int]] | None:
    """io.stat: ``MAJ:MIN key=value...`` per device."""
    if text is None:
        return None
    devices: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        device, *fields = line.split()
        pairs = (f.split("=", 1) for f in fields if "=" in f)
        devices[device] = {k: int(v) for k, v in pairs if v.isdigit()}
    return devices


def parse_pressure(text: str | None) -> dict[str, int] | None:
    """A PSI file (cpu.pressure, memory.pressure, io.pressure): each line's ``total`` stall
    time in microseconds by its kind (``some``, ``full``); a kind the kernel does not write is
    left out."""
    if text is None:
        return None
    totals: dict[str, int] = {}
    for line in text.splitlines():
        kind, *fields = line.split() or [""]
        for field in fields:
            key, _, value = field.partition("=")
            if key == "total" and value.isdigit():
                totals[kind] = int(value)
    return totals


# --- typed readings ------------------------------------------------------------------------


class MemoryEvents(NamedTuple):
    """memory.events or memory.events.local: how often each boundary was hit."""

    low: int = 0
    high: int = 0
    max: int = 0
    oom: int = 0
    oom_kill: int = 0
    oom_group_kill: int = 0

    @classmethod
    def from_map(cls, values: Mapping[str, int] | None) -> MemoryEvents | None:
        if values is None:
            return None
        names = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")
        return cls(**{n: values.get(n, 0) for n in names})


_CPU_STAT_KEYS = (
    "usage_usec",
    "user_usec",
    "system_usec",
    "nr_periods",
    "nr_throttled",
    "throttled_usec",
)


class CpuStat(NamedTuple):
    """cpu.stat. ``nr_throttled``/``throttled_usec`` count throttling by THIS level's quota."""

    usage_usec: int
    user_usec: int
    system_usec: int
    nr_periods: int
    nr_throttled: int
    throttled_usec: int

    @classmethod
    def from_map(cls, values: Mapping[str, int] | None) -> CpuStat | None:
        if values is None or "usage_usec" not in values:
            return None
        return cls(**{n: values.get(n, 0) for n in _CPU_STAT_KEYS})


class CgroupReader:
    """Typed reads of one cgroup's counters through a :class:`CgroupFiles`."""

    def __init__(self, files: CgroupFiles) -> None:
        self.files = files

    def value(self, cgroup: str, name: str) -> int | None:
        return parse_value(self.files.read(cgroup, name))

    def keyed(self, cgroup: str, name: str) -> dict[str, int] | None:
        return parse_flat_keyed(self.files.read(cgroup, name))

    def frozen(self, cgroup: str) -> bool | None:
        """Whether the cgroup is frozen now (a paused sandbox), from ``cgroup.events``."""
        events = self.keyed(cgroup, "cgroup.events")
        return None if events is None or "frozen" not in events else events["frozen"] == 1

    def memory_current(self, cgroup: str) -> int | None:
        return self.value(cgroup, "memory.current")

    def memory_peak(self, cgroup: str) -> int | None:
        return self.value(cgroup, "memory.peak")

    def memory_max(self, cgroup: str) -> int | None:
        return self.value(cgroup, "memory.max")

    def memory_high(self, cgroup: str) -> int | None:
        return self.value(cgroup, "memory.high")

    def memory_events(self, cgroup: str) -> MemoryEvents | None:
        """Hierarchical: events of this level and everything below it."""
        return MemoryEvents.from_map(self.keyed(cgroup, "memory.events"))

    def memory_events_local(self, cgroup: str) -> MemoryEvents | None:
        """This level only: ``oom``/``max`` here mean THIS level's limit was hit."""
        return MemoryEvents.from_map(self.keyed(cgroup, "memory.events.local"))

    def memory_stat(self, cgroup: str) -> dict[str, int] | None:
        return self.keyed(cgroup, "memory.stat")

    def cpu_stat(self, cgroup: str) -> CpuStat | None:
        return CpuStat.from_map(self.keyed(cgroup, "cpu.stat"))

    def cpu_usage_usec(self, cgroup: str) -> int | None:
        stat = self.cpu_stat(cgroup)
        return None if stat is None else stat.usage_usec

    def cpu_throttled_by_ancestors_usec(self, cgroup: str) -> int | None:
        """cpu.stat.local (kernel >= 6.8): time throttled by its own or an ancestor's quota."""
        local = self.keyed(cgroup, "cpu.stat.local")
        return None if local is None else local.get("throttled_usec")

    def cpu_max(self, cgroup: str) -> tuple[int | None, int] | None:
        return parse_cpu_max(self.files.read(cgroup, "cpu.max"))

    def cpu_quota_cpus(self, cgroup: str) -> float | None:
        """cpu.max as a number of CPUs; None when unlimited or unreadable."""
        limit = self.cpu_max(cgroup)
        if limit is None or limit[0] is None:
            return None
        return limit[0] / limit[1]

    def pressure(self, cgroup: str, resource: str) -> dict[str, int] | None:
        """``<resource>.pressure`` (cpu, memory, io): stall microseconds by kind; None where
        the kernel has no such file (no PSI, or it is off)."""
        return parse_pressure(self.files.read(cgroup, f"{resource}.pressure"))

    def pids_current(self, cgroup: str) -> int | None:
        return self.value(cgroup, "pids.current")

    def pids_peak(self, cgroup: str) -> int | None:
        return self.value(cgroup, "pids.peak")

    def pids_max(self, cgroup: str) -> int | None:
        return self.value(cgroup, "pids.max")

    def pids_events(self, cgroup: str) -> dict[str, int] | None:
        return self.keyed(cgroup, "pids.events")

    def io_stat(self, cgroup: str) -> dict[str, dict[str, int]] | None:
        return parse_io_stat(self.files.read(cgroup, "io.stat"))

    def io_bytes_written(self, cgroup: str) -> int | None:
        """Sum of ``wbytes`` over every device. A present but empty io.stat is a real 0."""
        devices = self.io_stat(cgroup)
        if devices is None:
            return None
        return sum(fields.get("wbytes", 0) for fields in devices.values())
