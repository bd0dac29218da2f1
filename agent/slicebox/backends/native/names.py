"""A native sandbox's names: its slice, its anchor, its execs' scopes, its dynamic user, its
init's socket and the cgroups they make.

Each is made from the sandbox's name and read back from a unit's, so the backend, the router
(which tells a native id or exec from another backend's by its shape) and a listing of units
know a native sandbox by its names alone, with no state file between them.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from slicebox.model.names import escape, unescape

ANCHOR_PREFIX = "slicebox-native-"
EXEC_PREFIX = "slicebox-exec-"
INIT_RUNTIME = "slicebox/init"  # below /run: each native sandbox's init's runtime directory
INIT_SOCKET = "init.sock"
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,30}")


def anchor_unit(name: str) -> str:
    return f"{ANCHOR_PREFIX}{name}.service"


def sandbox_slice(project_slice: str, name: str) -> str:
    """The sandbox's own slice, nested in its project's (a dash in ``name`` escaped)."""
    return f"{project_slice.removesuffix('.slice')}-{escape(name)}.slice"


def name_of(slice_unit: str) -> str:
    """The sandbox name a native sandbox slice was made for (``sandbox_slice`` inverted)."""
    return unescape(slice_unit.removesuffix(".slice").rsplit("-", 1)[-1])


def is_native_id(backend_id: str) -> bool:
    """Whether a backend id is a native sandbox's (its slice), not a container id."""
    return backend_id.endswith(".slice")


def sandbox_name(backend_id: str) -> str:
    """The sandbox name behind a native backend id (its slice) or the name itself."""
    return name_of(backend_id) if is_native_id(backend_id) else backend_id


def is_native_exec(exec_id: str) -> bool:
    return exec_id.startswith(EXEC_PREFIX)


def exec_scope(name: str, token: str) -> str:
    """An exec's scope, the cgroup its processes stay in whatever they fork."""
    return f"{EXEC_PREFIX}{name}-{token}.scope"


def init_socket(runtime: Path, name: str) -> Path:
    """Where the sandbox's init listens: its own runtime directory below ``runtime``."""
    return runtime / name / INIT_SOCKET


def slice_cgroup(slice_unit: str) -> str:
    """A slice's cgroup below the root, as systemd nests it: ``a-b.slice`` in ``a.slice``."""
    parts = slice_unit.removesuffix(".slice").split("-")
    return "/" + "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def unit_cgroup(backend_id: str, unit: str) -> str:
    """The cgroup of ``unit`` (the anchor, an exec's scope) in the sandbox slice ``backend_id``."""
    return f"{slice_cgroup(backend_id)}/{unit}"


def dynamic_user(name: str) -> str:
    """The dynamic user's name: one per sandbox, so its units share one uid."""
    user = f"slicebox-{name}".lower()
    return user if _USER.fullmatch(user) else "slicebox-" + secrets.token_hex(8)


def glob_literal(text: str) -> str:
    """``text`` as a glob that matches only itself. systemd matches unit patterns with
    ``FNM_NOESCAPE``: a backslash (``\\x2d``) is itself, a special is put in brackets."""
    return re.sub(r"([*?\[])", r"[\1]", text)
