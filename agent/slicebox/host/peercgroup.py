"""Which cgroup the process at the other end of a unix socket is in, as the kernel says.

A nested sandbox's socket (``server.inner``) serves the processes of that sandbox alone: the
directory it lives in is bound into that sandbox only, but a path can be learned (a shared
volume, a kept workspace, ``/proc/<pid>/root`` of a process one may trace), so the agent asks
the kernel where the connecting process is. SO_PEERCRED names the process that connected;
its cgroup is read from ``/proc/<pid>/cgroup``, and a pidfd of the same process (SO_PEERPIDFD,
Linux 6.5) says afterwards that it had not exited meanwhile: a pid freed and reused between
the two reads cannot pass for the peer.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from pathlib import Path

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_UCRED = struct.Struct("3i")
_INT = struct.Struct("i")
PROC = Path("/proc")


def peer_cgroup(sock: socket.socket, proc: Path = PROC) -> str | None:
    """The cgroup v2 path (below the cgroup root, leading ``/``) of the peer of a connected unix
    socket; None when the kernel cannot say (the peer is gone, not a unix socket peer, or the
    kernel predates pidfds of peers and the pid no longer names it)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid = _UCRED.unpack(raw)[0]
    if pid <= 0:
        return None
    pidfd = _peer_pidfd(sock, pid)
    if pidfd is None:
        return None
    try:
        path = _cgroup_of(pid, proc)
        return path if path is not None and _alive(pidfd) else None
    finally:
        os.close(pidfd)


def _peer_pidfd(sock: socket.socket, pid: int) -> int | None:
    """A pidfd of the peer: the kernel's (SO_PEERPIDFD); on a kernel without it, one opened by
    the pid, which is the peer's unless it exited and its pid was reused between the connect
    and this open (a window the kernel's pidfd closes)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, _INT.size)
        return int(_INT.unpack(raw)[0])
    except OSError:
        pass
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _cgroup_of(pid: int, proc: Path) -> str | None:
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _alive(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0)


def within(cgroup: str, scope: str) -> bool:
    """Whether the cgroup ``cgroup`` is ``scope`` or below it (both below the root)."""
    cgroup, scope = "/" + cgroup.strip("/"), "/" + scope.strip("/")
    return cgroup == scope or cgroup.startswith(scope.rstrip("/") + "/")
