"""``slicebox cp`` and the clients' transfers against the agent's real HTTP app on a real socket;
behind it, the transfer scripts run by this machine's sh and tar below a stand-in root."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.cli import main
from slicebox.cli.copying import Location, parse_location
from slicebox.client import AsyncClient
from slicebox.client.sync import Client, _UnixConnection
from slicebox.model import errors
from slicebox.model.api import CreateSandbox
from slicebox.model.files import FileFormat
from tests.unit.agentserver import Agent, served
from tests.unit.filesworld import FilesWorld

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with served(tmp_path, FilesWorld(tmp_path, cap=4 * MiB)) as running:
        yield running


@pytest.fixture
def box(agent: Agent) -> Iterator[str]:
    client = Client(agent.socket)
    made = client.create(CreateSandbox(project="web"))
    yield made.id
    client.destroy(made.id)


def rootfs(agent: Agent) -> Path:
    world = agent.world
    assert isinstance(world, FilesWorld)
    return world.root


def cp(agent: Agent, source: str, destination: str) -> int:
    return main.main(["--socket", agent.socket, "cp", source, destination])


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(root.rglob("*"))
    }


def a_tree(tmp_path: Path) -> Path:
    src = tmp_path / "proj"
    (src / "lib").mkdir(parents=True)
    (src / "data.bin").write_bytes(os.urandom(MiB + 123))
    (src / "lib" / "a.py").write_text("print('a')\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    os.symlink("lib/a.py", src / "link")
    return src


def test_a_directory_in_and_out_with_cp(agent: Agent, box: str, tmp_path: Path) -> None:
    src = a_tree(tmp_path)
    assert cp(agent, str(src), f"{box}:/workspace/") == 0  # into: /workspace/proj
    landed = rootfs(agent) / "workspace" / "proj"
    assert digest(landed) == digest(src)
    assert os.readlink(landed / "link") == "lib/a.py"
    assert (landed / "run.sh").stat().st_mode & 0o111
    assert cp(agent, f"{box}:/workspace/proj", str(tmp_path / "back")) == 0  # a new name
    assert digest(tmp_path / "back") == digest(src)
    (tmp_path / "into").mkdir()
    assert cp(agent, f"{box}:/workspace/proj", str(tmp_path / "into")) == 0  # an existing dir
    assert digest(tmp_path / "into" / "proj") == digest(src)


def test_a_file_takes_the_name_given_or_goes_into_a_directory(
    agent: Agent, box: str, tmp_path: Path
) -> None:
    local = tmp_path / "notes.txt"
    local.write_text("notes\n")
    workspace = rootfs(agent) / "workspace"
    assert cp(agent, str(local), f"{box}:/workspace") == 0
    assert (workspace / "notes.txt").read_text() == "notes\n"
    assert cp(agent, str(local), f"{box}:/workspace/renamed.txt") == 0
    assert (workspace / "renamed.txt").read_text() == "notes\n"
    assert cp(agent, f"{box}:/workspace/renamed.txt", str(tmp_path / "again.txt")) == 0
    assert (tmp_path / "again.txt").read_text() == "notes\n"


def test_dash_is_a_tar_on_stdin_or_stdout(
    agent: Agent, box: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        info = tarfile.TarInfo("piped.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"piped"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(archive.getvalue())))
    assert cp(agent, "-", f"{box}:/workspace/in") == 0
    assert (rootfs(agent) / "workspace" / "in" / "piped.txt").read_bytes() == b"piped"
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out))
    assert cp(agent, f"{box}:/workspace/in/piped.txt", "-") == 0
    sys.stdout.flush()
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        assert tar.getnames() == ["./piped.txt"]


def test_cp_errors_print_their_code(
    agent: Agent, box: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cp(agent, f"{box}:/workspace/none", str(tmp_path / "x")) == 2
    assert "file_not_found" in capsys.readouterr().err
    assert cp(agent, str(tmp_path / "nothing"), f"{box}:/workspace") == 2
    assert "no " in capsys.readouterr().err
    assert cp(agent, "a", "b") == 2
    assert "one side is SANDBOX:PATH" in capsys.readouterr().err


def test_locations_read_as_docker_cp_reads_them() -> None:
    assert parse_location("sbx-1:/workspace/x") == Location("/workspace/x", "sbx-1")
    assert parse_location("./a:b") == Location("./a:b")
    assert parse_location("-") == Location("-")
    with pytest.raises(errors.InvalidRequest, match="absolute"):
        parse_location("sbx-1:workspace")


def test_an_upload_over_the_cap_is_413_with_its_code(agent: Agent, box: str) -> None:
    client = Client(agent.socket)
    pieces = (b"x" * 64 * KiB for _ in range(200))  # 12.5 MiB, sent chunked
    with pytest.raises(errors.TooLarge) as caught:
        client.upload(box, "/workspace/big", pieces, FileFormat.FILE)
    assert caught.value.code == "file_too_large"
    assert "files_max_bytes (4 MiB)" in caught.value.message


def test_a_declared_length_over_the_cap_is_refused_before_the_body(agent: Agent, box: str) -> None:
    conn = _UnixConnection(agent.socket, timeout=10)
    conn.putrequest("PUT", f"/v1/sandboxes/{box}/files?path=/workspace/f&format=file")
    conn.putheader("Content-Length", str(5 * MiB))
    conn.endheaders()  # and no body at all: the answer must not wait for one
    answer = conn.getresponse()
    assert answer.status == 413
    assert b'"file_too_large"' in answer.read()
    conn.close()


def test_a_download_over_the_cap_is_an_error_not_a_short_file(agent: Agent, box: str) -> None:
    (rootfs(agent) / "workspace" / "big").write_bytes(os.urandom(6 * MiB))
    received: list[int] = []
    pieces = Client(agent.socket).download(box, "/workspace/big", FileFormat.FILE)
    with pytest.raises(errors.TooLarge):
        received.extend(len(piece) for piece in pieces)
    assert sum(received) == 4 * MiB


def test_the_async_client_moves_files_both_ways(agent: Agent, box: str) -> None:
    data = os.urandom(3 * MiB)

    async def both() -> bytes:
        async with AsyncClient(agent.socket) as client:
            pieces = [data[i : i + 64 * KiB] for i in range(0, len(data), 64 * KiB)]
            done = await client.upload(box, "/workspace/a.bin", pieces, FileFormat.FILE)
            assert done.bytes == len(data)
            assert (await client.stat(box, "/workspace/a.bin")).kind == "file"
            fetched = client.download(box, "/workspace/a.bin", FileFormat.FILE)
            return b"".join([piece async for piece in fetched])

    assert asyncio.run(both()) == data


def test_the_async_client_hears_a_refused_upload_as_its_code(agent: Agent, box: str) -> None:
    """The agent answers a refused upload before reading it and closes the connection: without
    ``Expect: 100-continue`` the client's write of the body failed first (a reset, reported as
    no answer), and the 404 or 413 was never read."""

    def pieces() -> Iterator[bytes]:
        return (b"x" * 64 * KiB for _ in range(200))  # 12.5 MiB, more than any socket buffers

    async def refused() -> tuple[str, str]:
        async with AsyncClient(agent.socket) as client:
            with pytest.raises(errors.NotFound) as missing:
                await client.upload("sbx-nosuch", "/workspace/f", pieces(), FileFormat.FILE)
            with pytest.raises(errors.TooLarge) as large:
                await client.upload(box, "/workspace/big", pieces(), FileFormat.FILE)
            return missing.value.code, large.value.code

    assert asyncio.run(refused()) == ("not_found", "file_too_large")
