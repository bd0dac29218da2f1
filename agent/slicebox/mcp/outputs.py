"""Answers as JSON a model reads: bytes as text when they are UTF-8, else base64, and said so
(``<name>_encoding``); a cut is stated (``<name>_truncated`` and the bytes left out), never
silent. Errors keep slicebox's stable ``code`` and its ``message``."""

from __future__ import annotations

import base64
from typing import Any

from pydantic import BaseModel

from slicebox.model.api import RunResult
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecResult

Json = dict[str, Any]
UTF8, BASE64 = "utf-8", "base64"


def encoded(name: str, data: bytes) -> Json:
    """``{name: text, name_encoding: "utf-8"}``, or the bytes in base64 when not UTF-8."""
    try:
        return {name: data.decode(UTF8), f"{name}_encoding": UTF8}
    except UnicodeDecodeError:
        return {name: base64_of(data), f"{name}_encoding": BASE64}


def base64_of(data: bytes) -> str:
    return base64.b64encode(data).decode()


def model(value: BaseModel) -> Json:
    dumped: Json = value.model_dump(mode="json")
    return dumped


def exec_result(result: ExecResult) -> Json:
    return {
        **encoded("stdout", result.stdout),
        **encoded("stderr", result.stderr),
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "stdout_truncated": result.stdout_truncated,
        "stderr_truncated": result.stderr_truncated,
        "stdout_dropped_bytes": result.stdout_dropped_bytes,
        "stderr_dropped_bytes": result.stderr_dropped_bytes,
        "duration": result.duration,
    }


def run_result(ran: RunResult) -> Json:
    usage = model(ran.usage) if ran.usage is not None else None
    return {"sandbox_id": ran.sandbox_id, **exec_result(ran.result), "usage": usage}


def file_read(path: str, data: bytes, truncated: bool) -> Json:
    """A file's bytes, or its head and ``truncated``."""
    return {"path": path, **encoded("content", data), "bytes": len(data), "truncated": truncated}


def error(exc: SliceboxError) -> Json:
    found: Json = {"code": exc.code, "message": exc.message}
    if exc.field is not None:
        found["field"] = exc.field
    return found


def error_text(exc: SliceboxError) -> str:
    return f"{exc.code}: {exc.message}"


# --- a directory listing ---------------------------------------------------------------------

# Run in the sandbox by sh as `sh -c LIST_SCRIPT sh PATH`: one record per entry, its kind, size
# and name each ended by a NUL byte, so any name (a newline in it) reads back as it is.
LIST_SCRIPT = r"""cd -- "$1" || exit 3
for f in * .[!.]* ..?*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  s=
  if [ -L "$f" ]; then k=symlink
  elif [ -d "$f" ]; then k=directory
  elif [ -f "$f" ]; then k=file; s=$(stat -c %s -- "$f" 2>/dev/null)
  else k=other; fi
  printf '%s\0%s\0%s\0' "$k" "$s" "$f"
done
"""


def listing(path: str, result: ExecResult) -> Json:
    fields = result.stdout.split(b"\0")
    records = [fields[i : i + 3] for i in range(0, len(fields) - 2, 3)]
    entries = [
        {**encoded("name", name), "kind": kind.decode(), "size": int(size) if size else None}
        for kind, size, name in records
    ]
    return {"path": path, "entries": entries, "truncated": result.stdout_truncated}
