"""Is this a real host for slicebox (systemd as PID 1, cgroup v2 with controllers, Docker)?"""

from __future__ import annotations

import functools
from pathlib import Path

REQUIRED_CONTROLLERS = frozenset({"cpu", "memory", "pids", "io"})


@functools.cache
def real_host_problem() -> str | None:
    """None on a real host, else what is missing."""
    comm = Path("/proc/1/comm").read_text().strip()
    if comm != "systemd":
        return f"PID 1 is {comm!r}, not systemd"
    controllers_file = Path("/sys/fs/cgroup/cgroup.controllers")
    if not controllers_file.exists():
        return "/sys/fs/cgroup is not a cgroup v2 mount"
    missing = REQUIRED_CONTROLLERS - set(controllers_file.read_text().split())
    if missing:
        return f"cgroup v2 lacks controllers {sorted(missing)}"
    if not Path("/run/docker.sock").exists():
        return "no Docker engine at /run/docker.sock"
    return None
