"""The shell scripts Daytona runs in a sandbox, each started in ``/`` and naming every path
relative to it (see the package's docstring): the exec wrapper, the kill of an exec, and the
setup of ``/workspace`` at create. Pure: strings only."""

from __future__ import annotations

import shlex

from slicebox.backends.base import WORKSPACE
from slicebox.model.exec import ExecRequest

MARK = "SLICEBOX_EXEC"
STDIN_DIR = "/tmp"

# Made at create, in "/": the default exec cwd, writable by the sandbox's user (who may need
# sudo to make it in "/").
WORKSPACE_SETUP = (
    "d=" + shlex.quote("." + WORKSPACE) + "; "
    'mkdir -p -- "$d" 2>/dev/null || sudo -n mkdir -p -- "$d"; '
    '[ -w "$d" ] || sudo -n chown "$(id -u):$(id -g)" -- "$d"; '
    '[ -d "$d" ] && [ -w "$d" ]'
)


def exec_script(exec_id: str, request: ExecRequest, stdin_file: str | None) -> str:
    """The command line Daytona runs, in ``/``, for ``request`` (see the package's docstring)."""
    steps = []
    if stdin_file is None:
        steps.append("exec </dev/null")
    else:
        here = shlex.quote("." + stdin_file)
        steps.append(f"exec <{here} || exit 126; rm -f -- {here}")
    steps.append(f"cd -- {shlex.quote('.' + request.cwd)} || exit 126")
    steps.append(f"{MARK}={shlex.quote(exec_id)}; export {MARK}")
    steps.append('exec "$@"')
    return shlex.join(["sh", "-c", "; ".join(steps), "sh", *request.argv])


def kill_script(exec_id: str) -> str:
    """Kill (SIGKILL) every process whose environment carries the exec's mark; exit 0."""
    mark = shlex.quote(f"{MARK}={exec_id}")
    return shlex.join(
        [
            "sh",
            "-c",
            "for d in /proc/[0-9]*; do "
            f"tr '\\0' '\\n' <\"$d/environ\" 2>/dev/null | grep -qx {mark} && "
            'kill -9 "${d#/proc/}" 2>/dev/null; '
            "done; exit 0",
        ]
    )
