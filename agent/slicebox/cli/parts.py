"""The parts of a create request that the command line gives in its own words: the
workspace, git credentials, env, nesting and a wasm plugin, each checked as the agent would
(a bad one names its field)."""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Iterable
from pathlib import Path

from slicebox.model.errors import InvalidRequest


def workspace(options: argparse.Namespace) -> dict[str, object] | None:
    given = options.workspace
    if given is None:
        if options.keep or options.read_only:
            raise InvalidRequest("--keep and --read-only need --workspace", field="workspace")
        return None
    kind, _, what = given.partition(":")
    workspace: dict[str, object] = {"kind": kind, "read_only": options.read_only}
    if kind == "host":
        workspace["path"] = what or None
    elif kind == "git":
        url, _, ref = what.partition("#")
        workspace.update({"url": url or None, "ref": ref or None})
    elif what:
        workspace["name"] = what
    if options.keep:
        workspace["keep"] = True
    return workspace


def credentials(options: argparse.Namespace) -> dict[str, object] | None:
    path = options.git_token_file
    if path is None:
        if options.git_username or options.git_host:
            raise InvalidRequest(
                "--git-username and --git-host need --git-token-file", field="credentials"
            )
        return None
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise InvalidRequest(
            f"--git-token-file {path}: {exc.strerror}; give a readable file holding the token",
            field="credentials",
        ) from exc
    git: dict[str, object] = {"token": text.strip(), "hosts": options.git_host}
    if options.git_username:
        git["username"] = options.git_username
    return {"git": git}


def env(items: Iterable[str]) -> dict[str, str]:
    pairs = [item.partition("=") for item in items]
    bad = [name for name, sep, _ in pairs if not sep or not name]
    if bad:
        raise InvalidRequest(f"--env takes NAME=VALUE, not {bad[0]!r}", field="env")
    return {name: value for name, _, value in pairs}


def nested(given: str | None) -> dict[str, object] | None:
    if given is None:
        return None
    children, _, depth = given.partition(":")
    if not children.isdigit() or (depth and not depth.isdigit()):
        raise InvalidRequest(
            f"--nested takes CHILDREN[:DEPTH], whole numbers, not {given!r}", field="nested"
        )
    return {"max_children": int(children), "max_depth": int(depth or 1)}


def plugin(options: argparse.Namespace) -> dict[str, str] | None:
    """A wasm sandbox's plugin: a file of the caller's is read here, as they can, and sent."""
    if options.plugin:
        try:
            module = Path(options.plugin).read_bytes()
        except OSError as exc:
            raise InvalidRequest(
                f"--plugin {options.plugin}: {exc.strerror}", field="wasm.module"
            ) from exc
        return {"module": base64.b64encode(module).decode()}
    if options.plugin_path:
        return {"path": options.plugin_path}
    if options.plugin_sha256:
        return {"sha256": options.plugin_sha256}
    return None
