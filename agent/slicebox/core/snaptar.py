"""The tar stream of a snapshot, rewritten as it passes.

A snapshot's stream is the container's exported root filesystem, its ``/workspace`` left out,
followed by its ``/workspace`` as the sandbox sees it (read from the frozen sandbox's mount
namespace, ``/proc/<pid>/root``, since the engine cannot see a tmpfs) at ``workspace/``: the
image's own ``/workspace``, which a fork runs with as it is (copy-on-write, no copy). Every
member passes :func:`clean`: no set-user-id or set-group-id bit, no device node and no extended
attribute (a file capability is one) gets into a snapshot, whoever the sandbox ran as.

Nothing is held whole: members are copied block by block into a :class:`Pipe`, which another
thread reads as the import's request body.
"""

from __future__ import annotations

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
        tar.addfile(_root(tar, workspace))
        add_tree(tar, workspace, WORKSPACE)


def add_tree(tar: tarfile.TarFile, root: str, arcroot: str) -> None:
    """Everything below ``root`` as ``arcroot/...``, without following a symbolic link and
    without crossing into another mount (a credentials mount below it stays out); nothing when
    there is no directory ``root``."""
    try:
        found = os.lstat(root)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(found.st_mode):
        return
    device = found.st_dev
    for path, arcname in _walk(root, arcroot, device):
        _add(tar, path, arcname)


def _walk(root: str, arcroot: str, device: int) -> Iterator[tuple[str, str]]:
    with os.scandir(root) as entries:
        found = sorted(entries, key=lambda e: e.name)
    for entry in found:
        info = entry.stat(follow_symlinks=False)
        if info.st_dev != device:
            continue
        arcname = f"{arcroot}/{entry.name}"
        yield entry.path, arcname
        if stat.S_ISDIR(info.st_mode):
            yield from _walk(entry.path, arcname, device)


def _add(tar: tarfile.TarFile, path: str, arcname: str) -> None:
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        member = tar.gettarinfo(path, arcname)
        kept = clean(member) if member is not None else None
        if kept is not None:
            tar.addfile(kept)
        return
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        member = tar.gettarinfo(arcname=arcname, fileobj=file)
        kept = clean(member)
        if kept is not None:
            tar.addfile(kept, file)


def _writer(out: Pipe) -> tarfile.TarFile:
    # Copies in CHUNKs, not tarfile's 16 KiB: a 100 MiB workspace is 400 writes, not 6400.
    # (typeshed's overloads of open lack copybufsize, which TarFile takes since 3.8.)
    opener: Any = tarfile.open
    return cast(
        tarfile.TarFile,
        opener(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK, copybufsize=CHUNK),
    )


def _root(tar: tarfile.TarFile, workspace: str) -> tarfile.TarInfo:
    """The ``workspace/`` directory itself: as the sandbox's was, or an empty tmpfs's (1777,
    root's) when it had none."""
    try:
        found = tar.gettarinfo(workspace, WORKSPACE)  # lstat: a link is not followed
    except FileNotFoundError:
        found = None
    kept = clean(found) if found is not None and found.isdir() else None
    if kept is not None:
        return kept
    member = tarfile.TarInfo(WORKSPACE)
    member.type = tarfile.DIRTYPE
    member.mode = 0o1777
    return member
