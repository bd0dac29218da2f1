"""A snapshot's walk of a /workspace that its sandbox's neighbour changes as it goes (issue 59,
symptom 1), on a real directory tree: a directory swapped for a symlink to a directory outside
the tree between the walk's look at it and its open, or while the walk is inside it. The walk
must take what it looked at, or nothing, and never a byte from outside.

The seam is ``os.scandir``, which the walk lists each directory with: its entries are wrapped
so that the swap happens right after the walk looked at one (``DirEntry.stat``), before
anything is opened. The old walk (by path below ``/proc/<pid>/root``) read the outside files
through the link."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slicebox.core.snaptar import Pipe, add_tree, write_snapshot
from tests.fakes.snapshots import members_of

SECRET = b"the host's own, never in a snapshot\n"


class _Entry:
    """A ``DirEntry`` whose look is followed by ``after(name)``: the neighbour's move."""

    def __init__(self, entry: os.DirEntry[str], after: Callable[[str], None]) -> None:
        self._entry, self._after = entry, after
        self.name, self.path = entry.name, entry.path

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        found = self._entry.stat(follow_symlinks=follow_symlinks)
        self._after(self.name)
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)


class _Listing:
    def __init__(self, listing: Any, after: Callable[[str], None]) -> None:
        self._listing, self._after = listing, after

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        self._listing.close()

    def __iter__(self) -> Iterator[_Entry]:
        return (_Entry(entry, self._after) for entry in self._listing)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``ws``: a workspace with ``d/x`` and ``own``; ``outside``: a secret, and an ``x``."""
    (tmp_path / "ws" / "d").mkdir(parents=True)
    (tmp_path / "ws" / "d" / "x").write_bytes(b"the sandbox's own x\n")
    (tmp_path / "ws" / "own").write_bytes(b"own\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    (outside / "x").write_bytes(SECRET)
    return tmp_path


def racing(monkeypatch: pytest.MonkeyPatch, when: str, swap: Callable[[], None]) -> list[str]:
    """``swap`` run once, just after the walk looked at an entry named ``when``."""
    done: list[str] = []
    real = os.scandir

    def after(name: str) -> None:
        if name == when and not done:
            done.append(name)
            swap()

    def scandir(path: Any = ".") -> _Listing:
        return _Listing(real(path), after)

    monkeypatch.setattr(os, "scandir", scandir)
    return done


def swapper(tree: Path) -> Callable[[], None]:
    """``ws/d`` moved aside, and a symlink to ``outside`` in its place."""

    def swap() -> None:
        (tree / "ws" / "d").rename(tree / "ws" / "moved")
        os.symlink(tree / "outside", tree / "ws" / "d")

    return swap


def walked(root: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_tree(tar, str(root), "workspace")
    return buffer.getvalue()


def read_all(data: bytes) -> dict[str, bytes]:
    found = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar:
            file = tar.extractfile(member) if member.isreg() else None
            found[member.name] = file.read() if file is not None else b""
    return found


def test_a_directory_swapped_for_a_link_after_the_look_is_never_followed(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = racing(monkeypatch, "d", swapper(tree))
    data = walked(tree / "ws")
    assert done == ["d"], "the swap happened between the look and the open"
    files = read_all(data)
    assert SECRET not in files.values(), f"read from outside: {sorted(files)}"
    assert "workspace/d/secret" not in files
    assert files["workspace/own"] == b"own\n"


def test_a_directory_swapped_while_the_walk_is_inside_it_is_read_as_it_was(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look at ``d/x`` done, ``d`` is moved and a link to ``outside`` (which has an ``x``
    too) takes its place: ``x`` is still the one the walk looked at, in the directory it
    opened."""
    done = racing(monkeypatch, "x", swapper(tree))
    files = read_all(walked(tree / "ws"))
    assert done == ["x"]
    assert SECRET not in files.values(), f"read from outside: {sorted(files)}"
    assert files["workspace/d/x"] == b"the sandbox's own x\n"


def test_a_workspace_that_is_a_link_is_an_empty_one(tree: Path) -> None:
    """A fork's /workspace is a plain directory of its root filesystem: its sandbox can put a
    link there. The snapshot's ``workspace/`` is then an empty tmpfs's, nothing followed."""
    os.symlink(tree / "outside", tree / "linked")
    pipe = Pipe()
    write_snapshot(io.BytesIO(_empty_tar()), str(tree / "linked"), pipe)
    pipe.close()
    found = members_of(b"".join(pipe))
    assert list(found) == ["workspace"]
    assert found["workspace"].mode == 0o1777


def test_the_walk_keeps_links_hard_links_modes_and_owners_from_what_it_opened(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a").write_bytes(b"a" * 300_000)  # more than one copy's chunk
    os.link(root / "sub" / "a", root / "b")
    os.symlink("/etc/shadow", root / "link")
    os.mkfifo(root / "fifo")
    os.chmod(root / "sub", 0o750)
    found = members_of(walked(root))
    assert sorted(found) == [
        "workspace/b",
        "workspace/fifo",
        "workspace/link",
        "workspace/sub",
        "workspace/sub/a",
    ]
    assert found["workspace/link"].issym()
    assert found["workspace/link"].linkname == "/etc/shadow"
    assert found["workspace/fifo"].isfifo()
    assert found["workspace/sub"].mode == 0o750
    assert found["workspace/sub/a"].islnk(), "the second name of one file is a hard link"
    assert found["workspace/sub/a"].linkname == "workspace/b"
    assert found["workspace/b"].size == 300_000
    assert found["workspace/b"].uid == os.getuid()
    assert read_all(walked(root))["workspace/b"] == b"a" * 300_000


def _empty_tar() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w"):
        pass
    return buffer.getvalue()
