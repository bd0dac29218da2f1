"""Runs inside a nested sandbox (tests/host/test_nested.py): the slicebox client and CLI as an
agent in the sandbox would use them, with nothing but the environment the agent gave it
(``SLICEBOX_SOCKET``, ``SLICEBOX_PROJECT``). Its one argument is a JSON list of steps, each
``[op, *args]``; it prints one JSON list of answers, each ``{"ok": ...}`` or ``{"code": ...}``.
Sent on stdin (``python3 - STEPS``): the image holds the client, not the tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from slicebox.client import Client
from slicebox.model.api import CreateSandbox, Extend
from slicebox.model.capacity import CapacityQuery
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecRequest


def _create(client: Client, fields: dict[str, Any]) -> str:
    body = {"project": os.environ.get("SLICEBOX_PROJECT", "default"), **fields}
    return client.create(CreateSandbox.model_validate(body)).id


def _exec(client: Client, sandbox_id: str, argv: list[str]) -> dict[str, Any]:
    result = client.exec(sandbox_id, ExecRequest(argv=tuple(argv), timeout=120))
    return {"exit_code": result.exit_code, "stdout": result.stdout.decode(errors="replace")}


def _cli(argv: list[str]) -> dict[str, Any]:
    ran = subprocess.run(["slicebox", *argv], capture_output=True, text=True, check=False)
    return {"rc": ran.returncode, "stdout": ran.stdout.strip(), "stderr": ran.stderr.strip()}


def _raw(path: str) -> str:
    """A health request on a socket at ``path``: its status line, or the error's name."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(path)
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return sock.recv(4096).decode(errors="replace").split("\r\n", 1)[0]
    except OSError as exc:
        return type(exc).__name__


def _flood(path: str, count: int) -> list[str]:
    """``count`` connections held open at once, then a health request on one more: its status
    line; then, all closed, the status line of a health request again."""
    held = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            held.append(sock)
        over = _raw(path)
    finally:
        for sock in held:
            sock.close()
    after = _raw(path)
    for _ in range(40):  # the agent sees the closes a moment later
        if after.startswith("HTTP/1.1 200"):
            break
        time.sleep(0.5)
        after = _raw(path)
    return [over, after]


OPS: dict[str, Callable[..., Any]] = {
    "create": _create,
    "exec": _exec,
    "usage": lambda c, i: c.usage(i).model_dump(mode="json"),
    "list": lambda c: sorted(v.id for v in c.list_sandboxes()),
    "destroy": lambda c, i: c.destroy(i).destroyed,
    "extend": lambda c, i, ttl: c.extend(i, Extend(ttl_seconds=ttl)).expires_at is not None,
    "tree": lambda c: c.level_tree().name,
    "capacity": lambda c: c.capacity(CapacityQuery()).model_dump(mode="json") and "answered",
    "pools": lambda c: len(c.pools().pools),
    "reap": lambda c: len(c.reap().plan),
    "health": lambda c: c.health().user,
    "env": lambda c, name: os.environ.get(name, ""),
}


def main() -> int:
    steps = json.loads(sys.argv[1])
    client = Client()
    answers: list[dict[str, Any]] = []
    for op, *args in steps:
        try:
            if op == "cli":
                answers.append({"ok": _cli(*args)})
            elif op == "raw":
                answers.append({"ok": _raw(*args)})
            elif op == "flood":
                answers.append({"ok": _flood(*args)})
            else:
                answers.append({"ok": OPS[op](client, *args)})
        except SliceboxError as exc:
            answers.append({"code": exc.code, "message": exc.message})
    print(json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
