"""The tools as data: each one's name, what it does, its arguments' model (whose JSON schema is
its ``inputSchema``), the coroutine that answers it and its MCP annotations. Hints are honest
about what a call does to the sandboxes: ``openWorldHint`` only where arbitrary commands run
(what they reach is the sandbox's egress, the operator's grant)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mcp import types

from slicebox.mcp import calls, inputs
from slicebox.mcp.outputs import Json
from slicebox.model.base import Model

Call = Callable[..., Awaitable[Json]]


@dataclass(frozen=True)
class Hints:
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False
    open_world: bool = False


READ = Hints(read_only=True, idempotent=True)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    args: type[Model]
    call: Call
    hints: Hints
    streams: bool = False  # takes a calls.Progress: its output is reported as it comes

    def tool(self) -> types.Tool:
        hints = self.hints
        annotations = types.ToolAnnotations(
            title=self.title,
            readOnlyHint=hints.read_only,
            destructiveHint=hints.destructive,
            idempotentHint=hints.idempotent,
            openWorldHint=hints.open_world,
        )
        return types.Tool(
            name=self.name,
            title=self.title,
            description=self.description,
            inputSchema=input_schema(self.args),
            annotations=annotations,
        )


def input_schema(args: type[Model]) -> dict[str, Any]:
    schema = args.model_json_schema()
    schema.pop("title", None)
    schema.pop("description", None)
    return schema


_SPECS = (
    ToolSpec(
        "sandbox_create",
        "Create a sandbox",
        "Create a sandbox (a container with no capabilities and no network unless egress "
        "allows it) and answer its id. It has a deadline (ttl_seconds, or this server's "
        "default) and is destroyed when this MCP session ends unless keep is true. Progress "
        "notifications tell an image's pull and a clone as they go when the request has a "
        "progressToken.",
        inputs.CreateArgs,
        calls.create,
        Hints(),
        streams=True,
    ),
    ToolSpec(
        "sandbox_list",
        "List sandboxes",
        "Your sandboxes: id, project, limits, deadline.",
        inputs.NoArgs,
        calls.list_sandboxes,
        READ,
    ),
    ToolSpec("sandbox_get", "Get a sandbox", "One sandbox.", inputs.SandboxRef, calls.get, READ),
    ToolSpec(
        "sandbox_destroy",
        "Destroy a sandbox",
        "Destroy a sandbox and answer its final resource usage (again: destroyed false).",
        inputs.SandboxRef,
        calls.destroy,
        Hints(destructive=True, idempotent=True),
    ),
    ToolSpec(
        "sandbox_exec",
        "Run a command in a sandbox",
        "Run a command (argv without a shell, or one line with shell: true) and answer its "
        "exit code and output; 124 and timed_out when it ran past timeout. Output that is not "
        "UTF-8 comes back base64 (stdout_encoding); output past output_cap is cut and said so "
        "(stdout_truncated, stdout_dropped_bytes). Progress notifications carry output as it "
        "comes when the request has a progressToken.",
        inputs.ExecInArgs,
        calls.exec_,
        Hints(destructive=True, open_world=True),
        streams=True,
    ),
    ToolSpec(
        "run",
        "Run a command once",
        "One-shot: a fresh sandbox (from a warm pool when one matches), the command, and the "
        "sandbox destroyed; answers as sandbox_exec does, with the final usage.",
        inputs.RunArgs,
        calls.run,
        Hints(open_world=True),
        streams=True,
    ),
    ToolSpec(
        "file_read",
        "Read a file",
        "A file's content: text, or base64 when not UTF-8 (content_encoding); at most "
        "max_bytes, and truncated says when there was more.",
        inputs.ReadArgs,
        calls.read_file,
        READ,
    ),
    ToolSpec(
        "file_write",
        "Write a file",
        "Write content (text) or content_base64 (bytes) to a file, replacing it.",
        inputs.WriteArgs,
        calls.write_file,
        Hints(destructive=True, idempotent=True),
    ),
    ToolSpec(
        "dir_list",
        "List a directory",
        "A directory's entries: name, kind (file, directory, symlink, other), a file's size.",
        inputs.ListArgs,
        calls.list_dir,
        READ,
    ),
    ToolSpec(
        "tree_upload",
        "Upload a tree",
        "Extract a tar archive (base64) into a directory of the sandbox; bounded by the "
        "agent's files_max_bytes (file_too_large) and this server's --max-transfer.",
        inputs.UploadArgs,
        calls.upload,
        Hints(destructive=True, idempotent=True),
    ),
    ToolSpec(
        "tree_download",
        "Download a tree",
        "A file or directory of the sandbox as a tar archive (base64); one larger than the "
        "agent's files_max_bytes or this server's --max-transfer is refused (file_too_large).",
        inputs.PathArgs,
        calls.download,
        READ,
    ),
    ToolSpec(
        "sandbox_usage",
        "A sandbox's resource usage",
        "ResourceUsage from cgroup v2: memory of its three levels, CPU seconds, disk, network.",
        inputs.SandboxRef,
        calls.usage,
        READ,
    ),
    ToolSpec(
        "level_tree",
        "The level tree",
        "Every level you may see (slicebox, users, projects, sandboxes): memory, CPU, "
        "throttling, pids, OOM kills.",
        inputs.NoArgs,
        calls.tree,
        READ,
    ),
    ToolSpec(
        "sandbox_extend",
        "Extend a deadline",
        "Move a sandbox's deadline to ttl_seconds from now (at most the agent's maximum).",
        inputs.ExtendArgs,
        calls.extend,
        Hints(idempotent=True),
    ),
)

TOOLS: dict[str, ToolSpec] = {spec.name: spec for spec in _SPECS}
