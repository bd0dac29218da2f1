"""A git workspace's clone: run inside the new sandbox, as its user, before its create answers.

Inside, because that is where git sees what the sandbox will see: its network (a sandbox with
``network: none`` cannot clone, and says so), its image's git, its uid (the files are its own),
and the credential helper at its own path. The clone goes into ``/workspace``, the fresh volume,
as ``git clone --depth N --branch REF``; a commit id is fetched by itself (``git fetch
--depth N origin <sha>``, then checked out) since a clone takes only branch and tag names.
The URL and ref reach ``sh`` as arguments, never inside the script.

git's progress (``--progress``: its counts, on stderr) is reported as it comes
(``core.gitcounts``), and the last of stderr is kept for an error's message.

A clone that fails, or outlasts its timeout, fails the create (``git_clone_failed``, quoting
git's last words with any token taken out), and the create removes everything it made.
"""

from __future__ import annotations

import asyncio
import re
import time

from slicebox.backends.base import WORKSPACE, ExecApi
from slicebox.core.gitcounts import GitCounts
from slicebox.model.errors import InvalidRequest
from slicebox.model.exec import ExecRequest, OutputStream
from slicebox.model.spec import Workspace

STDERR_KEPT = 4096
NOT_EXECUTABLE = 126
NOT_FOUND = 127
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_CLONE = (
    'set -e; cd "$0"; '
    'if [ -n "$4" ]; then git init -q .; git remote add origin "$1"; '
    'git fetch -q --progress $3 origin "$2"; git checkout -q FETCH_HEAD; '
    'else git clone -q --progress $3 ${2:+--branch "$2"} -- "$1" .; fi'
)


def clone_argv(workspace: Workspace) -> tuple[str, ...]:
    """``sh -c <script> /workspace URL REF DEPTH-FLAG COMMIT?`` for ``workspace``."""
    ref = workspace.ref or ""
    depth = f"--depth={workspace.depth}" if workspace.depth else ""
    commit = "yes" if _COMMIT.fullmatch(ref) else ""
    return ("sh", "-c", _CLONE, WORKSPACE, workspace.url or "", ref, depth, commit)


async def clone(
    execs: ExecApi,
    container_id: str,
    workspace: Workspace,
    *,
    timeout: float,
    secrets: tuple[str, ...] = (),
) -> None:
    """Clone ``workspace`` into the running sandbox; raise ``git_clone_failed`` if it fails."""
    request = ExecRequest(argv=clone_argv(workspace), cwd="/", timeout=timeout)
    exec_id = await execs.exec_create(container_id, request)
    attachment = await execs.exec_start(exec_id, b"")
    stderr = bytearray()
    counts = GitCounts(workspace.url or "")
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            chunks = await attachment.read(min(left, 1.0))
            if chunks is None:
                break
            for chunk in chunks:
                if chunk.stream is OutputStream.STDERR:
                    stderr += chunk.data
                    del stderr[:-STDERR_KEPT]  # git's last words say why; its counts come first
                    counts.feed(chunk.data)
        else:
            raise _failed(workspace, f"it took longer than {timeout:g} s", stderr, secrets)
    finally:
        attachment.close()
    code = await _exit_code(execs, exec_id)
    if code != 0:
        why = {
            NOT_FOUND: "the image has no git (or no sh)",
            NOT_EXECUTABLE: "the image's git cannot run",
        }.get(code if code is not None else -1, f"git exited {code}")
        raise _failed(workspace, why, stderr, secrets)


async def _exit_code(execs: ExecApi, exec_id: str) -> int | None:
    """The exit code; Docker may say the exec runs a moment after its stream ended."""
    for _ in range(50):
        state = await execs.exec_inspect(exec_id)
        if not state.running:
            return state.exit_code
        await asyncio.sleep(0.02)
    return None


def _failed(
    workspace: Workspace, why: str, stderr: bytes | bytearray, secrets: tuple[str, ...]
) -> InvalidRequest:
    said = stderr.decode(errors="replace").strip()
    for secret in secrets:
        said = said.replace(secret, "[redacted]")
    tail = f": {said[-1000:]}" if said else ""
    return InvalidRequest(
        f"cloning {workspace.url} failed ({why}){tail}; check the url, ref and credentials, "
        "and that the sandbox's network reaches the remote ('network: none' reaches nothing)",
        code="git_clone_failed",
    )
