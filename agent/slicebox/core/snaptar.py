"""The tar stream of a snapshot, rewritten as it passes.

A snapshot's stream is the container's exported root filesystem, its ``/workspace`` left out,
followed by its ``/workspace`` as the sandbox sees it (read from the frozen sandbox's mount
namespace, ``/proc/<pid>/root``, since the engine cannot see a tmpfs) at ``workspace/``: the
image's own ``/workspace``, which a fork runs with as it is (copy-on-write, no copy). Every
member passes :func:`clean`: no set-user-id or set-group-id bit, no device node and no extended
attribute (a file capability is one) gets into a snapshot, whoever the sandbox ran as.

The ``/workspace`` is walked while its sandbox is frozen, but not whatever shares it: a second
sandbox on the same volume may swap a directory for a symlink to ``/`` as the walk goes, and a
path resolved below ``/proc/<pid>/root`` resolves an absolute link against the agent's own
root, on the host. So nothing is resolved by path after the walk looked at it: each directory
is opened relative to its parent's descriptor, each entry relative to its directory's, with
``O_NOFOLLOW``; a member is made from the ``fstat`` of what was opened, a link is read with
``readlinkat`` and never followed, and what changed between the look and the open is left out.

Nothing is held whole: members are copied block by block into a :class:`Pipe`, which another
thread reads as the import's request body.
"""

from __future__ import annotations

import errno
import os
import queue
import stat
import tarfile
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, cast

SET_ID = stat.S_ISUID | stat.S_ISGID
CHUNK = 256 * 1024
DEPTH = 16  # chunks in flight between the threads: 4 MiB
WORKSPACE = "workspace"  # the sandbox's /workspace, in a snapshot's stream
# How the walk opens what it looked at, relative to its directory's descriptor: never through
# a link (O_NOFOLLOW), a fifo or device without waiting or becoming a terminal.
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# A name gone since the look, or no longer what it was (a link now: ELOOP, or ENOTDIR with
# O_DIRECTORY): left out, as a file removed a moment earlier would be.
GONE_OR_SWAPPED = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR})
KINDS = {  # what a walk records besides regular files; sockets and devices are left out
    stat.S_IFDIR: tarfile.DIRTYPE,
    stat.S_IFIFO: tarfile.FIFOTYPE,
    stat.S_IFLNK: tarfile.SYMTYPE,
}


def clean(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """``member`` as a snapshot may hold it, or None when it may not be kept at all."""
    if member.ischr() or member.isblk():
        return None
    member.mode &= ~SET_ID
    member.pax_headers = {
        key: value for key, value in member.pax_headers.items() if not key.startswith("SCHILY.")
    }
    return member


def ours(name: str) -> bool:
    """Whether a root filesystem's member is below ``/workspace``: the export holds what the
    image has there (a fork's, or a base image's that a tmpfs hid), and a snapshot writes what
    the sandbox saw there instead."""
    top = name.removeprefix("./").split("/")[0]
    return top == WORKSPACE


class Pipe:
    """Bytes written by one thread, read in chunks by another; either side can stop it.
    ``limit``: the most it carries; a write beyond it raises ``too_many`` (a sparse file's
    apparent size is written whole, so what a snapshot takes is known only as it is made)."""

    def __init__(
        self, limit: int | None = None, too_many: Callable[[int], Exception] | None = None
    ) -> None:
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(DEPTH)
        self._buffer = bytearray()
        self._abandoned = False
        self._limit, self._too_many = limit, too_many
        self.carried = 0

    def write(self, data: bytes) -> int:
        self.carried += len(data)
        if self._limit is not None and self.carried > self._limit:
            raise (self._too_many or OverflowError)(self._limit)
        self._buffer += data
        while len(self._buffer) >= CHUNK:
            self._put(bytes(self._buffer[:CHUNK]))
            del self._buffer[:CHUNK]
        return len(data)

    def close(self, error: BaseException | None = None) -> None:
        """The writer's end: the rest, then the end (or ``error``, raised to the reader)."""
        if error is None and self._buffer:
            self._put(bytes(self._buffer))
        self._buffer.clear()
        self._put(error)

    def abandon(self) -> None:
        """The reader's end: a writer blocked on a full pipe stops (``BrokenPipeError``)."""
        self._abandoned = True

    def __iter__(self) -> Iterator[bytes]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def get(self) -> bytes:
        """The next chunk; ``b""`` at the end."""
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item or b""

    def _put(self, item: bytes | BaseException | None) -> None:
        while not self._abandoned:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        raise BrokenPipeError("the reader of the snapshot's stream went away")


def producing(
    name: str,
    read: Callable[[Callable[[BinaryIO], None]], None],
    rewrite: Callable[[BinaryIO, Pipe], None],
    pipe: Pipe,
) -> tuple[Pipe, threading.Thread]:
    """``pipe`` fed on a thread of its own: ``read`` hands the stream it opens to ``rewrite``,
    which writes the pipe; an error ends the pipe with it, for its reader to raise."""

    def produce() -> None:
        try:
            read(lambda stream: rewrite(stream, pipe))
        except BaseException as exc:
            pipe.close(exc)
            return
        pipe.close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    return pipe, thread


def write_snapshot(export: BinaryIO, workspace: str, out: Pipe) -> None:
    """The snapshot's stream into ``out``: ``export`` (a root filesystem's tar) cleaned, then
    the tree at ``workspace`` as ``workspace/``, its own directory's owner and mode kept (a
    tmpfs's 1777, which lets a fork's user write there as the sandbox's could)."""
    with _writer(out) as tar:
        with tarfile.open(fileobj=export, mode="r|", bufsize=CHUNK) as rootfs:
            for member in rootfs:
                kept = None if ours(member.name) else clean(member)
                if kept is not None:
                    tar.addfile(kept, rootfs.extractfile(member) if kept.isreg() else None)
        top = open_tree(workspace)
        try:
            tar.addfile(_root(top))
            if top is not None:
                _Walk(tar, os.fstat(top).st_dev).directory(top, WORKSPACE)
        finally:
            if top is not None:
                os.close(top)


def add_tree(tar: tarfile.TarFile, root: str, arcroot: str) -> None:
    """Everything below ``root`` as ``arcroot/...`` (:func:`open_tree`, :class:`_Walk`);
    nothing when there is no directory ``root``."""
    top = open_tree(root)
    if top is None:
        return
    try:
        _Walk(tar, os.fstat(top).st_dev).directory(top, arcroot)
    finally:
        os.close(top)


def open_tree(root: str) -> int | None:
    """A descriptor of the directory ``root``, its last component opened without following a
    link (None when it is none). What is above it is the agent's to trust: ``/proc/<pid>/root``,
    which the kernel resolves to the sandbox's own root; the last component is the sandbox's
    (a fork's ``/workspace`` is a plain directory it may swap for a link)."""
    parent, name = os.path.split(root.rstrip("/"))
    try:
        above = os.open(parent or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return _opened(name, above, O_DIR)
    finally:
        os.close(above)


class _Walk:
    """A tree into ``tar``, below the open directory it starts from, on ``device`` only.

    Each entry is decided by one look (``fstatat``, no link followed) and then opened relative
    to its directory's descriptor with ``O_NOFOLLOW``: a name the sandbox swapped meanwhile (a
    directory for a link) fails to open and is left out. Nothing is resolved by path again,
    so nothing outside the tree is reachable; another mount (a credentials mount below it) is
    left out by its device."""

    def __init__(self, tar: tarfile.TarFile, device: int) -> None:
        self.tar, self.device = tar, device
        self.inodes: dict[tuple[int, int], str] = {}  # each file's first name in the stream

    def directory(self, fd: int, arcroot: str) -> None:
        """The entries of the open directory ``fd``, in name order."""
        with os.scandir(fd) as listing:
            entries = sorted(listing, key=lambda e: e.name)
        for entry in entries:
            try:
                looked = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if looked.st_dev == self.device:
                self._add(fd, entry.name, looked, f"{arcroot}/{entry.name}")

    def _add(self, directory: int, name: str, looked: os.stat_result, arcname: str) -> None:
        if stat.S_ISDIR(looked.st_mode):
            self._subdirectory(directory, name, arcname)
        elif stat.S_ISREG(looked.st_mode):
            self._file(directory, name, arcname)
        elif stat.S_ISLNK(looked.st_mode):
            self._link(directory, name, looked, arcname)
        else:  # a fifo is a member of its own; a socket or a device is none
            self._put(_member(looked, arcname))

    def _subdirectory(self, directory: int, name: str, arcname: str) -> None:
        fd = _opened(name, directory, O_DIR)
        if fd is None:
            return
        try:
            opened = os.fstat(fd)
            if opened.st_dev == self.device:
                self._put(_member(opened, arcname))
                self.directory(fd, arcname)
        finally:
            os.close(fd)

    def _file(self, directory: int, name: str, arcname: str) -> None:
        fd = _opened(name, directory, O_FILE)
        if fd is None:
            return
        with os.fdopen(fd, "rb") as file:
            opened = os.fstat(fd)
            if stat.S_ISREG(opened.st_mode) and opened.st_dev == self.device:
                member = self._file_member(opened, arcname)
                self._put(member, file if member.isreg() else None)

    def _link(self, directory: int, name: str, looked: os.stat_result, arcname: str) -> None:
        """A symbolic link as a link: its target read relative to ``directory``
        (readlinkat), never followed; one swapped for something else meanwhile is left out."""
        try:
            target = os.readlink(name, dir_fd=directory)
        except OSError:
            return
        self._put(_member(looked, arcname, target))

    def _file_member(self, found: os.stat_result, arcname: str) -> tarfile.TarInfo:
        """A regular file's member; a second name of a file already in the stream is a hard
        link to the first, as ``TarFile.gettarinfo`` makes it."""
        inode = (found.st_ino, found.st_dev)
        first = self.inodes.get(inode)
        if found.st_nlink > 1 and first is not None and first != arcname:
            member = _stated(tarfile.TarInfo(arcname), found)
            member.type, member.linkname = tarfile.LNKTYPE, first
            return member
        self.inodes[inode] = arcname
        member = _stated(tarfile.TarInfo(arcname), found)
        member.size = found.st_size
        return member

    def _put(self, member: tarfile.TarInfo | None, file: BinaryIO | None = None) -> None:
        kept = clean(member) if member is not None else None
        if kept is not None:
            self.tar.addfile(kept, file)


def _opened(name: str, directory: int, flags: int) -> int | None:
    """``name`` opened relative to ``directory``; None when it is gone, or is no longer what
    ``flags`` open (a link where a directory or a file was: ``O_NOFOLLOW`` refuses it)."""
    try:
        return os.open(name, flags, dir_fd=directory)
    except OSError as exc:
        if exc.errno in GONE_OR_SWAPPED:
            return None
        raise


def _member(found: os.stat_result, arcname: str, target: str = "") -> tarfile.TarInfo | None:
    """The member of a directory, fifo or link ``found`` describes (an opened descriptor's
    ``fstat``, or a link's or fifo's look); None for a socket or a device."""
    kind = KINDS.get(stat.S_IFMT(found.st_mode))
    if kind is None:
        return None
    member = _stated(tarfile.TarInfo(arcname), found)
    member.type, member.linkname = kind, target
    return member


def _stated(member: tarfile.TarInfo, found: os.stat_result) -> tarfile.TarInfo:
    """``member`` with ``found``'s mode, owner and time, as ``TarFile.gettarinfo`` sets them
    but with no name looked up in the host's user database: a sandbox's ids are its own."""
    member.mode = stat.S_IMODE(found.st_mode)
    member.uid, member.gid, member.mtime = found.st_uid, found.st_gid, int(found.st_mtime)
    return member


def _writer(out: Pipe) -> tarfile.TarFile:
    # Copies in CHUNKs, not tarfile's 16 KiB: a 100 MiB workspace is 400 writes, not 6400.
    # (typeshed's overloads of open lack copybufsize, which TarFile takes since 3.8.)
    opener: Any = tarfile.open
    return cast(
        tarfile.TarFile,
        opener(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK, copybufsize=CHUNK),
    )


def _root(top: int | None) -> tarfile.TarInfo:
    """The ``workspace/`` directory itself: as the sandbox's was (the opened directory's
    ``fstat``), or an empty tmpfs's (1777, root's) when it had none."""
    found = _member(os.fstat(top), WORKSPACE) if top is not None else None
    kept = clean(found) if found is not None else None
    if kept is not None:
        return kept
    member = tarfile.TarInfo(WORKSPACE)
    member.type = tarfile.DIRTYPE
    member.mode = 0o1777
    return member
