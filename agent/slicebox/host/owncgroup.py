"""The agent's own cgroup, and the memory limit it runs under (its unit's ``MemoryMax=``).

The limit that bites is the smallest ``memory.max`` on the way from the agent's cgroup up to the
root: its service's own, or a slice's above it. A limit of ``max``, a missing file and an
unreadable ``/proc/self/cgroup`` (no cgroup v2) all read as "no limit", ``None``.
"""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath

from slicebox.host.cgroupfs import CgroupFiles, CgroupFS, parse_value

log = logging.getLogger(__name__)

PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def parse_proc_cgroup(text: str) -> str | None:
    """The cgroup v2 path in a ``/proc/<pid>/cgroup`` text (its ``0::/path`` line)."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or None
    return None


def memory_limit(files: CgroupFiles, cgroup: str) -> int | None:
    """The smallest memory.max of ``cgroup`` and its ancestors; None when none is set."""
    path = PurePosixPath("/", cgroup)
    limits = (parse_value(files.read(str(p), "memory.max")) for p in (path, *path.parents))
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def agent_memory_max(
    files: CgroupFiles | None = None, proc_cgroup: Path = PROC_SELF_CGROUP
) -> int | None:
    """The memory limit this process runs under, or None when it has none (or cannot tell)."""
    try:
        cgroup = parse_proc_cgroup(proc_cgroup.read_text())
    except OSError as exc:
        log.info("cannot read %s (%s): no memory limit known", proc_cgroup, exc.strerror)
        return None
    if cgroup is None:
        return None
    return memory_limit(files or CgroupFS(), cgroup)
