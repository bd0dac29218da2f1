"""Files in and out of a sandbox, through the service: the real transfer scripts run by this
machine's sh and tar below a stand-in root, so what lands where is what tar did."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncGenerator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from slicebox.cli.copying import extract, tar_pieces
from slicebox.core.blocking import inline
from slicebox.core.files import NO_PROGRAM, NO_TAR, check
from slicebox.model.errors import InvalidRequest, NotFound, SliceboxError, TooLarge
from slicebox.model.exec import ExecResult
from slicebox.model.files import FileFormat, FileKind, FilesQuery
from tests.unit.agentserver import wait_for
from tests.unit.filesworld import FilesWorld
from tests.unit.test_service import ALICE, BOB

T = TypeVar("T")
KiB = 1024


class Pieces:
    """An upload's body: ``pieces`` handed out one read at a time, reads counted."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces
        self.reads = 0

    async def read(self) -> bytes:
        self.reads += 1
        return self._pieces.pop(0) if self._pieces else b""


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def upload(
    world: FilesWorld, box: str, path: str, body: Pieces, fmt: FileFormat = FileFormat.TAR
) -> int:
    query = FilesQuery(path=path, format=fmt)
    done = run(world.service.files.upload(ALICE, box, query, body=body, blocking=inline))
    return done.bytes


async def _gather(chunks: AsyncGenerator[bytes, None]) -> list[bytes]:
    return [chunk async for chunk in chunks]


def download(
    world: FilesWorld, box: str, path: str, fmt: FileFormat = FileFormat.TAR
) -> list[bytes]:
    query = FilesQuery(path=path, format=fmt)
    return run(_gather(world.service.files.download(ALICE, box, query, inline)))


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def world(tmp_path: Path) -> FilesWorld:
    return FilesWorld(tmp_path)


def local_tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "big.bin").write_bytes(os.urandom(300 * KiB))
    (src / "sub" / "small.txt").write_text("hello\n")
    (src / "empty").write_bytes(b"")
    return src


def test_a_directory_goes_in_as_tar_and_comes_back_the_same(
    world: FilesWorld, tmp_path: Path
) -> None:
    box, src = world.create(ALICE), local_tree(tmp_path)
    sent = upload(world, box, "/workspace/new/deep", Pieces(list(tar_pieces(src, "src"))))
    landed = world.root / "workspace" / "new" / "deep" / "src"
    assert tree(landed) == tree(src)  # the destination was made, the tree is exact
    back = tmp_path / "back"
    back.mkdir()
    extract(download(world, box, "/workspace/new/deep/src"), back, "copy")
    assert tree(back / "copy") == tree(src)
    assert sent > 300 * KiB


def test_one_file_in_and_out_as_its_bytes(world: FilesWorld) -> None:
    box, data = world.create(ALICE), os.urandom(200 * KiB)
    pieces = [data[i : i + 64 * KiB] for i in range(0, len(data), 64 * KiB)]
    assert upload(world, box, "/workspace/f.bin", Pieces(pieces), FileFormat.FILE) == len(data)
    assert (world.root / "workspace" / "f.bin").read_bytes() == data
    assert b"".join(download(world, box, "/workspace/f.bin", FileFormat.FILE)) == data


def test_stat_says_what_is_there(world: FilesWorld) -> None:
    box = world.create(ALICE)
    (world.root / "workspace" / "f").write_text("x")
    os.symlink("nowhere", world.root / "workspace" / "dangling")

    def kind(path: str) -> FileKind:
        return run(world.service.files.stat(ALICE, box, FilesQuery(path=path), inline)).kind

    assert kind("/workspace") is FileKind.DIRECTORY
    assert kind("/workspace/f") is FileKind.FILE
    assert kind("/workspace/dangling") is FileKind.OTHER
    with pytest.raises(NotFound) as caught:
        kind("/workspace/none")
    assert caught.value.code == "file_not_found"


@pytest.mark.parametrize(
    ("direction", "path", "fmt", "code"),
    [
        ("down", "/workspace/none", FileFormat.TAR, "file_not_found"),
        ("down", "/workspace/none", FileFormat.FILE, "file_not_found"),
        ("down", "/workspace", FileFormat.FILE, "file_wrong_kind"),
        ("up", "/workspace/no/such/f", FileFormat.FILE, "file_not_found"),
        ("up", "/workspace", FileFormat.FILE, "file_wrong_kind"),
        ("up", "/workspace/a-file", FileFormat.TAR, "file_wrong_kind"),
        ("up", "/workspace", FileFormat.TAR, "file_transfer_failed"),  # not a tar
    ],
)
def test_what_cannot_be_done_has_its_code(
    world: FilesWorld, direction: str, path: str, fmt: FileFormat, code: str
) -> None:
    box = world.create(ALICE)
    (world.root / "workspace" / "a-file").write_text("x")
    body = Pieces([b"not a tar archive at all" * 100])
    with pytest.raises(SliceboxError) as caught:
        _ = (
            upload(world, box, path, body, fmt)
            if direction == "up"
            else download(world, box, path, fmt)
        )
    assert caught.value.code == code
    assert path in caught.value.message or code == "file_transfer_failed"
    assert world.transfers()[-1]["SLICEBOX_RESULT"] == code


def test_a_failing_tar_is_quoted() -> None:
    failed = ExecResult.model_validate(
        {
            "stdout": b"",
            "stderr": b"tar: This does not look like a tar archive\n",
            "exit_code": 2,
            "timed_out": False,
            "oom_killed": False,
            "stdout_truncated": False,
            "stderr_truncated": False,
            "stdout_dropped_bytes": 0,
            "stderr_dropped_bytes": 0,
            "duration": 0.1,
        }
    )
    with pytest.raises(InvalidRequest) as caught:
        check(failed, FilesQuery(path="/workspace"), None)
    assert "does not look like a tar archive" in caught.value.message
    for code, said in ((NO_TAR, b""), (NO_PROGRAM, b"exec: executable file not found")):
        missing = failed.model_copy(update={"exit_code": code, "stderr": said})
        with pytest.raises(InvalidRequest) as caught:
            check(missing, FilesQuery(path="/workspace"), None)
        assert caught.value.code == "file_tools_missing"


def test_an_upload_over_the_cap_is_stopped_there_and_its_exec_killed(tmp_path: Path) -> None:
    world = FilesWorld(tmp_path, cap=256 * KiB)
    box = world.create(ALICE)
    body = Pieces([b"x" * 64 * KiB] * 100)  # 6.4 MiB offered
    with pytest.raises(TooLarge) as caught:
        upload(world, box, "/workspace/f", body, FileFormat.FILE)
    assert "files_max_bytes (256 KiB)" in caught.value.message
    assert body.reads == 5  # the fifth read crossed the cap: nothing more was read
    assert world.local.killed, "the exec's processes were not killed"
    (process,) = world.execs.processes.values()
    wait_for(lambda: not Path(f"/proc/{process.pid}").exists())  # killed, and reaped
    record = world.transfers()[-1]
    assert record["SLICEBOX_RESULT"] == "file_too_large"
    assert "upload file /workspace/f: 327680 bytes" in record["SLICEBOX_DETAIL"]


def test_an_upload_that_says_it_is_too_large_is_refused_before_it_runs(tmp_path: Path) -> None:
    world = FilesWorld(tmp_path, cap=1000)
    box, query = world.create(ALICE), FilesQuery(path="/workspace/f")
    files = world.service.files
    with pytest.raises(TooLarge):
        run(files.upload(ALICE, box, query, body=Pieces([]), blocking=inline, length=1001))
    assert world.execs.processes == {}


def test_a_download_over_the_cap_stops_exactly_at_it(tmp_path: Path) -> None:
    world = FilesWorld(tmp_path, cap=100 * KiB + 1)
    box = world.create(ALICE)
    (world.root / "workspace" / "big").write_bytes(os.urandom(MiB := 1024 * KiB))
    query = FilesQuery(path="/workspace/big", format=FileFormat.FILE)
    received: list[bytes] = []

    async def fetch() -> None:
        async for chunk in world.service.files.download(ALICE, box, query, inline):
            received.append(chunk)

    with pytest.raises(TooLarge):
        run(fetch())
    assert sum(map(len, received)) == 100 * KiB + 1 < MiB
    assert world.transfers()[-1]["SLICEBOX_RESULT"] == "file_too_large"


def test_each_transfer_is_audited_without_its_contents(world: FilesWorld) -> None:
    box = world.create(ALICE)
    secret = b"ghp_" + b"s" * 36
    upload(world, box, "/workspace/s", Pieces([secret]), FileFormat.FILE)
    download(world, box, "/workspace/s", FileFormat.FILE)
    up, down = world.transfers()
    assert (up["SLICEBOX_EVENT"], up["SLICEBOX_RESULT"]) == ("file_transfer", "ok")
    assert up["SLICEBOX_DETAIL"].startswith("upload file /workspace/s: 40 bytes")
    assert down["SLICEBOX_DETAIL"].startswith("download file /workspace/s: 40 bytes")
    assert (up["SLICEBOX_USER"], up["SLICEBOX_CALLER_UID"]) == ("alice", "1000")
    assert not any(secret.decode() in value for e in (up, down) for value in e.values())


def test_another_users_sandbox_is_not_found_and_refused_in_the_audit(world: FilesWorld) -> None:
    box = world.create(BOB)
    with pytest.raises(NotFound) as caught:
        download(world, box, "/workspace")
    assert caught.value.code == "not_found"
    (refusal,) = world.transfers()
    assert refusal["SLICEBOX_EVENT"] == "request_refused"
    assert refusal["SLICEBOX_DETAIL"].startswith("files refused")
    assert world.execs.processes == {}


def test_a_path_is_normalized_and_must_be_absolute() -> None:
    assert FilesQuery(path="//workspace/./a/../b/").path == "/workspace/b"
    assert FilesQuery(path="/-rf").name == "./-rf"
    assert FilesQuery(path="/").name == "."
    with pytest.raises(ValueError, match="absolute"):
        FilesQuery(path="workspace")
