"""Bind-mount sources resolved by the kernel beneath their root, and checked once mounted.

The policy's check of a bind source is lexical: the path must sit under one of the caller's
roots. That alone lets a sandbox leave its root: with a writable bind of ``/srv/ws/alice`` it
runs ``ln -s / /workspace/esc``, and the next create that mounts ``/srv/ws/alice/esc`` would get
the host's ``/``. Here the source is opened the way the kernel sees it:

- ``openat2`` from the root with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
  RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV``: no symlink (not even one that stays inside), no
  ``..``, no ``/proc`` magic link and no other mount on the way; where the kernel has no
  ``openat2`` (before 5.6, or a seccomp filter refusing it) the same walk one component at a
  time with ``O_PATH | O_NOFOLLOW``, refusing a symlink or a change of device at each step;
- the path handed to Docker is the root's own path joined with the components walked (none of
  them a symlink, so nothing for Docker to resolve differently), and the device and inode of
  what was opened are kept;
- once the container runs, the target inside it (``/proc/<pid>/root/<target>``) must be that
  same device and inode: a source swapped between the check and Docker's mount (a rename, a
  new symlink) is caught there, and the create is undone.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Protocol

from pydantic import ConfigDict

from slicebox.model.base import Model
from slicebox.model.errors import PolicyViolation

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
SYS_OPENAT2 = 437  # the same number on every architecture (added after the tables merged)
O_PATH_FLAGS = os.O_PATH | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class Pinned(Model):
    """A bind source as the kernel resolved it: its path without symlinks, and what it is."""

    model_config = ConfigDict(frozen=True)

    source: str  # the path Docker gets
    target: str  # where the sandbox sees it
    device: int
    inode: int


def root_for(source: PurePosixPath, roots: tuple[PurePosixPath, ...]) -> PurePosixPath | None:
    """The longest root ``source`` lies under, lexically (None when it lies under none)."""
    under = [root for root in roots if source.is_relative_to(root)]
    return max(under, key=lambda root: len(root.parts)) if under else None


def pin(source: str, target: str, roots: tuple[PurePosixPath, ...]) -> Pinned:
    """Open ``source`` beneath its root without following anything; PolicyViolation when it
    is not under a root, leaves its root, or does not exist."""
    path = PurePosixPath(source)
    root = root_for(path, roots) if path.is_absolute() else None
    if root is None:
        raise outside_roots(source, roots)
    relative = path.relative_to(root)
    if ".." in relative.parts:
        raise escape(source, "'..'")
    root_fd = _open(str(root), os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY, source)
    try:
        real_root = os.readlink(f"/proc/self/fd/{root_fd}")
        found = _stat_beneath(root_fd, relative, source) if relative.parts else os.fstat(root_fd)
    finally:
        os.close(root_fd)
    return Pinned(
        source=str(PurePosixPath(real_root, relative)),
        target=target,
        device=found.st_dev,
        inode=found.st_ino,
    )


def verify(pid: int, pinned: Pinned, proc: Path = Path("/proc")) -> None:
    """The sandbox whose init is ``pid`` sees ``pinned``'s source at its target; a
    PolicyViolation otherwise (the source changed between the check and the mount)."""
    inside = proc / str(pid) / "root" / pinned.target.lstrip("/")
    try:
        seen = os.stat(inside)
    except OSError as exc:
        raise _changed(pinned, f"the target cannot be read ({exc.strerror})") from exc
    if (seen.st_dev, seen.st_ino) != (pinned.device, pinned.inode):
        raise _changed(pinned, "another file is mounted there")


def _open(path: str, flags: int, source: str, dir_fd: int | None = None) -> int:
    """``os.open``, its failures told as refusals of ``source``."""
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise _missing(source) from exc
    except NotADirectoryError as exc:
        raise escape(source, "a component that is not a directory") from exc
    except OSError as exc:
        raise _unreadable(source, str(exc.strerror)) from exc


def _stat_beneath(root_fd: int, relative: PurePosixPath, source: str) -> os.stat_result:
    """What ``relative`` names below ``root_fd``, reached without following anything."""
    fd = _openat2(root_fd, str(relative))
    if fd >= 0:
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EPERM):  # no openat2 here: walk it one step at a time
        return _stat_walked(root_fd, relative, source)
    if code == errno.ENOENT:
        raise _missing(source)
    if code == errno.ELOOP:
        raise escape(source, "a symlink")
    if code == errno.EXDEV:
        raise escape(source, "another mount")
    if code == errno.ENOTDIR:
        raise escape(source, "a component that is not a directory")
    raise _unreadable(source, os.strerror(code))


def _openat2(dir_fd: int, path: str) -> int:
    how = _OpenHow(
        flags=O_PATH_FLAGS,
        mode=0,
        resolve=RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV,
    )
    return int(
        _libc.syscall(SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    )


def _stat_walked(root_fd: int, relative: PurePosixPath, source: str) -> os.stat_result:
    """``openat2``'s walk by hand: each component opened with O_NOFOLLOW from the last."""
    device = os.fstat(root_fd).st_dev
    fd = os.dup(root_fd)
    try:
        for part in relative.parts:
            step = _open(part, O_PATH_FLAGS | os.O_NOFOLLOW, source, dir_fd=fd)
            os.close(fd)
            fd = step
            found = os.fstat(fd)
            if stat.S_ISLNK(found.st_mode):
                raise escape(source, "a symlink")
            if found.st_dev != device:
                raise escape(source, "another mount")
        return found
    finally:
        os.close(fd)


def outside_roots(source: str, roots: tuple[PurePosixPath, ...]) -> PolicyViolation:
    where = ", ".join(str(root) for root in roots) or "(none configured: set bind_roots)"
    return _refused(
        f"bind mount {source!r} is outside the allowed roots {where}; mount a directory under "
        "one of them"
    )


def escape(source: str, through: str) -> PolicyViolation:
    return _refused(
        f"bind mount source {source!r} goes through {through} on its way down from its root; "
        "name the real directory, with no symlink, '..' or other mount on the way",
        code="mount_escape",
    )


def _missing(source: str) -> PolicyViolation:
    return _refused(
        f"bind mount source {source!r} does not exist; create it first (the agent never "
        "creates a bind source)",
        code="mount_source_missing",
    )


def _changed(pinned: Pinned, why: str) -> PolicyViolation:
    return _refused(
        f"bind mount source {pinned.source!r} changed while the sandbox was created ({why} at "
        f"{pinned.target}); nothing was kept: create it again, and keep the source still",
        code="mount_changed",
    )


def _unreadable(source: str, reason: str) -> PolicyViolation:
    return _refused(
        f"bind mount source {source!r} cannot be opened ({reason}); check that it exists and "
        "that the agent may read it"
    )


def _refused(message: str, code: str = "policy_mount") -> PolicyViolation:
    return PolicyViolation(message, code=code)


def ids_of(pid: int, proc: Path = Path("/proc")) -> tuple[int, int]:
    """The effective (uid, gid) of process ``pid``, as the kernel holds them (its status)."""
    uid = gid = None
    for line in (proc / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid"):
            effective = int(value.split()[1])
            uid, gid = (effective, gid) if key == "Uid" else (uid, effective)
    if uid is None or gid is None:
        raise OSError(f"{proc}/{pid}/status has no Uid or Gid line")
    return uid, gid


def own_mounted(
    pid: int, target: str, source: str, ids: tuple[int, int], proc: Path = Path("/proc")
) -> None:
    """Give the directory mounted at ``target`` in process ``pid``'s view (a fresh volume) to
    ``ids`` (uid, gid). It is reached through ``/proc/<pid>/root``, the sandbox's own mounts (the
    agent's view of the host is read-only), and only once its device and inode are those of
    ``source``, the volume's directory on the host: a symlink or anything else there is
    refused, never followed."""
    root = os.open(proc / str(pid) / "root", O_PATH_FLAGS | os.O_DIRECTORY)
    try:
        fd = os.open(
            target.lstrip("/"),
            os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
            dir_fd=root,
        )
    finally:
        os.close(root)
    try:
        seen, want = os.fstat(fd), os.stat(source, follow_symlinks=False)
        if (seen.st_dev, seen.st_ino) != (want.st_dev, want.st_ino):
            raise OSError(errno.EXDEV, f"{target} in the sandbox is not {source}")
        os.fchown(fd, *ids)
    finally:
        os.close(fd)


class BindGuard(Protocol):
    """How a create pins its bind sources and checks them once mounted, and the kernel's other
    answers a create needs (fakes in unit tests)."""

    def pin(self, source: str, target: str, roots: tuple[PurePosixPath, ...]) -> Pinned: ...

    def verify(self, pid: int, pinned: Pinned) -> None: ...

    def ids_of(self, pid: int) -> tuple[int, int]:
        """The effective (uid, gid) a sandbox's process runs as."""

    def own(self, pid: int, target: str, source: str, uid: int, gid: int) -> None:
        """Give a fresh volume, ``source`` on the host and mounted at ``target`` in the
        sandbox of process ``pid``, to the sandbox's uid:gid."""


class KernelBindGuard:
    """The real one: the functions above, on this host's kernel and ``/proc``."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc

    def pin(self, source: str, target: str, roots: tuple[PurePosixPath, ...]) -> Pinned:
        return pin(source, target, roots)

    def verify(self, pid: int, pinned: Pinned) -> None:
        verify(pid, pinned, self._proc)

    def ids_of(self, pid: int) -> tuple[int, int]:
        return ids_of(pid, self._proc)

    def own(self, pid: int, target: str, source: str, uid: int, gid: int) -> None:
        own_mounted(pid, target, source, (uid, gid), self._proc)
