"""Staging points (host.staging): the helper run for real on this machine, without entering
another mount namespace (the guest's tests make the real binds, through the installed agent).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from slicebox.host.staging import Stager
from slicebox.model.errors import HostError, PolicyViolation


def here(tmp_path: Path) -> Stager:
    stage = tmp_path / "stage"
    return Stager(root=stage, enter=())


def test_a_source_that_is_no_longer_what_was_pinned_is_refused_and_nothing_stays(
    tmp_path: Path,
) -> None:
    # What Docker got used to be the checked name itself: a swap to a symlink after the
    # check was mounted. The helper binds only the very inode that was pinned.
    mine = tmp_path / "mine"
    mine.mkdir()
    pinned = os.stat(mine)
    mine.rename(tmp_path / "kept")
    mine.symlink_to("/etc")  # the swap
    stager = here(tmp_path)
    with pytest.raises(PolicyViolation, match="changed while the sandbox was created") as refused:
        stager.stage("sb-1", [(str(mine), pinned.st_dev, pinned.st_ino)])
    assert refused.value.code == "mount_changed"
    assert stager.staged() == [], "the staging directory went with the refusal"


def test_the_stage_is_made_when_the_agent_s_runtime_directory_is_not_there_yet(
    tmp_path: Path,
) -> None:
    # /run/slicebox is made by systemd for the socket; a create in a process of its own (the
    # guest's in-process tests, a host where the agent never ran) made none before.
    stager = Stager(root=tmp_path / "run" / "slicebox" / "stage", enter=())
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(PolicyViolation) as refused:  # an inode that is not the pinned one
        stager.stage("sb-0", [(str(mine), 0, 0)])
    assert refused.value.code == "mount_changed"
    assert (tmp_path / "run" / "slicebox" / "stage").is_dir()


def test_staging_points_are_root_only_and_unstaging_nothing_is_fine(tmp_path: Path) -> None:
    stager = here(tmp_path)
    stager.unstage("sb-none")
    (tmp_path / "stage").mkdir(mode=0o755)  # someone made the stage readable to others
    file = tmp_path / "f"
    file.write_text("x")
    found = os.stat(file)
    with pytest.raises(HostError, match="is not root's own directory"):
        stager.stage("sb-2", [(str(file), found.st_dev, found.st_ino)])


def test_a_helper_that_cannot_run_is_a_host_error(tmp_path: Path) -> None:
    def missing(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(2, "No such file or directory", "nsenter")

    stager = Stager(root=tmp_path / "stage", run=missing)
    with pytest.raises(HostError, match=r"could not be staged for Docker.*No such file"):
        stager.stage("sb-3", [("/srv/x", 1, 2)])


def test_release_writes_the_line_to_the_waiters_stdin_and_hangs_up(tmp_path: Path) -> None:
    # A fake daemon on a unix socket: the attach (stdin only), then the line, then EOF.
    import asyncio
    import socket
    import threading

    from slicebox.backends.dockerendpoint import DockerEndpoint
    from slicebox.backends.dockerstream import release

    path = str(tmp_path / "docker.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    seen: list[bytes] = []

    def daemon() -> None:
        daemons, _ = server.accept()
        server.close()
        head = b""
        while b"\r\n\r\n" not in head:
            head += daemons.recv(4096)
        seen.append(head)
        daemons.sendall(b"HTTP/1.1 101 UPGRADED\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n")
        rest = b""
        while chunk := daemons.recv(4096):
            rest += chunk
        seen.append(rest)
        daemons.close()

    thread = threading.Thread(target=daemon)
    thread.start()
    endpoint = DockerEndpoint(scheme="unix", address=path)
    asyncio.run(release(endpoint, "1.45", "abc", b"exec sleep 1\n"))
    thread.join(10)
    assert seen[0].startswith(b"POST /v1.45/containers/abc/attach?stream=1&stdin=1 HTTP/1.1")
    assert seen[1] == b"exec sleep 1\n"
