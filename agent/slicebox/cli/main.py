"""``slicebox``: the command line for people and scripts.

Human tables by default, ``--json`` for scripts. Errors print their stable code and the
message that says what to do, and exit 2; a command's own exit code passes through ``exec``
and ``run``.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from slicebox import __version__
from slicebox.cli import doctor
from slicebox.cli.client import DEFAULT_SOCKET, Client
from slicebox.model.errors import SliceboxError

Command = Callable[[argparse.Namespace, Client], int]


def _sandbox_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--project", default="default", help="project slice (default: default)")
    parser.add_argument("--user", help="act for this user (root and slicebox-admin only)")
    parser.add_argument("--image", help="image (default: the agent's configured image)")
    parser.add_argument("--memory", help="memory limit, e.g. 256MB")
    parser.add_argument("--cpus", type=float, help="CPU limit, e.g. 0.5")
    parser.add_argument("--pids", type=int, help="process limit")
    parser.add_argument("--network", help="none (default) or bridge")
    parser.add_argument("--ttl", type=int, help="seconds until the reaper destroys it")
    parser.add_argument("--root-task", help="root task id (lineage)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE, repeatable")


def _exec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, help="seconds before the command is killed")
    parser.add_argument("--cwd", help="working directory (default /workspace)")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its arguments")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slicebox", description=__doc__)
    parser.add_argument("--version", action="version", version=f"slicebox {__version__}")
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help="the agent's unix socket")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("doctor", help="check this host and the agent, and say what to fix")
    run = commands.add_parser("run", help="one-shot: create a sandbox, run a command, destroy")
    _sandbox_options(run)
    _exec_options(run)
    create = commands.add_parser("create", help="create a sandbox and print its id")
    _sandbox_options(create)
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
    reap = commands.add_parser("reap", help="one reaper pass now (root and slicebox-admin)")
    reap.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    return parser


def _spec(options: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "project": options.project,
        "user": options.user,
        "image": options.image,
        "memory": options.memory,
        "cpus": options.cpus,
        "pids": options.pids,
        "ttl_seconds": options.ttl,
        "root_task_id": options.root_task,
        "env": dict(item.split("=", 1) for item in options.env),
    }
    if options.network:
        spec["network"] = options.network
    return {key: value for key, value in spec.items() if value not in (None, {})}


def _exec_body(options: argparse.Namespace) -> dict[str, Any]:
    argv = options.argv[1:] if options.argv[:1] == ["--"] else options.argv
    body: dict[str, Any] = {"argv": argv}
    if not sys.stdin.isatty():
        body["stdin"] = base64.b64encode(sys.stdin.buffer.read()).decode()
    if options.timeout is not None:
        body["timeout"] = options.timeout
    if options.cwd:
        body["cwd"] = options.cwd
    return body


def _print_result(result: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.buffer.write(base64.b64decode(result["stdout"]))
        sys.stderr.buffer.write(base64.b64decode(result["stderr"]))
        for name in ("stdout", "stderr"):
            if result[f"{name}_truncated"]:
                dropped = result[f"{name}_dropped_bytes"]
                print(f"slicebox: {name} truncated, {dropped} bytes dropped", file=sys.stderr)
        if result["timed_out"]:
            print("slicebox: the command timed out and was killed", file=sys.stderr)
        if result["oom_killed"]:
            print("slicebox: the kernel killed a process (out of memory)", file=sys.stderr)
    return int(result["exit_code"])


def cmd_doctor(options: argparse.Namespace, client: Client) -> int:
    checks = doctor.run_checks(doctor.Host(agent_socket=options.socket))
    if options.json:
        print(json.dumps([check.model_dump() for check in checks], indent=2))
    else:
        for check in checks:
            print(f"{'ok  ' if check.ok else 'FAIL'} {check.name:<20} {check.detail}")
            if not check.ok and check.fix:
                print(f"     {'':<20} fix: {check.fix}")
    return 0 if all(check.ok for check in checks) else 1


def cmd_run(options: argparse.Namespace, client: Client) -> int:
    outcome = client.request(
        "POST", "/run", {"sandbox": _spec(options), "exec": _exec_body(options)}
    )
    return _print_result(outcome if options.json else outcome["result"], options.json)


def cmd_create(options: argparse.Namespace, client: Client) -> int:
    view = client.request("POST", "/sandboxes", _spec(options))
    print(json.dumps(view, indent=2) if options.json else view["id"])
    return 0


def cmd_ps(options: argparse.Namespace, client: Client) -> int:
    views = client.request("GET", "/sandboxes")
    if options.json:
        print(json.dumps(views, indent=2))
        return 0
    print(
        f"{'ID':<18} {'USER':<12} {'PROJECT':<14} {'MEMORY':>10} {'CPUS':>5} "
        f"{'CREATED':<25} {'EXPIRES'}"
    )
    for v in views:
        memory = f"{v['limits']['memory_bytes'] // (1024 * 1024)}MB"
        print(
            f"{v['id']:<18} {v['user']:<12} {v['project']:<14} {memory:>10} "
            f"{v['limits']['cpus']:>5} {v['created_at']:<25} {v.get('expires_at') or '-'}"
        )
    return 0


def cmd_exec(options: argparse.Namespace, client: Client) -> int:
    result = client.request("POST", f"/sandboxes/{options.sandbox}/exec", _exec_body(options))
    return _print_result(result, options.json)


def cmd_rm(options: argparse.Namespace, client: Client) -> int:
    for sandbox in options.sandboxes:
        gone = client.request("DELETE", f"/sandboxes/{sandbox}")
        if options.json:
            print(json.dumps(gone))
        else:
            cpu = (gone.get("usage") or {}).get("cpu_seconds")
            state = "destroyed" if gone["destroyed"] else "already gone"
            print(f"{sandbox} {state}" + (f" (cpu {cpu:.2f}s)" if cpu is not None else ""))
    return 0


def cmd_usage(options: argparse.Namespace, client: Client) -> int:
    if options.sandbox:
        print(json.dumps(client.request("GET", f"/sandboxes/{options.sandbox}/usage"), indent=2))
    else:
        _print_tree(client.request("GET", "/usage/tree"), options.json)
    return 0


def cmd_top(options: argparse.Namespace, client: Client) -> int:
    shown = 0
    while options.count == 0 or shown < options.count:
        if shown and not options.json:
            print("\033[H\033[J", end="")
        _print_tree(client.request("GET", "/usage/tree"), options.json)
        shown += 1
        if options.count == 0 or shown < options.count:
            time.sleep(options.interval)
    return 0


def cmd_extend(options: argparse.Namespace, client: Client) -> int:
    body = {"ttl_seconds": options.seconds}
    view = client.request("POST", f"/sandboxes/{options.sandbox}/deadline", body)
    print(
        json.dumps(view, indent=2) if options.json else f"{view['id']} expires {view['expires_at']}"
    )
    return 0


def cmd_reap(options: argparse.Namespace, client: Client) -> int:
    report = client.request("POST", "/reaper", {"dry_run": options.dry_run})
    if options.json:
        print(json.dumps(report, indent=2))
        return 0
    results = [o["result"] for o in report["outcomes"]] or ["planned"] * len(report["plan"])
    verb = "would take" if report["dry_run"] else "took"
    print(f"reaper {verb} {len(report['plan'])} actions (agent run {report['instance_id']})")
    for action, result in zip(report["plan"], results, strict=True):
        print(f"{result:<10} {action['kind']:<17} {action['target']:<40} {action['reason']}")
    failed = [r for r in results if r not in ("ok", "skipped", "planned")]
    return 1 if failed else 0


def _print_tree(node: dict[str, Any], as_json: bool, depth: int = 0) -> None:
    if as_json:
        print(json.dumps(node, indent=2))
        return
    if depth == 0:
        print(f"{'LEVEL':<40} {'MEMORY':>10} {'MAX':>10} {'PIDS':>6} {'CPU s':>8} {'OOM':>4}")
    label = ("  " * depth) + (node.get("name") or node["unit"])
    mark = " !oom" if node.get("ooms_caused") else ""
    mark += " !throttled" if node.get("cpu_nr_throttled") else ""
    print(
        f"{label[:40]:<40} {_mb(node.get('memory_current')):>10} {_mb(node.get('memory_max')):>10} "
        f"{node.get('pids_current') or 0:>6} {(node.get('cpu_usage_usec') or 0) / 1e6:>8.2f} "
        f"{node.get('oom_kills') or 0:>4}{mark}"
    )
    for child in node.get("children", []):
        _print_tree(child, False, depth + 1)


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / (1024 * 1024):.1f}MB"


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
