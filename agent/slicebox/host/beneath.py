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
- the root itself is reached from ``/`` the same way, one component at a time with
  ``O_NOFOLLOW`` (:func:`open_root`): no symlink anywhere on its path, each directory above the
  user's own one (``{user}`` in the configured root) root's and writable by nobody else (or
  sticky, as ``/tmp``: then nobody can rename root's entries in it), and the user's own
  directory the user's. A root a user could redirect (``/home/{user}/sandboxes`` with that
  user swapping ``sandboxes`` for a link to ``/``) is refused, ``bind_root_unsafe``;
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

from slicebox.host.staging import Stager
from slicebox.model.base import Model
from slicebox.model.errors import PolicyViolation

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
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


class BindRoot(Model):
    """A caller's bind root and who may hold each directory on its path (``open_root``)."""

    model_config = ConfigDict(frozen=True)

    path: PurePosixPath  # with the caller's name for ``{user}``
    user_part: int | None = None  # the index in ``path.parts`` of the caller's own directory
    uid: int | None = None  # the caller's uid: who owns that directory
    top: str = "/"  # where the walk starts (tests: their own tree)
    trusted: int = 0  # who owns every directory above the caller's own one


def bind_roots(
    templates: tuple[PurePosixPath, ...], user: str, uid: int | None
) -> tuple[BindRoot, ...]:
    """The configured roots (``{user}`` in one component, or none) as ``user``'s."""
    return tuple(_bind_root(template, user, uid) for template in templates)


def _bind_root(template: PurePosixPath, user: str, uid: int | None) -> BindRoot:
    parts = template.parts
    at = next((i for i, part in enumerate(parts) if "{user}" in part), None)
    path = PurePosixPath(*(part.replace("{user}", user) for part in parts))
    return BindRoot(path=path, user_part=at, uid=uid)


def unsafe_roots(
    templates: tuple[PurePosixPath, ...], top: str = "/", trusted: int = 0
) -> list[str]:
    """What is wrong with the part of each configured root above ``{user}`` (the whole root
    without one), as the agent walks it (``open_root``): said in the log when the config is
    loaded, since every bind under such a root is refused."""
    problems = []
    for template in templates:
        parts = template.parts
        at = next((i for i, part in enumerate(parts) if "{user}" in part), len(parts))
        fixed = BindRoot(path=PurePosixPath(*parts[:at]), top=top, trusted=trusted)
        if found := root_problem(fixed):
            problems.append(f"{template}: {found[0]}")
    return problems


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


def pin(source: str, target: str, roots: tuple[BindRoot, ...]) -> Pinned:
    """Open ``source`` beneath its root without following anything, the root itself reached
    from ``/`` without following anything either (``open_root``); PolicyViolation when it is
    not under a root, leaves its root, does not exist, or its root is not safe."""
    path = PurePosixPath(source)
    paths = tuple(root.path for root in roots)
    found_root = root_for(path, paths) if path.is_absolute() else None
    if found_root is None:
        raise outside_roots(source, paths)
    relative = path.relative_to(found_root)
    if ".." in relative.parts:
        raise escape(source, "'..'")
    root_fd = open_root(roots[paths.index(found_root)], source)
    try:
        found = _stat_beneath(root_fd, relative, source) if relative.parts else os.fstat(root_fd)
    finally:
        os.close(root_fd)
    return Pinned(source=str(path), target=target, device=found.st_dev, inode=found.st_ino)


def open_root(root: BindRoot, source: str) -> int:
    """An ``O_PATH`` descriptor of ``root``'s directory, reached from its top one component at
    a time with ``O_NOFOLLOW``, each directory held as ``root`` says (``held_wrongly``)."""
    try:
        return _walk_root(root)
    except _Unsafe as unsafe:
        raise unsafe_root(source, root.path, unsafe.why) from None
    except OSError as exc:
        raise _unreadable(source, str(exc.strerror)) from exc


def root_problem(root: BindRoot) -> tuple[str, bool] | None:
    """What makes ``root`` unsafe, and whether that is only a missing directory (``slicebox
    doctor``); None when it is safe."""
    try:
        os.close(_walk_root(root))
    except _Unsafe as unsafe:
        return unsafe.why, unsafe.missing
    except OSError as exc:
        return f"{root.path} cannot be read ({exc.strerror})", False
    return None


class _Unsafe(Exception):
    def __init__(self, why: str, *, missing: bool = False) -> None:
        super().__init__(why)
        self.why, self.missing = why, missing


def _walk_root(root: BindRoot) -> int:
    top = PurePosixPath(root.top)
    if not root.path.is_relative_to(top):
        raise _Unsafe(f"it is not under {top}")
    fd = os.open(top, O_PATH_FLAGS | os.O_DIRECTORY)
    try:
        found, walked = os.fstat(fd), top
        for index, part in enumerate(root.path.parts[len(top.parts) :], start=len(top.parts)):
            if problem := held_wrongly(root, index - 1, found, walked):
                raise _Unsafe(problem)
            step = _open_step(part, fd, walked / part)
            os.close(fd)
            fd, walked = step, walked / part
            found = os.fstat(fd)
            if stat.S_ISLNK(found.st_mode):
                raise _Unsafe(f"{walked} is a symlink")
        if problem := held_wrongly(root, len(root.path.parts) - 1, found, walked):
            raise _Unsafe(problem)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_step(part: str, fd: int, walked: PurePosixPath) -> int:
    try:
        return os.open(part, O_PATH_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    except FileNotFoundError as exc:
        raise _Unsafe(f"{walked} does not exist", missing=True) from exc


def held_wrongly(
    root: BindRoot, index: int, found: os.stat_result, walked: PurePosixPath
) -> str | None:
    """What is wrong with the directory ``walked`` (``root.path.parts[index]``), if anything:
    not a directory; above the caller's own one, not ``root.trusted``'s or writable by group
    or others without the sticky bit; the caller's own one, not the caller's."""
    if not stat.S_ISDIR(found.st_mode):
        return f"{walked} is not a directory"
    if root.user_part is not None and index > root.user_part:
        return None  # the caller's own tree: the walk beneath it follows nothing
    if root.user_part is not None and index == root.user_part:
        mine = root.uid is None or found.st_uid == root.uid
        return None if mine else f"{walked} is owned by uid {found.st_uid}, not the user's"
    if found.st_uid != root.trusted:
        return f"{walked} is owned by uid {found.st_uid}, not root"
    writable = found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not found.st_mode & stat.S_ISVTX:
        return f"{walked} is writable by its group or others"
    return None


def verify(pid: int, pinned: Pinned, proc: Path = Path("/proc")) -> None:
    """The sandbox whose init is ``pid`` sees ``pinned``'s source at its target; a
    PolicyViolation otherwise (the source changed between the check and the mount). The target
    is reached inside the sandbox's root without following any symlink there: a link the image
    put at the target (an absolute one would resolve against the agent's root, not the
    sandbox's) is refused, never followed."""
    try:
        seen = _stat_inside(proc / str(pid) / "root", pinned.target)
    except OSError as exc:
        raise _changed(pinned, f"the target cannot be read ({exc.strerror})") from exc
    if (seen.st_dev, seen.st_ino) != (pinned.device, pinned.inode):
        raise _changed(pinned, "another file is mounted there")


def _stat_inside(root: Path, target: str) -> os.stat_result:
    """What ``target`` is in the file tree whose root is ``root``, no symlink followed."""
    root_fd = os.open(root, O_PATH_FLAGS | os.O_DIRECTORY)
    try:
        how = _OpenHow(
            flags=O_PATH_FLAGS,
            mode=0,
            resolve=RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
        )
        relative = target.lstrip("/") or "."
        fd = int(
            _libc.syscall(
                SYS_OPENAT2, root_fd, os.fsencode(relative), ctypes.byref(how), ctypes.sizeof(how)
            )
        )
        code = ctypes.get_errno() if fd < 0 else 0
        if code in (errno.ENOSYS, errno.EPERM):
            fd = _walk_inside(root_fd, PurePosixPath(relative))
        elif fd < 0:
            raise OSError(code, os.strerror(code))
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)


def _walk_inside(root_fd: int, relative: PurePosixPath) -> int:
    """``_stat_inside``'s walk where the kernel has no ``openat2``: O_NOFOLLOW each step."""
    if ".." in relative.parts:
        raise OSError(errno.EXDEV, "'..' in a sandbox's target")
    fd = os.dup(root_fd)
    for part in relative.parts:
        try:
            step = os.open(part, O_PATH_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = step
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.ELOOP, "a symlink")
    return fd


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


def unsafe_root(source: str, root: PurePosixPath, why: str) -> PolicyViolation:
    return _refused(
        f"bind mount {source!r} is under the bind root {str(root)!r}, which the agent does not "
        f"trust: {why}; every directory above the user's own one must be root's and writable "
        "by nobody else, with no symlink on the way (ask the operator: `slicebox doctor`)",
        code="bind_root_unsafe",
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

    def pin(self, source: str, target: str, roots: tuple[BindRoot, ...]) -> Pinned: ...

    def verify(self, pid: int, pinned: Pinned) -> None: ...

    def ids_of(self, pid: int) -> tuple[int, int]:
        """The effective (uid, gid) a sandbox's process runs as."""

    def own(self, pid: int, target: str, source: str, uid: int, gid: int) -> None:
        """Give a fresh volume, ``source`` on the host and mounted at ``target`` in the
        sandbox of process ``pid``, to the sandbox's uid:gid."""

    def stage(self, sandbox_id: str, pinned: tuple[Pinned, ...]) -> tuple[str, ...]:
        """Each pinned source bound onto a root-owned staging point, the points in order: the
        paths Docker gets (host.staging); ``mount_changed`` when one is no longer what was
        pinned."""

    def unstage(self, sandbox_id: str, *, wait: bool = False) -> None:
        """Remove ``sandbox_id``'s staging points (once its sandbox runs, or failed): after
        the call returns unless ``wait`` (the reaper's sweep, whose pass says it is done)."""

    def staged(self) -> list[str]:
        """The sandbox ids that have staging points (the reaper's: orphans of a killed
        agent)."""


class KernelBindGuard:
    """The real one: the functions above, on this host's kernel and ``/proc``."""

    def __init__(self, proc: Path = Path("/proc"), stager: Stager | None = None) -> None:
        self._proc = proc
        self._stager = stager or Stager()

    def pin(self, source: str, target: str, roots: tuple[BindRoot, ...]) -> Pinned:
        return pin(source, target, roots)

    def verify(self, pid: int, pinned: Pinned) -> None:
        verify(pid, pinned, self._proc)

    def ids_of(self, pid: int) -> tuple[int, int]:
        return ids_of(pid, self._proc)

    def own(self, pid: int, target: str, source: str, uid: int, gid: int) -> None:
        own_mounted(pid, target, source, (uid, gid), self._proc)

    def stage(self, sandbox_id: str, pinned: tuple[Pinned, ...]) -> tuple[str, ...]:
        return self._stager.stage(sandbox_id, [(p.source, p.device, p.inode) for p in pinned])

    def unstage(self, sandbox_id: str, *, wait: bool = False) -> None:
        if wait:
            self._stager.unstage(sandbox_id)
        else:
            self._stager.unstage_later(sandbox_id)

    def staged(self) -> list[str]:
        return self._stager.staged()
