"""``slicebox mcp``: slicebox's MCP server on stdio (:mod:`slicebox.mcp`), for an MCP client's
server list (``"command": "slicebox", "args": ["mcp"]``).

The server needs the ``mcp`` SDK (1.x), which needs a newer pydantic than Debian's that the
agent runs on. When this Python imports the SDK (``pip install slicebox[mcp]`` in a venv) it
runs here; otherwise in the venv of ``$SLICEBOX_MCP_PYTHON``, else ``/opt/slicebox-mcp``,
made with ``--system-site-packages`` so that it sees the installed slicebox while its own SDK
and pydantic shadow nothing of the agent's (``docs/mcp.md``).
"""

from __future__ import annotations

import argparse
import os

from slicebox.client import Client
from slicebox.mcp.options import add_options
from slicebox.model.errors import Unavailable

PYTHON_ENV = "SLICEBOX_MCP_PYTHON"
VENV = "/opt/slicebox-mcp"
DEFAULT_PYTHON = f"{VENV}/bin/python"
INSTALL = (
    f"sudo python3 -m venv --system-site-packages {VENV} && "
    f"sudo {VENV}/bin/pip install 'mcp>=1.20,<2'"
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("mcp", help="slicebox's tools for MCP clients, on stdio")
    add_options(parser)


def run(options: argparse.Namespace, client: Client) -> int:
    argv = [
        *("--socket", options.socket, "--project", options.project),
        *("--ttl", str(options.ttl), "--max-transfer", str(options.max_transfer)),
    ]
    if sdk_here():
        from slicebox.mcp.server import main

        return main(argv)
    python = venv_python(os.environ)
    os.execv(python, [python, "-m", "slicebox.mcp", *argv])  # noqa: S606 -- a fixed program
    raise AssertionError("execv returns only by raising")


def sdk_here() -> bool:
    """Whether this Python runs the SDK: present, and importable with this pydantic."""
    try:
        import mcp.server.lowlevel  # noqa: F401
    except Exception:  # an SDK too new for this pydantic fails in many ways
        return False
    return True


def venv_python(environ: dict[str, str] | os._Environ[str]) -> str:
    """The python of the MCP venv: ``$SLICEBOX_MCP_PYTHON``, else the default path."""
    given = environ.get(PYTHON_ENV)
    python = given or DEFAULT_PYTHON
    if os.access(python, os.X_OK):
        return python
    where = f"${PYTHON_ENV} ({given})" if given else DEFAULT_PYTHON
    raise Unavailable(
        f"slicebox mcp needs the MCP Python SDK (mcp 1.x), which this Python cannot import, "
        f"and {where} is not an executable python; install the SDK in its own environment: "
        f"{INSTALL}",
        code="mcp_unavailable",
    )
