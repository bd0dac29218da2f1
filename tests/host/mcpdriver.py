"""An MCP client session with ``slicebox mcp``, run by tests/host/test_mcp.py as an ordinary
user with the MCP venv's python (the SDK is not in Debian's): the SDK's own stdio client starts
``slicebox mcp`` as an MCP client's server list says, uses its tools, and prints what it saw
as one JSON object. Its argument: another user's sandbox id."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time
from typing import Any

import jsonschema
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from pydantic import AnyUrl

from tests.tarfiles import files_of, tar_of

SERVER = StdioServerParameters(command="slicebox", args=["mcp", "--project", "mcp"])


class Driver:
    def __init__(self, client: ClientSession) -> None:
        self.client = client
        self.seen: dict[str, Any] = {}

    async def call(self, name: str, **arguments: Any) -> dict[str, Any]:
        result = await self.client.call_tool(name, arguments)
        found = dict(result.structuredContent or {})
        return {**found, "is_error": bool(result.isError)}

    async def tools(self) -> None:
        tools = (await self.client.list_tools()).tools
        for tool in tools:
            jsonschema.Draft202012Validator.check_schema(tool.inputSchema)
        self.seen["tools"] = sorted(tool.name for tool in tools)

    async def exec_with_progress(self, box: str) -> None:
        reports: list[tuple[float, str | None]] = []

        async def progress(progress: float, total: float | None, message: str | None) -> None:
            reports.append((progress, message))

        line = "for i in 1 2 3; do echo line $i; sleep 0.5; done"
        arguments = {"sandbox_id": box, "argv": line, "shell": True}
        result = await self.client.call_tool("sandbox_exec", arguments, progress_callback=progress)
        self.seen["streamed"] = {"result": result.structuredContent, "reports": reports}

    async def files(self, box: str) -> None:
        data = os.urandom(200_000) + b"\xff\x00"
        where = {"sandbox_id": box, "path": "/workspace/blob.bin"}
        await self.call("file_write", **where, content_base64=base64.b64encode(data).decode())
        read = await self.call("file_read", **where)
        self.seen["binary_exact"] = base64.b64decode(read["content"]) == data
        self.seen["binary_encoding"] = read["content_encoding"]
        tree = {"src/a.txt": b"hello\n", "src/lib/b.bin": os.urandom(3000)}
        up = base64.b64encode(tar_of(tree)).decode()
        self.seen["uploaded"] = await self.call(
            "tree_upload", sandbox_id=box, path="/workspace", tar_base64=up
        )
        down = await self.call("tree_download", sandbox_id=box, path="/workspace/src")
        self.seen["tree_sent"] = {f"./{k}": v.hex() for k, v in tree.items()}
        back = files_of(base64.b64decode(down["tar_base64"]))
        self.seen["tree_back"] = {name: data.hex() for name, data in back.items()}
        self.seen["listed"] = await self.call("dir_list", sandbox_id=box, path="/workspace/src")

    async def run(self, other: str) -> None:
        await self.tools()
        box = (await self.call("sandbox_create"))["id"]
        self.seen["box"] = box
        await self.exec_with_progress(box)
        self.seen["timeout"] = await self.call(
            "sandbox_exec", sandbox_id=box, argv=["sleep", "30"], timeout=1
        )
        await self.files(box)
        self.seen["usage"] = await self.call("sandbox_usage", sandbox_id=box)
        self.seen["other"] = await self.call("sandbox_get", sandbox_id=other)
        self.seen["destroyed"] = await self.call("sandbox_destroy", sandbox_id=box)
        self.seen["left"] = (await self.call("sandbox_create"))["id"]  # the session's end's
        tree = await self.client.read_resource(AnyUrl("slicebox://tree"))
        self.seen["tree_resource"] = isinstance(tree.contents[0], types.TextResourceContents)


async def main(other: str) -> dict[str, Any]:
    started = time.monotonic()
    async with stdio_client(SERVER) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        driver = Driver(client)
        await driver.run(other)
    return {**driver.seen, "seconds": time.monotonic() - started}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
