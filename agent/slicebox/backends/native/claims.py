"""Whether a pid the sandbox's init named may be moved into an exec's scope.

The init runs as the sandbox's user, and the sandbox's code can replace it: a pid it reports
must never make systemd move (or, with the scope, kill) a process outside the sandbox. So the
agent believes only the kernel: the pid comes from the hello's credentials (the kernel
translates the sender's pid into the agent's namespace and refuses a claimed pid that is not
the sender's own), and the process must still sit in the anchor's own cgroup, where only the
init and the children it has not yet handed over are (nothing of the sandbox can move a
process there: its cgroups are not delegated). A pidfd opened first pins the process: the
cgroup read is checked to be of that very process (still alive after the read), and systemd
is handed the pidfd, never the number, so a pid recycled meanwhile cannot be moved.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Protocol

from slicebox.backends.native.initwire import InitError

PROC = Path("/proc")


class Claims(Protocol):
    def claim(self, pid: int, cgroup: str) -> int:
        """A pidfd of process ``pid`` if it is in ``cgroup`` (below the cgroup root);
        InitError otherwise. The caller closes it."""


class ProcClaims:
    """:class:`Claims` on the host's /proc (the agent's PID and cgroup namespaces)."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc

    def claim(self, pid: int, cgroup: str) -> int:
        if pid <= 1:
            raise InitError(f"the sandbox's init named pid {pid}: refused")
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise InitError(f"the sandbox's exec process {pid} is gone: {exc}") from exc
        try:
            where = self.cgroup_of(pid)
            signal.pidfd_send_signal(pidfd, 0)  # still the pidfd's process: the read was its
        except OSError as exc:
            os.close(pidfd)
            raise InitError(f"the sandbox's exec process {pid} is gone: {exc}") from exc
        if where != cgroup:
            os.close(pidfd)
            raise InitError(
                f"the sandbox's init named pid {pid}, which is not its own new child "
                f"(its cgroup is {where!r}): refused"
            )
        return pidfd

    def cgroup_of(self, pid: int) -> str:
        """The process's cgroup v2 path; "" when it has none there."""
        for line in (self._proc / str(pid) / "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
        return ""
