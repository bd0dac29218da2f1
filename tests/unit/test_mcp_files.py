"""``slicebox mcp``'s file tools over a stand-in sandbox (the real sh and tar of this machine
below a directory, ``tests.unit.filesworld``): bytes exact both ways, a read's cut stated, a
directory listed, a tree up and down, and the agent's cap refused with its code."""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession

from slicebox.mcp import outputs
from slicebox.model.exec import ExecResult
from tests.tarfiles import files_of, tar_of
from tests.unit.agentserver import Agent, served
from tests.unit.filesworld import FilesWorld
from tests.unit.test_mcp import answer, create, over_mcp, refusal

MiB = 1024 * 1024


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with served(tmp_path, FilesWorld(tmp_path, cap=4 * MiB)) as running:
        yield running
        assert running.sandboxes() == [], "a test left a sandbox behind"


def test_a_binary_file_goes_in_and_out_byte_exact(agent: Agent) -> None:
    data = os.urandom(100_000) + b"\xff"

    async def body(client: ClientSession) -> tuple[dict[str, Any], dict[str, Any]]:
        box = await create(client)
        where = {"sandbox_id": box, "path": "/workspace/a.bin"}
        written = {**where, "content_base64": base64.b64encode(data).decode()}
        assert answer(await client.call_tool("file_write", written))["bytes"] == len(data)
        whole = answer(await client.call_tool("file_read", where))
        head = answer(await client.call_tool("file_read", {**where, "max_bytes": 10}))
        return whole, head

    whole, head = over_mcp(agent, body)
    assert whole["content_encoding"] == "base64"
    assert base64.b64decode(whole["content"]) == data
    assert whole["truncated"] is False
    assert (base64.b64decode(head["content"]), head["truncated"]) == (data[:10], True)


def test_text_is_written_and_read_as_text(agent: Agent) -> None:
    async def body(client: ClientSession) -> dict[str, Any]:
        box = await create(client)
        where = {"sandbox_id": box, "path": "/workspace/notes.txt"}
        answer(await client.call_tool("file_write", {**where, "content": "héllo\n"}))
        return answer(await client.call_tool("file_read", where))

    read = over_mcp(agent, body)
    assert (read["content"], read["content_encoding"]) == ("héllo\n", "utf-8")


def test_the_listing_script_reads_back_any_name(tmp_path: Path) -> None:
    """The script dir_list runs in the sandbox, here run by this machine's sh."""
    (tmp_path / "notes.txt").write_text("hi\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "two\nlines").write_bytes(b"")
    (tmp_path / os.fsdecode(b"\xff")).symlink_to("notes.txt")
    ran = subprocess.run(
        ["sh", "-c", outputs.LIST_SCRIPT, "sh", str(tmp_path)], capture_output=True, check=True
    )
    result = ExecResult(
        stdout=ran.stdout, stderr=b"", exit_code=0, timed_out=False, oom_killed=False,
        stdout_truncated=False, stderr_truncated=False, stdout_dropped_bytes=0,
        stderr_dropped_bytes=0, duration=0.0,
    )  # fmt: skip
    entries = {(e["name"], e["name_encoding"]): e for e in outputs.listing("/x", result)["entries"]}
    assert entries[("notes.txt", "utf-8")] == {
        "name": "notes.txt", "name_encoding": "utf-8", "kind": "file", "size": 3,
    }  # fmt: skip
    assert entries[(".hidden", "utf-8")]["kind"] == "directory"
    assert entries[("two\nlines", "utf-8")]["size"] == 0
    assert entries[("/w==", "base64")]["kind"] == "symlink"
    assert len(entries) == 4


def test_a_tree_goes_up_and_comes_back_down(agent: Agent) -> None:
    files = {"src/a.py": b"print(1)\n", "src/bin/b": os.urandom(5000)}

    async def body(client: ClientSession) -> dict[str, Any]:
        box = await create(client)
        tar = base64.b64encode(tar_of(files)).decode()
        arguments = {"sandbox_id": box, "path": "/workspace", "tar_base64": tar}
        assert answer(await client.call_tool("tree_upload", arguments))["format"] == "tar"
        where = {"sandbox_id": box, "path": "/workspace/src"}
        return answer(await client.call_tool("tree_download", where))

    got = over_mcp(agent, body)
    back = files_of(base64.b64decode(got["tar_base64"]))
    assert back == {"./src/a.py": files["src/a.py"], "./src/bin/b": files["src/bin/b"]}


def test_more_than_the_agents_cap_or_ours_is_refused_with_file_too_large(agent: Agent) -> None:
    big = base64.b64encode(tar_of({"big": os.urandom(5 * MiB)})).decode()

    async def past_the_agents(client: ClientSession) -> dict[str, Any]:
        box = await create(client)
        upload = {"sandbox_id": box, "path": "/workspace", "tar_base64": big}
        return refusal(await client.call_tool("tree_upload", upload))

    async def past_ours(client: ClientSession) -> list[dict[str, Any]]:
        box = await create(client)
        for name in ("a", "b"):
            where = {"sandbox_id": box, "path": f"/workspace/{name}", "content": "x" * 600_000}
            answer(await client.call_tool("file_write", where))
        down = {"sandbox_id": box, "path": "/workspace"}
        bad = {"sandbox_id": box, "path": "/workspace/f", "content_base64": "not base64!"}
        return [
            refusal(await client.call_tool("tree_download", down)),
            refusal(await client.call_tool("tree_upload", {**down, "tar_base64": big})),
            refusal(await client.call_tool("file_write", bad)),
        ]

    agents = over_mcp(agent, past_the_agents, max_transfer=8 * MiB)  # the agent's is 4 MiB
    assert agents["code"] == "file_too_large"
    assert "files_max_bytes" in agents["message"]
    down, up, bad = over_mcp(agent, past_ours, max_transfer=MiB)
    assert down["code"] == up["code"] == "file_too_large"
    assert "--max-transfer" in down["message"]
    assert "--max-transfer" in up["message"]
    assert (bad["code"], bad["field"]) == ("invalid_request", "content_base64")
