"""The program ``slicebox``: the process is made lean (:mod:`slicebox.host.lean`) before the CLI,
its models and its client are imported, then :func:`slicebox.cli.main.main` runs.

Each ``slicebox`` command is a new process, and its imports are most of what it costs:
pydantic's plugin discovery (``importlib.metadata`` reading every installed distribution's
metadata) and pydantic 2.10's self-check of each schema it builds are paid for nothing. A
command also carries what the agent guards (a git token given to ``create``), which no
third-party pydantic plugin is to see. Nothing else is imported here at module level.
"""

from __future__ import annotations

from slicebox.host.lean import lean_process, started


def main() -> int:
    lean_process()
    from slicebox.cli import main as cli

    started()  # a command may run long (a stream, a copy): it collects as any program does
    return cli.main()
