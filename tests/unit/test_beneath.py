"""Bind sources resolved by this machine's kernel beneath their root (host.beneath).

These run on the real kernel and file system of whatever machine runs them (a temporary
directory): ``openat2`` where the kernel has it, and the walk by hand that stands in for it
where it has not. The guest's tests add what needs root: another mount on the way, and a
sandbox that plants a symlink to ``/``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from pathlib import Path, PurePosixPath

import pytest

from slicebox.host import beneath
from slicebox.host.beneath import (
    BindRoot,
    Pinned,
    bind_roots,
    ids_of,
    own_mounted,
    pin,
    root_for,
    unsafe_roots,
    verify,
)
from slicebox.model.errors import PolicyViolation


@pytest.fixture(params=["openat2", "walk"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: through openat2, and through the walk a kernel without it gets."""
    if request.param == "walk":

        def no_openat2(dir_fd: int, path: str) -> int:
            ctypes.set_errno(errno.ENOSYS)
            return -1

        monkeypatch.setattr(beneath, "_openat2", no_openat2)
    return str(request.param)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    made = tmp_path / "ws" / "alice"
    (made / "project" / "src").mkdir(parents=True)
    (made / "notes.txt").write_text("x")
    return made


def roots_of(*paths: Path) -> tuple[BindRoot, ...]:
    """Roots walked from two levels up (the test's own tree, this user's: ``trusted``)."""
    return tuple(
        BindRoot(path=PurePosixPath(p), top=str(p.parent.parent), trusted=os.getuid())
        for p in paths
    )


def test_a_directory_under_the_root_is_pinned_to_what_it_is(way: str, root: Path) -> None:
    source = root / "project" / "src"
    pinned = pin(str(source), "/workspace", roots_of(root))
    found = os.stat(source)
    assert pinned == Pinned(
        source=str(source), target="/workspace", device=found.st_dev, inode=found.st_ino
    )
    assert pin(str(root), "/w", roots_of(root)).inode == os.stat(root).st_ino
    assert (
        pin(str(root / "notes.txt"), "/n", roots_of(root)).inode
        == os.stat(root / "notes.txt").st_ino
    )


def test_a_symlink_to_the_hosts_root_is_refused(way: str, root: Path) -> None:
    (root / "esc").symlink_to("/")
    with pytest.raises(PolicyViolation, match="goes through a symlink") as refused:
        pin(str(root / "esc"), "/workspace", roots_of(root))
    assert refused.value.code == "mount_escape"
    with pytest.raises(PolicyViolation, match="goes through a symlink"):
        pin(str(root / "esc" / "etc"), "/workspace", roots_of(root))


def test_a_symlink_that_stays_inside_is_refused_too(way: str, root: Path) -> None:
    # Nothing tells a symlink that stays inside from one retargeted a moment later.
    (root / "link").symlink_to(root / "project")
    with pytest.raises(PolicyViolation, match="goes through a symlink"):
        pin(str(root / "link" / "src"), "/workspace", roots_of(root))


def test_dot_dot_a_file_on_the_way_and_a_missing_source_are_refused(way: str, root: Path) -> None:
    with pytest.raises(PolicyViolation, match=re.escape("'..'")) as up:
        pin(str(root / "project" / ".." / ".." / "bob"), "/w", roots_of(root))
    assert up.value.code == "mount_escape"
    with pytest.raises(PolicyViolation, match="not a directory") as through_a_file:
        pin(str(root / "notes.txt" / "x"), "/w", roots_of(root))
    assert through_a_file.value.code == "mount_escape"
    with pytest.raises(PolicyViolation, match="does not exist; create it first") as missing:
        pin(str(root / "nothing-here"), "/w", roots_of(root))
    assert missing.value.code == "mount_source_missing"


def test_outside_every_root_is_refused(way: str, root: Path, tmp_path: Path) -> None:
    (tmp_path / "ws" / "bob").mkdir()
    with pytest.raises(PolicyViolation, match="outside the allowed roots"):
        pin(str(tmp_path / "ws" / "bob"), "/w", roots_of(root))
    with pytest.raises(PolicyViolation, match="none configured: set bind_roots"):
        pin(str(root), "/w", ())
    with pytest.raises(PolicyViolation, match="outside the allowed roots"):
        pin("relative/path", "/w", roots_of(root))


def test_a_root_that_is_itself_a_symlink_is_refused(way: str, root: Path, tmp_path: Path) -> None:
    # It used to be the operator's choice, followed; nothing tells the operator's link from
    # one a user planted, so the root is walked from the top following nothing.
    (tmp_path / "alias").symlink_to(root)
    with pytest.raises(PolicyViolation, match="alias is a symlink") as refused:
        pin(str(tmp_path / "alias" / "project"), "/w", roots_of(tmp_path / "alias"))
    assert refused.value.code == "bind_root_unsafe"


def users_roots(tmp_path: Path, uid: int) -> tuple[BindRoot, ...]:
    """``<tmp>/home/{user}/sandboxes`` for alice (of ``uid``), walked from ``tmp_path``."""
    template = PurePosixPath(tmp_path, "home", "{user}", "sandboxes")
    return tuple(
        root.model_copy(update={"top": str(tmp_path), "trusted": os.getuid()})
        for root in bind_roots((template,), "alice", uid)
    )


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "home" / "alice" / "sandboxes" / "p").mkdir(parents=True)
    for directory in (tmp_path, tmp_path / "home"):
        directory.chmod(0o755)
    return tmp_path / "home" / "alice"


def test_the_users_own_directory_on_a_roots_path_swapped_for_a_link_to_slash_is_refused(
    way: str, tmp_path: Path, home: Path
) -> None:
    # /home/{user}/sandboxes: alice owns /home/alice, so she can make sandboxes a link to /;
    # the old pin followed it and admitted / and /etc.
    roots = users_roots(tmp_path, os.getuid())
    assert roots[0].user_part == len(tmp_path.parts) + 1
    inner = home / "sandboxes" / "p"
    assert pin(str(inner), "/w", roots).inode == os.stat(inner).st_ino
    (home / "sandboxes").rename(home / "kept")
    (home / "sandboxes").symlink_to("/")
    for source in (home / "sandboxes", home / "sandboxes" / "etc"):
        with pytest.raises(PolicyViolation, match="sandboxes is a symlink") as refused:
            pin(str(source), "/w", roots)
        assert refused.value.code == "bind_root_unsafe"


def test_a_users_own_directory_that_is_someone_elses_is_refused(
    way: str, tmp_path: Path, home: Path
) -> None:
    with pytest.raises(PolicyViolation, match="not the user's") as refused:
        pin(str(home / "sandboxes" / "p"), "/w", users_roots(tmp_path, os.getuid() + 1))
    assert refused.value.code == "bind_root_unsafe"


def test_a_directory_above_the_users_own_one_writable_by_others_is_refused_unless_sticky(
    way: str, tmp_path: Path, home: Path
) -> None:
    roots = users_roots(tmp_path, os.getuid())
    (tmp_path / "home").chmod(0o777)  # anyone could rename alice's directory away
    with pytest.raises(PolicyViolation, match="home is writable by its group or others"):
        pin(str(home / "sandboxes" / "p"), "/w", roots)
    (tmp_path / "home").chmod(0o1777)  # as /tmp: only an entry's owner may rename it
    assert pin(str(home / "sandboxes" / "p"), "/w", roots).source == str(home / "sandboxes" / "p")
    (tmp_path / "home").chmod(0o755)
    missing = users_roots(tmp_path, os.getuid())[0].model_copy(
        update={"path": PurePosixPath(tmp_path, "home", "nobody-here", "sandboxes")}
    )
    with pytest.raises(PolicyViolation, match="does not exist") as absent:
        pin(str(missing.path / "p"), "/w", (missing,))
    assert absent.value.code == "bind_root_unsafe"


def test_the_longest_root_decides() -> None:
    roots = (PurePosixPath("/srv"), PurePosixPath("/srv/ws/alice"), PurePosixPath("/srv/ws"))
    assert root_for(PurePosixPath("/srv/ws/alice/p"), roots) == PurePosixPath("/srv/ws/alice")
    assert root_for(PurePosixPath("/srv/wsx"), roots) == PurePosixPath("/srv")
    assert root_for(PurePosixPath("/etc"), roots) is None


def test_verify_compares_what_the_process_sees_at_the_target(root: Path, tmp_path: Path) -> None:
    # This process's own /proc/<pid>/root is "/": the target is the source's own path.
    source = root / "project"
    pinned = pin(str(source), str(source), roots_of(root))
    verify(os.getpid(), pinned)
    swapped = pinned.model_copy(update={"target": str(root / "project" / "src")})
    with pytest.raises(PolicyViolation, match="changed while the sandbox was created") as changed:
        verify(os.getpid(), swapped)
    assert changed.value.code == "mount_changed"
    with pytest.raises(PolicyViolation, match="cannot be read"):
        verify(os.getpid(), pinned.model_copy(update={"target": str(tmp_path / "gone")}))


def test_verify_follows_no_link_the_image_put_at_the_target(tmp_path: Path, root: Path) -> None:
    # An absolute link in the sandbox's root resolves, through /proc/<pid>/root, against the
    # agent's root: /workspace -> <the pinned host path> looked right to the old verify while
    # the bind sat at the link's target inside the sandbox, wherever that is.
    source = root / "project"
    pinned = pin(str(source), "/workspace", roots_of(root))
    sandbox_root = tmp_path / "container"
    sandbox_root.mkdir()
    (tmp_path / "proc" / "7").mkdir(parents=True)
    (tmp_path / "proc" / "7" / "root").symlink_to(sandbox_root)
    (sandbox_root / "workspace").symlink_to(source)
    with pytest.raises(PolicyViolation, match="cannot be read") as refused:
        verify(7, pinned, tmp_path / "proc")
    assert refused.value.code == "mount_changed"
    (sandbox_root / "workspace").unlink()
    (sandbox_root / "workspace").mkdir()
    with pytest.raises(PolicyViolation, match="another file is mounted there"):
        verify(7, pinned, tmp_path / "proc")
    (sandbox_root / "workspace").rmdir()
    (sandbox_root / "in").mkdir()
    (sandbox_root / "in" / "workspace").symlink_to(source)
    with pytest.raises(PolicyViolation, match="cannot be read"):
        verify(7, pinned.model_copy(update={"target": "/in/workspace/."}), tmp_path / "proc")


def test_a_fresh_volume_is_given_away_only_when_the_sandbox_sees_that_very_directory(
    tmp_path: Path,
) -> None:
    sandbox_root = tmp_path / "container"
    (sandbox_root / "workspace").mkdir(parents=True)
    (sandbox_root / "elsewhere").mkdir()
    (tmp_path / "proc" / "7").mkdir(parents=True)
    (tmp_path / "proc" / "7" / "root").symlink_to(sandbox_root)
    volume = str(sandbox_root / "workspace")
    ids, proc = (os.getuid(), os.getgid()), tmp_path / "proc"
    own_mounted(7, "/workspace", volume, ids, proc)
    with pytest.raises(OSError, match="is not"):
        own_mounted(7, "/workspace", str(sandbox_root / "elsewhere"), ids, proc)
    (sandbox_root / "workspace").rmdir()
    (sandbox_root / "workspace").symlink_to(sandbox_root / "elsewhere")
    with pytest.raises(OSError, match=r"Not a directory|symbolic links"):  # never followed
        own_mounted(7, "/workspace", volume, ids, proc)


def test_ids_of_reads_the_effective_uid_and_gid(tmp_path: Path) -> None:
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "status").write_text(
        "Name:\tsh\nUid:\t5\t1000\t1000\t1000\nGid:\t6\t99\t99\t99\n"
    )
    assert ids_of(9, tmp_path) == (1000, 99)


def test_the_part_of_a_root_above_user_is_checked_when_the_config_is_loaded(
    tmp_path: Path, home: Path
) -> None:
    me, top = os.getuid(), str(tmp_path)
    fine = PurePosixPath(tmp_path, "home", "{user}", "sandboxes")
    assert unsafe_roots((fine,), top, me) == []
    (tmp_path / "home").chmod(0o777)
    (tmp_path / "alias").symlink_to(tmp_path / "home")
    aliased = PurePosixPath(tmp_path, "alias", "{user}")
    assert unsafe_roots((fine, aliased), top, me) == [
        f"{fine}: {tmp_path}/home is writable by its group or others",
        f"{aliased}: {tmp_path}/alias is a symlink",
    ]
