"""``slicebox capacity``: what each level (the host, your user, a project) has left under its
ceilings and how many sandboxes of a shape still fit, as a table, or the agent's answer as
JSON (``--json``)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from pydantic import ValidationError

from slicebox.client import Client
from slicebox.model.capacity import Capacity, CapacityQuery, CpuRoom, LevelRoom, Room
from slicebox.model.limits import human_bytes, plain_number
from slicebox.model.validation import refusal

DEFAULT_PROJECT = "default"  # as ``create``'s --project


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "capacity",
        help="what is left at each level and how many sandboxes of a shape fit",
    )
    parser.add_argument(
        "--project", help=f"project slice (default: {DEFAULT_PROJECT}, or the pool's)"
    )
    parser.add_argument("--user", help="another user's (root and slicebox-admin only)")
    parser.add_argument("--memory", help="the shape's memory, e.g. 512MB (default: a create's)")
    parser.add_argument("--cpus", help="the shape's CPUs, e.g. 0.5")
    parser.add_argument("--pids", help="the shape's process limit")
    parser.add_argument("--pool", metavar="KEY", help="a warm pool's key (slicebox pool --json)")


def query_of(options: argparse.Namespace) -> CapacityQuery:
    project = options.project or (None if options.pool else DEFAULT_PROJECT)
    fields = {
        "project": project,
        "user": options.user,
        "memory": options.memory,
        "cpus": options.cpus,
        "pids": options.pids,
        "pool": options.pool,
    }
    try:
        return CapacityQuery.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise refusal(exc) from exc


def run(options: argparse.Namespace, client: Client) -> int:
    answer = client.capacity(query_of(options))
    print(answer.model_dump_json(indent=2) if options.json else "\n".join(table(answer)))
    return 0


def table(answer: Capacity) -> Iterator[str]:
    """The answer as people read it: the shape and what fits, then a line per level."""
    shape = answer.shape
    size = f"{human_bytes(shape.memory_bytes)}, {plain_number(shape.cpus)} CPUs, {shape.pids} pids"
    pool = f" (pool {answer.pool}: {answer.pool_ready} ready)" if answer.pool else ""
    yield f"{answer.user}/{answer.project}, sandboxes of {size}{pool}:"
    if answer.fits is None:
        yield "  fits: no bound: [admission] counts none of what would bound them"
    else:
        bound = answer.bound
        first = f" ({bound.level.value} {bound.resource.value} runs out first)" if bound else ""
        yield f"  fits: {answer.fits} more{first}"
    yield (
        f"{'LEVEL':<8} {'UNIT':<34} {'BOXES':>5} {'MEMORY USED/MAX':>21} {'LEFT':>10} "
        f"{'PIDS USED/MAX':>13} {'LEFT':>6} {'CPUS USED/MAX':>13} {'LEFT':>6} {'FITS':>5}"
    )
    for level in answer.levels:
        yield _level(level)
    host = answer.host
    available = "?" if host.available_bytes is None else human_bytes(host.available_bytes)
    yield (
        f"host memory available now: {available} of {human_bytes(host.total_bytes)} "
        "(MemAvailable; not counted by admission)"
    )
    yield f"counted by admission: {', '.join(r.value for r in answer.counted) or 'nothing'}"


def _level(level: LevelRoom) -> str:
    memory, pids, cpus = level.memory, level.pids, level.cpus
    return (
        f"{level.level.value:<8} {level.unit[:34]:<34} {level.sandboxes:>5} "
        f"{_bytes(memory.provisioned) + '/' + _bytes(memory.ceiling):>21} "
        f"{_bytes(memory.left):>10} {_whole(pids)[0]:>13} {_whole(pids)[1]:>6} "
        f"{_cpus(cpus)[0]:>13} {_cpus(cpus)[1]:>6} {_or_dash(level.fits):>5}"
    )


def _bytes(value: int | None) -> str:
    return "-" if value is None else human_bytes(value)


def _whole(room: Room) -> tuple[str, str]:
    return f"{room.provisioned}/{_or_dash(room.ceiling)}", _or_dash(room.left)


def _cpus(room: CpuRoom) -> tuple[str, str]:
    ceiling = "-" if room.ceiling is None else plain_number(room.ceiling)
    left = "-" if room.left is None else plain_number(room.left)
    return f"{plain_number(room.provisioned)}/{ceiling}", left


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)
