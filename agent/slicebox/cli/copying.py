"""``slicebox cp``: files between this machine and a sandbox, as ``docker cp`` moves them.

    slicebox cp ./src sbx-0123:/workspace/src     # a directory or a file, in
    slicebox cp sbx-0123:/workspace/out ./out     # and out
    tar -c . | slicebox cp - sbx-0123:/workspace  # a tar on stdin, extracted into a directory
    slicebox cp sbx-0123:/workspace/out - | tar -t

One side is ``SANDBOX:PATH`` (an absolute path inside the sandbox), the other a local path or
``-``. As with ``docker cp``: a destination that is a directory receives the source under its
own name; one that does not exist (or, for a file, is a file) becomes the copy's name; a
destination ending in ``/`` is always a directory. The sandbox is asked what its destination is
(``files/stat``) before anything is sent.

Everything moves as a tar stream, made and read as it goes: a local directory is walked and
sent file by file in pieces (:func:`tar_pieces`, no temporary archive), and what comes back is
extracted as it arrives (``tarfile`` in stream mode, with the ``data`` filter: no absolute
names, nothing outside the destination, no devices). A copy still going after a moment shows
its bytes on stderr (:mod:`slicebox.cli.progress`: a bar on a terminal, plain lines
otherwise; nothing with ``-q`` or ``--json``).
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import sys
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from slicebox.cli.progress import Bytes
from slicebox.client import Client
from slicebox.model.errors import InvalidRequest, NotFound
from slicebox.model.files import FileKind

PIECE = 64 * 1024
BLOCK = tarfile.BLOCKSIZE
PROGRESS_EVERY = 0.25  # seconds between progress lines


class Location(NamedTuple):
    """One side of a copy: ``sandbox`` None is this machine (``path`` ``-``: stdin/stdout)."""

    path: str
    sandbox: str | None = None


def parse_location(text: str) -> Location:
    """``ID:/path`` is a sandbox's; anything with a ``/`` before its first ``:`` (``./a:b``)
    or without one is local, as docker cp reads its arguments."""
    head, sep, tail = text.partition(":")
    if sep and head and "/" not in head:
        if not tail.startswith("/"):
            raise InvalidRequest(
                f"{text!r}: the path in a sandbox must be absolute, like {head}:/workspace/x"
            )
        return Location(tail, head)
    return Location(text)


# --- a local tree as a tar stream ------------------------------------------------------------


def tar_pieces(source: Path, name: str) -> Iterator[bytes]:
    """``source`` (a file or a directory, symlinks as symlinks) as a tar stream whose top entry
    is ``name``: headers and file contents in pieces of at most ``PIECE`` bytes, so a large
    file is never held whole."""
    archive = tarfile.TarFile(fileobj=io.BytesIO(), mode="w")  # its gettarinfo, hard links
    for path, member in _walk(source, name):
        if stat.S_ISSOCK(path.lstat().st_mode):  # tar cannot hold a socket
            continue
        info = archive.gettarinfo(str(path), member)
        info.mtime = int(info.mtime)  # a float would cost every entry a pax header
        yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        if info.isreg():
            yield from _contents(path, info.size)
    yield b"\0" * (2 * BLOCK)


def _walk(path: Path, name: str) -> Iterator[tuple[Path, str]]:
    yield path, name
    if stat.S_ISDIR(path.lstat().st_mode):
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            yield from _walk(Path(entry.path), f"{name}/{entry.name}")


def _contents(path: Path, size: int) -> Iterator[bytes]:
    """Exactly ``size`` bytes (the header said so): a file that shrank meanwhile is padded."""
    left = size
    with path.open("rb") as file:
        while left > 0 and (piece := file.read(min(PIECE, left))):
            left -= len(piece)
            yield piece
    if left:
        yield b"\0" * left
    if size % BLOCK:
        yield b"\0" * (BLOCK - size % BLOCK)


# --- a tar stream into a local directory -----------------------------------------------------


class PieceReader(io.RawIOBase):
    """Pieces of bytes as a file object for ``tarfile``'s stream mode."""

    def __init__(self, pieces: Iterable[bytes]) -> None:
        self._pieces = iter(pieces)
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._left:
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            self._left = memoryview(piece)
        size = min(len(buffer), len(self._left))
        buffer[:size] = self._left[:size]
        self._left = self._left[size:]
        return size


def extract(pieces: Iterable[bytes], into: Path, rename: str | None = None) -> None:
    """Extract a tar stream into ``into``; ``rename``: the new name of its top entry."""
    reader = io.BufferedReader(PieceReader(pieces), PIECE)
    with tarfile.open(fileobj=reader, mode="r|") as archive:
        for member in archive:
            if rename is not None:
                member.name = _renamed(member.name, rename)
                if member.islnk():
                    member.linkname = _renamed(member.linkname, rename)
            archive.extract(member, into, filter="data")


def _renamed(name: str, top: str) -> str:
    parts = posixpath.normpath(name).split("/")
    return posixpath.join(top, *parts[1:])


# --- the copy --------------------------------------------------------------------------------


def copy(client: Client, source: Location, destination: Location, *, quiet: bool = False) -> None:
    if (source.sandbox is None) == (destination.sandbox is None):
        raise InvalidRequest(
            "slicebox cp copies between this machine and a sandbox: one side is SANDBOX:PATH, "
            "the other a local path or -"
        )
    if destination.sandbox is not None:
        upload(client, source.path, destination.sandbox, destination.path, quiet=quiet)
    else:
        assert source.sandbox is not None
        download(client, source.sandbox, source.path, destination.path, quiet=quiet)


def upload(client: Client, local: str, sandbox: str, remote: str, *, quiet: bool = False) -> None:
    progress = Bytes(f"{local} -> {sandbox}:{remote}", quiet=quiet)
    if local == "-":  # a tar already: into the directory named, as docker cp does
        client.upload(sandbox, remote, progress.counted(_stdin_pieces()))
        progress.done()
        return
    source = Path(local)
    if not source.exists() and not source.is_symlink():
        raise InvalidRequest(f"no {local} here to copy; check the path")
    into, name = _remote_target(client, sandbox, remote, source)
    client.upload(sandbox, into, progress.counted(tar_pieces(source, name)))
    progress.done()


def _remote_target(client: Client, sandbox: str, remote: str, source: Path) -> tuple[str, str]:
    """(the directory to extract into, the name the copy gets there)."""
    own_name = source.resolve().name if source.name in ("", ".", "..") else source.name
    if remote.endswith("/") or remote == "/":
        return remote, own_name
    kind = _remote_kind(client, sandbox, remote)
    if kind is FileKind.DIRECTORY:
        return remote, own_name
    if kind is FileKind.FILE and source.is_dir():
        raise InvalidRequest(f"{sandbox}:{remote} is a file; a directory cannot be copied onto it")
    return posixpath.dirname(remote), posixpath.basename(remote)


def _remote_kind(client: Client, sandbox: str, remote: str) -> FileKind | None:
    try:
        return client.stat(sandbox, remote).kind
    except NotFound as exc:
        if exc.code != "file_not_found":
            raise
        return None


def download(client: Client, sandbox: str, remote: str, local: str, *, quiet: bool = False) -> None:
    progress = Bytes(f"{sandbox}:{remote} -> {local}", quiet=quiet)
    pieces = progress.counted(client.download(sandbox, remote))
    if local == "-":
        out = sys.stdout.buffer
        for piece in pieces:
            out.write(piece)
        out.flush()
        progress.done()
        return
    target = Path(local)
    if target.is_dir() and not target.is_symlink():
        extract(pieces, target)
    elif target.parent.is_dir():
        extract(pieces, target.parent, target.name)
    else:
        raise InvalidRequest(f"{target.parent} does not exist here; create it first")
    progress.done()


def _stdin_pieces() -> Iterator[bytes]:
    stream = sys.stdin.buffer
    while piece := stream.read(PIECE):
        yield piece
