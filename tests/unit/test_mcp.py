"""``slicebox mcp`` over the SDK's in-memory transport, against the agent's real app on a real
unix socket with the core over fakes (``tests.unit.agentserver``): every tool's schema, its
answers and refusals by code, progress while an exec streams, bytes that are not UTF-8, a cut
that is stated, the session's end and the deadline every sandbox made here gets."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from mcp import ClientSession, types
from mcp.shared.exceptions import McpError
from mcp.shared.memory import create_connected_server_and_client_session
from pydantic import AnyUrl

from slicebox.client import Client
from slicebox.mcp.calls import Progress
from slicebox.mcp.options import DEFAULT_TTL, parser
from slicebox.mcp.server import main, serving
from slicebox.mcp.session import Settings
from slicebox.mcp.tools import TOOLS
from slicebox.model.exec import OutputStream, StreamChunk
from tests.unit.agentserver import Agent, served, wait_for

OUT, ERR = OutputStream.STDOUT, OutputStream.STDERR
Body = Callable[[ClientSession], Awaitable[Any]]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with served(tmp_path) as running:
        yield running
        assert running.sandboxes() == [], "a test left a sandbox behind"


@asynccontextmanager
async def connected(agent: Agent, **settings: Any) -> AsyncIterator[ClientSession]:
    async with (
        serving(Settings(agent.socket, **settings)) as server,
        create_connected_server_and_client_session(server) as session,
    ):
        yield session


def over_mcp(agent: Agent, body: Body, **settings: Any) -> Any:
    async def session() -> Any:
        async with connected(agent, **settings) as client:
            return await body(client)

    return anyio.run(session)


def answer(result: types.CallToolResult) -> dict[str, Any]:
    assert not result.isError, result.content
    assert result.structuredContent is not None
    text = result.content[0]
    assert isinstance(text, types.TextContent)
    assert json.loads(text.text) == result.structuredContent  # the text says the same
    return result.structuredContent


def refusal(result: types.CallToolResult) -> dict[str, Any]:
    assert result.isError
    assert result.structuredContent is not None
    text = result.content[0]
    assert isinstance(text, types.TextContent)
    error = result.structuredContent
    assert text.text == f"{error['code']}: {error['message']}"
    return error


async def create(client: ClientSession, **arguments: Any) -> str:
    made = answer(await client.call_tool("sandbox_create", arguments))
    return str(made["id"])


# --- the tools' descriptions -----------------------------------------------------------------


def test_every_tool_has_a_valid_schema_and_all_four_hints(agent: Agent) -> None:
    async def body(client: ClientSession) -> list[types.Tool]:
        return (await client.list_tools()).tools

    tools = over_mcp(agent, body)
    assert {tool.name for tool in tools} == set(TOOLS) >= {
        "sandbox_create", "sandbox_list", "sandbox_get", "sandbox_destroy", "sandbox_exec",
        "run", "file_read", "file_write", "dir_list", "tree_upload", "tree_download",
        "sandbox_usage", "level_tree", "sandbox_extend",
    }  # fmt: skip
    for tool in tools:
        jsonschema.Draft202012Validator.check_schema(tool.inputSchema)
        assert tool.inputSchema["type"] == "object"
        assert tool.inputSchema["additionalProperties"] is False
        hints = tool.annotations
        assert hints is not None
        flags = (hints.readOnlyHint, hints.destructiveHint, hints.idempotentHint)
        assert all(isinstance(flag, bool) for flag in (*flags, hints.openWorldHint)), tool.name
    by_name = {tool.name: tool for tool in tools}
    assert by_name["sandbox_list"].annotations.readOnlyHint is True
    assert by_name["sandbox_destroy"].annotations.destructiveHint is True
    assert by_name["sandbox_exec"].annotations.openWorldHint is True


def test_the_schemas_are_the_agents_own_fields() -> None:
    create_schema = TOOLS["sandbox_create"].tool().inputSchema
    assert {"image", "memory", "cpus", "pids", "workspace", "egress", "ttl_seconds", "backend",
            "keep"} <= set(create_schema["properties"])  # fmt: skip
    assert create_schema["properties"]["ttl_seconds"]["anyOf"][0]["exclusiveMinimum"] == 0
    exec_schema = TOOLS["sandbox_exec"].tool().inputSchema
    assert exec_schema["required"] == ["sandbox_id", "argv"]
    assert exec_schema["properties"]["output_cap"]["maximum"] == 16 * 1024 * 1024
    jsonschema.validate({"sandbox_id": "x", "argv": ["true"]}, exec_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"sandbox_id": "x", "argv": ["true"], "privileged": True}, exec_schema)


# --- sandboxes and the session's end ---------------------------------------------------------


def test_a_session_destroys_what_it_made_unless_kept_and_gives_each_a_deadline(
    agent: Agent,
) -> None:
    async def body(client: ClientSession) -> tuple[str, str]:
        kept = await create(client, keep=True, project="web")
        doomed = await create(client, memory="128MB")
        listed = answer(await client.call_tool("sandbox_list", {}))["sandboxes"]
        assert {view["id"] for view in listed} == {kept, doomed}
        assert answer(await client.call_tool("sandbox_get", {"sandbox_id": doomed}))["id"] == doomed
        return kept, doomed

    kept, _doomed = over_mcp(agent, body)
    assert agent.sandboxes() == [kept]
    view = Client(agent.socket).get(kept)
    assert view.expires_at is not None
    assert (view.expires_at - view.created_at).total_seconds() == pytest.approx(DEFAULT_TTL, abs=5)
    assert Client(agent.socket).destroy(kept).destroyed


def test_a_create_or_the_session_sets_the_ttl_never_none(agent: Agent) -> None:
    async def body(client: ClientSession) -> list[float]:
        ids = [await create(client, ttl_seconds=60), await create(client)]
        views = [Client(agent.socket).get(each) for each in ids]
        return [(v.expires_at - v.created_at).total_seconds() for v in views if v.expires_at]

    assert over_mcp(agent, body, ttl=300) == [pytest.approx(60, abs=5), pytest.approx(300, abs=5)]


def test_the_ttl_comes_from_the_option_or_the_environment_and_is_never_unbounded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parser().parse_args([]).ttl == DEFAULT_TTL == 3600
    monkeypatch.setenv("SLICEBOX_MCP_TTL", "120")
    assert parser().parse_args([]).ttl == 120
    assert parser().parse_args(["--ttl", "30"]).ttl == 30
    assert main(["--ttl", "0"]) == 2
    assert "invalid_request" in capsys.readouterr().err


def test_destroy_usage_extend_and_the_tree(agent: Agent) -> None:
    async def body(client: ClientSession) -> None:
        box = await create(client)
        ref = {"sandbox_id": box}
        usage = answer(await client.call_tool("sandbox_usage", ref))
        assert usage["sandbox"]["backend"] == "docker"
        assert answer(await client.call_tool("level_tree", {}))["unit"] == "slicebox.slice"
        moved = answer(await client.call_tool("sandbox_extend", {**ref, "ttl_seconds": 600}))
        assert moved["expires_at"] is not None
        gone = answer(await client.call_tool("sandbox_destroy", ref))
        assert gone["destroyed"] is True
        assert answer(await client.call_tool("sandbox_destroy", ref))["destroyed"] is False

    over_mcp(agent, body)


def test_refusals_carry_the_agents_code_and_message(agent: Agent) -> None:
    async def body(client: ClientSession) -> dict[str, dict[str, Any]]:
        box = await create(client)
        calls: dict[str, tuple[str, dict[str, Any]]] = {
            "not_found": ("sandbox_get", {"sandbox_id": "sbx-nosuch"}),
            "invalid_command": ("sandbox_exec", {"sandbox_id": box, "argv": []}),
            "invalid_timeout": ("sandbox_exec", {"sandbox_id": box, "argv": ["x"], "timeout": 0}),
            "invalid_field": ("sandbox_get", {"sandbox_id": box, "extra": 1}),
            "invalid_limit": ("sandbox_create", {"memory": "lots"}),
            "invalid_request": ("no_such_tool", {}),
            "ttl_too_long": ("sandbox_extend", {"sandbox_id": box, "ttl_seconds": 10**9}),
        }
        return {
            code: refusal(await client.call_tool(name, arguments))
            for code, (name, arguments) in calls.items()
        }

    for code, error in over_mcp(agent, body).items():
        assert error["code"] == code
        assert error["message"]
    assert agent.world.journal.events()  # the agent audited what reached it


# --- exec -------------------------------------------------------------------------------------


def test_output_that_is_not_utf8_comes_back_base64_and_says_so(agent: Agent) -> None:
    async def body(client: ClientSession) -> dict[str, Any]:
        box = await create(client)
        agent.script((OUT, b"\xff\x00bin"), (ERR, "é\n".encode()), exit_code=3)
        return answer(await client.call_tool("sandbox_exec", {"sandbox_id": box, "argv": ["x"]}))

    ran = over_mcp(agent, body)
    assert ran["stdout_encoding"] == "base64"
    assert base64.b64decode(ran["stdout"]) == b"\xff\x00bin"
    assert (ran["stderr"], ran["stderr_encoding"]) == ("é\n", "utf-8")
    assert ran["exit_code"] == 3


def test_a_cut_is_stated_with_the_bytes_left_out(agent: Agent) -> None:
    async def body(client: ClientSession) -> dict[str, Any]:
        box = await create(client)
        agent.script((OUT, b"x" * 1000))
        arguments = {"sandbox_id": box, "argv": ["yes"], "output_cap": 10}
        return answer(await client.call_tool("sandbox_exec", arguments))

    ran = over_mcp(agent, body)
    assert (ran["stdout"], ran["stdout_truncated"], ran["stdout_dropped_bytes"]) == (
        "x" * 10, True, 990,
    )  # fmt: skip
    assert ran["stderr_truncated"] is False


def test_a_shell_line_and_stdin_reach_the_agent_as_its_request(agent: Agent) -> None:
    async def body(client: ClientSession) -> None:
        box = await create(client)
        run = agent.script((OUT, b"ok"))
        arguments = {"sandbox_id": box, "argv": "echo hi | wc", "shell": True, "stdin": "in"}
        answer(await client.call_tool("sandbox_exec", arguments))
        assert run.request is not None
        assert run.request.argv == ("sh", "-c", "echo hi | wc")
        assert run.request.stdin == b"in"

    over_mcp(agent, body)


def test_a_directory_is_listed_by_a_script_in_the_sandbox(agent: Agent) -> None:
    async def body(client: ClientSession) -> tuple[dict[str, Any], dict[str, Any]]:
        box = await create(client)
        run = agent.script((OUT, b"file\x003\x00a.txt\x00directory\x00\x00src\x00"))
        listed = answer(await client.call_tool("dir_list", {"sandbox_id": box, "path": "/w"}))
        assert run.request is not None
        assert run.request.argv[-1] == "/w"
        agent.script((ERR, b"cd: can't cd to /nope"), exit_code=3)
        where = {"sandbox_id": box, "path": "/nope"}
        return listed, refusal(await client.call_tool("dir_list", where))

    listed, missing = over_mcp(agent, body)
    assert [(e["name"], e["kind"], e["size"]) for e in listed["entries"]] == [
        ("a.txt", "file", 3), ("src", "directory", None),
    ]  # fmt: skip
    assert missing["code"] == "file_not_found"
    assert "can't cd" in missing["message"]


def test_progress_reports_output_as_it_streams(agent: Agent) -> None:
    reports: list[tuple[float, str | None]] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        reports.append((progress, message))

    async def body(client: ClientSession) -> dict[str, Any]:
        box = await create(client)
        agent.script((OUT, b"compiling\n"), (ERR, b"warning\n"), (OUT, b"done\n"))
        arguments = {"sandbox_id": box, "argv": ["make"]}
        return answer(await client.call_tool("sandbox_exec", arguments, progress_callback=progress))

    ran = over_mcp(agent, body)
    assert ran["stdout"] == "compiling\ndone\n"
    dones = [done for done, _ in reports]
    assert dones == sorted(set(dones)), "progress only grows"
    assert reports[:1] == [(len(b"compiling\n"), "stdout: compiling\n")]


def test_progress_is_at_most_one_notification_a_period() -> None:
    sent: list[tuple[float, str]] = []
    now = [0.0]

    async def send(done: float, message: str) -> None:
        sent.append((done, message))

    async def chunks() -> None:
        progress = Progress(send, clock=lambda: now[0])
        for step, data in enumerate((b"a", b"", b"bb", b"\xffc")):
            now[0] = step * 0.06
            await progress.chunk(StreamChunk(stream=OUT, data=data))

    anyio.run(chunks)
    assert sent == [(1, "stdout: a"), (3, "stdout: bb")]  # at 0.12 s; the one at 0.18 s waits


def test_a_session_that_ends_mid_exec_has_the_command_killed_and_audited_abandoned(
    agent: Agent,
) -> None:
    async def body() -> None:
        async with connected(agent) as client:
            box = await create(client)
            run = agent.script(*[(OUT, b"y" * 65536)] * 1000)
            agent.world.host.procs[run.pid] = 100
            streaming = anyio.Event()

            async def progress(progress: float, total: float | None, message: str | None) -> None:
                streaming.set()

            async with anyio.create_task_group() as group:
                arguments = {"sandbox_id": box, "argv": ["yes"], "output_cap": 16 * 1024 * 1024}
                group.start_soon(
                    lambda: client.call_tool("sandbox_exec", arguments, progress_callback=progress)
                )
                await streaming.wait()
                group.cancel_scope.cancel()

    anyio.run(body)  # the session ended: its server's calls were cancelled
    wait_for(lambda: agent.world.host.kill_calls)
    wait_for(lambda: [e for e in agent.world.journal.events() if e[0] == "exec"])
    assert [e for e in agent.world.journal.events() if e[0] == "exec"] == [("exec", "abandoned")]


def test_a_one_shot_run_answers_its_output_and_usage(agent: Agent) -> None:
    async def body(client: ClientSession) -> list[dict[str, Any]]:
        answers = []
        for progress in (None, _ignore):
            agent.script((OUT, b"once\n"))
            arguments = {"argv": ["x"], "sandbox": {"project": "web", "memory": "64MB"}}
            answers.append(
                answer(await client.call_tool("run", arguments, progress_callback=progress))
            )
        return answers

    for ran in over_mcp(agent, body):
        assert (ran["stdout"], ran["exit_code"]) == ("once\n", 0)
        assert ran["sandbox_id"]


async def _ignore(progress: float, total: float | None, message: str | None) -> None:
    return None


# --- resources --------------------------------------------------------------------------------


def test_the_tree_and_a_sandboxs_usage_are_resources(agent: Agent) -> None:
    async def body(client: ClientSession) -> None:
        listed = (await client.list_resources()).resources
        assert [str(r.uri) for r in listed] == ["slicebox://tree"]
        templates = (await client.list_resource_templates()).resourceTemplates
        assert [t.uriTemplate for t in templates] == ["slicebox://sandboxes/{sandbox_id}/usage"]
        tree = (await client.read_resource(AnyUrl("slicebox://tree"))).contents[0]
        assert isinstance(tree, types.TextResourceContents)
        assert json.loads(tree.text)["unit"] == "slicebox.slice"
        box = await create(client)
        usage = await client.read_resource(AnyUrl(f"slicebox://sandboxes/{box}/usage"))
        assert isinstance(usage.contents[0], types.TextResourceContents)
        assert json.loads(usage.contents[0].text)["sandbox"]["backend"] == "docker"
        with pytest.raises(McpError) as missing:
            await client.read_resource(AnyUrl("slicebox://sandboxes/sbx-nosuch/usage"))
        assert missing.value.error.message.startswith("not_found: ")

    over_mcp(agent, body)


def test_a_create_s_pull_is_forwarded_as_progress_up_to_its_total(agent: Agent) -> None:
    image = "localhost:5000/slicebox-test/big:1"
    agent.world.docker.registry.add(image)
    reports: list[tuple[float, str | None]] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        reports.append((progress, message))

    async def body(client: ClientSession) -> dict[str, Any]:
        arguments = {"image": image}
        made = answer(
            await client.call_tool("sandbox_create", arguments, progress_callback=progress)
        )
        await client.call_tool("sandbox_destroy", {"sandbox_id": made["id"]})
        return made

    assert over_mcp(agent, body)["id"]
    dones = [done for done, _ in reports]
    assert dones == sorted(set(dones)), "progress only grows"
    messages = [message or "" for _, message in reports]
    assert f"pulling {image}: 24 MiB of 24 MiB, 1/1 layers" in messages
    assert messages[-1] == f"starting {image}"
