"""The options of ``slicebox mcp`` (and ``python -m slicebox.mcp``, to which it passes them):
apart from the server, so that the CLI builds its parser without importing the SDK."""

from __future__ import annotations

import argparse
import os

from slicebox.model.paths import AGENT_SOCKET

TTL_ENV = "SLICEBOX_MCP_TTL"
DEFAULT_TTL = 3600  # seconds: an MCP-made sandbox's deadline unless its create gives one
DEFAULT_PROJECT = "default"  # as the CLI's --project
DEFAULT_MAX_TRANSFER = 32 * 1024 * 1024  # bytes one tool call moves as base64 at most


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slicebox mcp", description="slicebox's tools for MCP clients, on stdio"
    )
    parser.add_argument("--socket", default=AGENT_SOCKET, help="the agent's unix socket")
    add_options(parser)
    return parser


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options ``slicebox mcp`` takes, and passes on as they are."""
    parser.add_argument(
        "--ttl",
        type=int,
        default=os.environ.get(TTL_ENV) or DEFAULT_TTL,
        metavar="SECONDS",
        help=f"the deadline of a sandbox made here unless its create gives one (default "
        f"{DEFAULT_TTL}, or ${TTL_ENV})",
    )
    parser.add_argument(
        "--project",
        default=DEFAULT_PROJECT,
        help=f"the project of a sandbox made here unless its create names one ({DEFAULT_PROJECT})",
    )
    parser.add_argument(
        "--max-transfer",
        type=int,
        default=DEFAULT_MAX_TRANSFER,
        metavar="BYTES",
        help=f"bytes one file or tree call moves at most (default {DEFAULT_MAX_TRANSFER})",
    )
