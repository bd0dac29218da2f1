"""``slicebox pause|resume|snapshot|snapshots`` and ``create --from NAME --count N``: a sandbox
frozen and thawed, its filesystem saved as your snapshot, and forks started from one."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

from slicebox.client import Client
from slicebox.model.api import CreateSandbox, SandboxView
from slicebox.model.errors import InvalidRequest
from slicebox.model.limits import human_bytes

MAX_COUNT = 100  # forks of one command; more is a loop of the caller's

Command = Callable[[argparse.Namespace, Client], int]


def add_create_options(create: argparse.ArgumentParser) -> None:
    create.add_argument(
        "--from",
        dest="from_snapshot",
        metavar="SNAPSHOT",
        help="fork: start with the filesystem of your snapshot SNAPSHOT (its own copy)",
    )
    create.add_argument(
        "--count",
        type=int,
        default=1,
        help=f"make N sandboxes alike, one id a line (<= {MAX_COUNT})",
    )


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pause = commands.add_parser("pause", help="freeze sandboxes: no CPU, memory kept")
    pause.add_argument("sandboxes", nargs="+")
    resume = commands.add_parser("resume", help="thaw paused sandboxes")
    resume.add_argument("sandboxes", nargs="+")
    snapshot = commands.add_parser(
        "snapshot", help="save a sandbox's filesystem and /workspace as your snapshot NAME"
    )
    snapshot.add_argument("sandbox")
    snapshot.add_argument("name")
    listing = commands.add_parser(
        "snapshots", help="list your snapshots; `snapshots rm NAME...` deletes them"
    )
    listing.add_argument("action", nargs="?", choices=("ls", "rm"), default="ls")
    listing.add_argument("names", nargs="*")


def created(
    make: Callable[[CreateSandbox], SandboxView], spec: CreateSandbox, count: int
) -> Iterator[SandboxView]:
    """``count`` sandboxes of ``spec`` (forks, with ``from_snapshot``), each as ``make`` (a
    client's create, or its streamed create) makes it."""
    if not 1 <= count <= MAX_COUNT:
        raise InvalidRequest(f"--count is 1 to {MAX_COUNT}", field="count")
    for _ in range(count):
        yield make(spec)


def cmd_pause(options: argparse.Namespace, client: Client) -> int:
    for sandbox in options.sandboxes:
        state = client.pause(sandbox)
        print(state.model_dump_json() if options.json else f"{state.id} paused")
    return 0


def cmd_resume(options: argparse.Namespace, client: Client) -> int:
    for sandbox in options.sandboxes:
        state = client.resume(sandbox)
        print(state.model_dump_json() if options.json else f"{state.id} resumed")
    return 0


def cmd_snapshot(options: argparse.Namespace, client: Client) -> int:
    view = client.snapshot(options.sandbox, options.name)
    size = human_bytes(view.size_bytes)
    print(view.model_dump_json() if options.json else f"{view.name} ({size}) of {view.origin}")
    return 0


def cmd_snapshots(options: argparse.Namespace, client: Client) -> int:
    if options.action == "rm":
        for name in options.names:
            gone = client.delete_snapshot(name)
            print(gone.model_dump_json() if options.json else f"{name} deleted")
        return 0
    for view in client.snapshots():
        if options.json:
            print(view.model_dump_json())
        else:
            when = view.created_at.isoformat(timespec="seconds")
            print(f"{view.name}\t{human_bytes(view.size_bytes)}\t{when}\t{view.origin}")
    return 0


COMMANDS: dict[str, Command] = {
    "pause": cmd_pause,
    "resume": cmd_resume,
    "snapshot": cmd_snapshot,
    "snapshots": cmd_snapshots,
}
