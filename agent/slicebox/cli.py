"""``slicebox``: the command line for people and scripts.

Human tables by default, ``--json`` for scripts. Errors print their stable code and the
message that says what to do, and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from slicebox import __version__, doctor
from slicebox.client import DEFAULT_SOCKET
from slicebox.errors import SliceboxError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slicebox", description=__doc__)
    parser.add_argument("--version", action="version", version=f"slicebox {__version__}")
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help="the agent's unix socket")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("doctor", help="check this host and the agent, and say what to fix")
    return parser


def cmd_doctor(options: argparse.Namespace) -> int:
    checks = doctor.run_checks(doctor.Host(agent_socket=options.socket))
    if options.json:
        print(json.dumps([check.model_dump() for check in checks], indent=2))
    else:
        for check in checks:
            mark = "ok  " if check.ok else "FAIL"
            print(f"{mark} {check.name:<20} {check.detail}")
            if not check.ok and check.fix:
                print(f"     {'':<20} fix: {check.fix}")
    return 0 if all(check.ok for check in checks) else 1


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        return cmd_doctor(options)
    except SliceboxError as exc:
        print(f"slicebox: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
