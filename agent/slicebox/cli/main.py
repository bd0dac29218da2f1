"""``slicebox``: the command line for people and scripts, on the typed ``Client``.

Human tables by default, ``--json`` for scripts. Errors print their stable code and the
message that says what to do, and exit 2; a command's own exit code passes through ``exec``
and ``run``. Their output is bytes: each stream goes to its own file descriptor exactly as the
command wrote it, as it is produced; stdin (when it is not a terminal) is sent as bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Generator, Sequence
from typing import BinaryIO, TypeVar

from pydantic import BaseModel, ValidationError

from slicebox import VersionAction
from slicebox.cli import capacity, copying, doctor, mcp, parts, progress, snapshots, tables
from slicebox.client import DEFAULT_SOCKET, Client
from slicebox.model.api import (
    CreateSandbox,
    Extend,
    ReapRequest,
    RunRequest,
    RunResult,
    SandboxList,
)
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import MAX_OUTPUT_CAP, ExecRequest, ExecResult, OutputStream, StreamChunk
from slicebox.model.nested import PROJECT_ENV
from slicebox.model.paths import SOCKET_ENV, agent_socket
from slicebox.model.validation import refusal

Command = Callable[[argparse.Namespace, Client], int]
M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", ExecResult, RunResult)
BROKEN_PIPE_EXIT = 141  # what a shell reports for a writer killed by SIGPIPE


def _sandbox_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--project",
        default=os.environ.get(PROJECT_ENV) or "default",
        help=f"project slice (default: ${PROJECT_ENV}, set in a nested sandbox, else default)",
    )
    parser.add_argument("--user", help="act for this user (root and slicebox-admin only)")
    parser.add_argument("--image", help="image (default: the agent's configured image)")
    parser.add_argument("--memory", help="memory limit, e.g. 256MB")
    parser.add_argument("--cpus", type=float, help="CPU limit, e.g. 0.5")
    parser.add_argument("--pids", type=int, help="process limit")
    parser.add_argument("--network", help="none (default) or bridge")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="HOST",
        help="egress to this name, *.domain, IPv4 network or any of these with :port, and "
        "nothing else (repeatable; DNS through the agent's resolver; replaces --network)",
    )
    parser.add_argument(
        "--backend",
        choices=("docker", "native", "wasm", "daytona"),
        help="docker (default; native when Docker is unavailable and the agent allows it), "
        "native (systemd units on the host, no image), wasm (an Extism plugin: --plugin) or "
        "daytona (a remote sandbox on the agent's Daytona API)",
    )
    plugin = parser.add_mutually_exclusive_group()
    plugin.add_argument(
        "--plugin", metavar="FILE", help="wasm: a .wasm file of yours, uploaded with the request"
    )
    plugin.add_argument(
        "--plugin-path",
        metavar="PATH",
        help="wasm: a .wasm file under your bind roots, on the host",
    )
    plugin.add_argument("--plugin-sha256", metavar="SHA", help="wasm: a plugin the agent holds")
    parser.add_argument("--ttl", type=int, help="seconds until the reaper destroys it")
    parser.add_argument("--root-task", help="root task id (lineage)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE, repeatable")
    parser.add_argument(
        "--workspace",
        metavar="KIND[:WHAT]",
        help="/workspace from host:PATH (a directory under your roots; the sandbox runs as "
        "you), volume[:NAME] (a volume of yours, made if new) or git:URL[#REF] (cloned into a "
        "new volume); default: a tmpfs",
    )
    parser.add_argument(
        "--git-token-file",
        metavar="PATH",
        help="a file holding the token git uses for the workspace and in the sandbox ('-': "
        "stdin); never give a token on the command line",
    )
    parser.add_argument("--git-username", help="the username that goes with the token")
    parser.add_argument(
        "--git-host",
        action="append",
        default=[],
        help="host[:port] the token is for, repeatable (default: any)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the workspace volume after its root task"
    )
    parser.add_argument("--read-only", action="store_true", help="mount the workspace read-only")
    parser.add_argument("--run-as", help="uid[:gid] or user name (default: a non-root uid)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="accept a reused warm-pool member (reset since its last run; default: never)",
    )
    parser.add_argument(
        "--nested",
        metavar="CHILDREN[:DEPTH]",
        help="give the sandbox a socket of its own on which it may create up to CHILDREN "
        "children alive at once, DEPTH levels deep (default 1), and act on them "
        "(docs/nested.md)",
    )


def _exec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, help="seconds before the command is killed")
    parser.add_argument(
        "--function",
        metavar="NAME",
        help="wasm: the plugin's function to call; the words after -- (or stdin) its input",
    )
    parser.add_argument("--cwd", help="working directory (default /workspace)")
    parser.add_argument(
        "--output-cap",
        type=int,
        metavar="BYTES",
        help=f"bytes kept of each of stdout and stderr (default 50000, at most {MAX_OUTPUT_CAP})",
    )
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its arguments")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slicebox", description=__doc__)
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument(
        "--socket",
        default=agent_socket(),
        help=f"the agent's unix socket (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET})",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("-q", "--quiet", action="store_true", help="show no progress")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("doctor", help="check this host and the agent, and say what to fix")
    run = commands.add_parser("run", help="one-shot: create a sandbox, run a command, destroy")
    _sandbox_options(run)
    _exec_options(run)
    create = commands.add_parser("create", help="create a sandbox and print its id")
    _sandbox_options(create)
    snapshots.add_create_options(create)
    commands.add_parser("ps", help="list your sandboxes")
    execute = commands.add_parser("exec", help="run a command in a sandbox")
    execute.add_argument("sandbox")
    _exec_options(execute)
    remove = commands.add_parser("rm", help="destroy sandboxes (prints final usage)")
    remove.add_argument("sandboxes", nargs="+")
    usage = commands.add_parser("usage", help="a sandbox's ResourceUsage, or the level tree")
    usage.add_argument("sandbox", nargs="?")
    top = commands.add_parser("top", help="the live level tree")
    top.add_argument("--interval", type=float, default=2.0)
    top.add_argument("--count", type=int, default=0, help="refreshes (0: until interrupted)")
    extend = commands.add_parser("extend", help="move a sandbox's deadline to SECONDS from now")
    extend.add_argument("sandbox")
    extend.add_argument("seconds", type=int)
    cp = commands.add_parser(
        "cp",
        help="copy files in or out of a sandbox: cp ./src ID:/workspace/src, cp ID:/path ./dst",
        description=copying.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cp.add_argument("source", help="a local path, - (a tar on stdin), or SANDBOX:/path")
    cp.add_argument("destination", help="SANDBOX:/path, a local path, or - (a tar on stdout)")
    commands.add_parser("pool", help="the warm pools: key, ready/busy, hit rate, refill time")
    capacity.add_parser(commands)
    mcp.add_parser(commands)
    snapshots.add_parsers(commands)
    reap = commands.add_parser("reap", help="one reaper pass now (root and slicebox-admin)")
    reap.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    return parser


# --- requests from options ------------------------------------------------------------------


def _parse(model: type[M], fields: dict[str, object]) -> M:
    """A request model from the command line: a bad option names its field, as the agent does."""
    try:
        return model.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise refusal(exc) from exc


def _spec(options: argparse.Namespace) -> CreateSandbox:
    fields: dict[str, object] = {
        "project": options.project,
        "user": options.user,
        "image": options.image,
        "memory": options.memory,
        "cpus": options.cpus,
        "pids": options.pids,
        "network": {"egress": {"allow": options.allow}} if options.allow else options.network,
        "backend": options.backend or ("wasm" if parts.plugin(options) else None),
        "wasm": parts.plugin(options),
        "ttl_seconds": options.ttl,
        "root_task_id": options.root_task,
        "env": parts.env(options.env) or None,
        "workspace": parts.workspace(options),
        "credentials": parts.credentials(options),
        "run_as": options.run_as,
        "reuse": options.reuse,
        "nested": parts.nested(options.nested),
        "from_snapshot": getattr(options, "from_snapshot", None),  # create --from (a fork)
    }
    return _parse(CreateSandbox, fields)


def _stdin() -> bytes | None:
    stream = sys.stdin
    if stream is None or stream.isatty():
        return None  # a terminal is a person, not input for the command
    return stream.buffer.read()


def _exec_request(options: argparse.Namespace) -> ExecRequest:
    argv = options.argv[1:] if options.argv[:1] == ["--"] else options.argv
    stdin = None
    if getattr(options, "function", None):  # a plugin call: the words are its input
        argv, stdin = [options.function], " ".join(argv).encode() if argv else None
    fields: dict[str, object] = {
        "argv": argv,
        "stdin": stdin if stdin is not None else _stdin(),
        "timeout": options.timeout,
        "cwd": options.cwd,
        "output_cap": options.output_cap,
    }
    return ExecRequest.parse({k: v for k, v in fields.items() if v is not None})


# --- output ---------------------------------------------------------------------------------


def _fd(stream: OutputStream) -> BinaryIO:
    return sys.stdout.buffer if stream is OutputStream.STDOUT else sys.stderr.buffer


def _write(stream: OutputStream, data: bytes) -> None:
    out = _fd(stream)
    out.write(data)
    out.flush()  # as it is produced: a person or a pipe sees it now, not at the end


def _json(model: BaseModel) -> None:
    print(model.model_dump_json(indent=2))


def _finish(result: ExecResult) -> int:
    for note in tables.notes(result):
        print(note, file=sys.stderr, flush=True)
    return result.exit_code


def _written(
    events: Generator[StreamChunk | R, None, None], first: Callable[[], None] = lambda: None
) -> R:
    """Write a stream's chunks as they come, to stdout and stderr; its result at the end (an
    exec's ``ExecResult``, a run's ``RunResult``). ``first`` runs before anything is written
    (a progress bar ends there)."""
    try:
        for event in events:
            if not isinstance(event, StreamChunk):
                return event
            first()
            _write(event.stream, event.data)
    finally:
        events.close()  # an interrupted CLI closes the stream: the agent kills the command
    raise AssertionError("the stream ends with its result")  # EventDecoder guarantees it


# --- commands -------------------------------------------------------------------------------


def cmd_doctor(options: argparse.Namespace, client: Client) -> int:
    checks = doctor.run_checks(doctor.Host(agent_socket=options.socket))
    if options.json:
        print(doctor.CheckList(checks).model_dump_json(indent=2))
    else:
        for line in doctor.lines(checks):
            print(line)
    return 1 if doctor.failed(checks) else 0


def cmd_run(options: argparse.Namespace, client: Client) -> int:
    spec, request = _spec(options), _exec_request(options)
    if options.json:  # one answer to print: the agent's one-shot route
        _json(client.run(RunRequest(sandbox=spec, exec=request)))
        return 0
    # A person wants output as it is produced: the streamed one-shot, the same run as /run
    # (a pool's member or a cold one-shot sandbox, the command to its waiter, removed by the
    # agent however it ends; Ctrl-C closes the stream, and the agent kills the command).
    with progress.showing(quiet=options.quiet) as shown:
        events = client.run_stream(RunRequest(sandbox=spec, exec=request), shown.event)
        return _finish(_written(events, shown.close).result)


def cmd_create(options: argparse.Namespace, client: Client) -> int:
    quiet = options.json or options.quiet
    with contextlib.ExitStack() as stack:
        make = client.create
        if not quiet:  # its progress shown as it goes: an image's pull, a clone
            shown = stack.enter_context(progress.showing(quiet=False))
            make = functools.partial(client.create_stream, on_progress=shown.event)
        for view in snapshots.created(make, _spec(options), options.count):
            if options.json:
                _json(view)
            else:
                print(view.id, flush=True)
    return 0


def cmd_ps(options: argparse.Namespace, client: Client) -> int:
    views = client.list_sandboxes()
    if options.json:
        _json(SandboxList(views))
    else:
        print("\n".join(tables.sandboxes(views)))
    return 0


def cmd_exec(options: argparse.Namespace, client: Client) -> int:
    request = _exec_request(options)
    if options.json:
        result = client.exec(options.sandbox, request)
        _json(result)
        return result.exit_code
    return _finish(_written(client.exec_stream(options.sandbox, request)))


def cmd_rm(options: argparse.Namespace, client: Client) -> int:
    for sandbox in options.sandboxes:
        gone = client.destroy(sandbox)
        print(gone.model_dump_json() if options.json else tables.destroyed(gone))
    return 0


def cmd_usage(options: argparse.Namespace, client: Client) -> int:
    if options.sandbox:
        _json(client.usage(options.sandbox))
    else:
        _print_tree(client, options.json)
    return 0


def cmd_top(options: argparse.Namespace, client: Client) -> int:
    shown = 0
    while options.count == 0 or shown < options.count:
        if shown and not options.json:
            print("\033[H\033[J", end="")
        _print_tree(client, options.json)
        shown += 1
        if options.count == 0 or shown < options.count:
            time.sleep(options.interval)
    return 0


def _print_tree(client: Client, as_json: bool) -> None:
    node = client.level_tree()
    if as_json:
        _json(node)
        return
    print("\n".join(tables.tree(node)))
    idle = [v for v in client.list_sandboxes() if v.pool == "idle"]
    if idle:  # in the tree's project memory, but no task's: say so
        memory = sum(v.limits.memory_bytes for v in idle) // tables.MiB
        print(f"idle pool members: {len(idle)} ({memory}MB provisioned, charged to no task)")


def cmd_pool(options: argparse.Namespace, client: Client) -> int:
    found = client.pools()
    if options.json:
        _json(found)
    else:
        print("\n".join(tables.pools(found)))
    return 0


def cmd_extend(options: argparse.Namespace, client: Client) -> int:
    request = _parse(Extend, {"ttl_seconds": options.seconds})
    view = client.extend(options.sandbox, request)
    if options.json:
        _json(view)
    else:
        print(f"{view.id} expires {view.expires_at}")
    return 0


def cmd_cp(options: argparse.Namespace, client: Client) -> int:
    source = copying.parse_location(options.source)
    quiet = options.quiet or options.json
    copying.copy(client, source, copying.parse_location(options.destination), quiet=quiet)
    return 0


def cmd_reap(options: argparse.Namespace, client: Client) -> int:
    report = client.reap(ReapRequest(dry_run=options.dry_run))
    if options.json:
        _json(report)
        return 0
    lines, failed = tables.reaper(report)
    print("\n".join(lines))
    return 1 if failed else 0


COMMANDS: dict[str, Command] = {
    "doctor": cmd_doctor,
    "run": cmd_run,
    "create": cmd_create,
    "ps": cmd_ps,
    "exec": cmd_exec,
    "rm": cmd_rm,
    "usage": cmd_usage,
    "top": cmd_top,
    "extend": cmd_extend,
    "reap": cmd_reap,
    "pool": cmd_pool,
    "capacity": capacity.run,
    "cp": cmd_cp,
    "mcp": mcp.run,
    **snapshots.COMMANDS,
}


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        return COMMANDS[options.command](options, Client(options.socket))
    except SliceboxError as exc:
        print(f"slicebox: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, and keep Python from complaining
        # again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT
