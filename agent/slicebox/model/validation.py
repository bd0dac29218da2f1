"""The one reader of pydantic's validation errors: which field is at fault, and its code.

Every edge (an HTTP body, a sandbox spec, an exec request, the config file) parses untrusted
input with pydantic and turns a :class:`ValidationError` into a slicebox error here, so the same
field gets the same code and the same wording wherever it was sent. A field's code is found from
the innermost part of the error's location that is a known field, so ``sandbox.memory`` in a run
request is ``invalid_limit`` like ``memory`` in a create.
"""

from collections.abc import Callable, Sequence
from typing import TypeVar

from pydantic import ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from slicebox.model.base import Model
from slicebox.model.errors import (
    InvalidCommand,
    InvalidLimit,
    InvalidName,
    InvalidRequest,
    InvalidTimeout,
    SliceboxError,
)

T = TypeVar("T")

FIELD_CODES: dict[str, str] = {
    "argv": "invalid_command",
    "shell": "invalid_command",
    "timeout": "invalid_timeout",
    "memory": "invalid_limit",
    "cpus": "invalid_limit",
    "pids": "invalid_limit",
    "user": "invalid_name",
    "project": "invalid_name",
    "ttl_seconds": "invalid_ttl",
    "mounts": "invalid_mount",
    "workspace": "invalid_workspace",
    "from_snapshot": "invalid_name",
}
DEFAULT_CODE = "invalid_field"
# Fields whose value is one scalar: what pydantic appends after them (the union member it
# tried, an item index) is noise to a caller. A mount's inner path says which mount is wrong.
_LEAVES = frozenset(FIELD_CODES) - {"mounts", "workspace"}
_TYPE_TAGS = frozenset({"int", "float", "str", "bool", "none", "list", "tuple", "dict"})
_CLASSES: dict[str, type[InvalidRequest]] = {
    "invalid_command": InvalidCommand,
    "invalid_timeout": InvalidTimeout,
    "invalid_limit": InvalidLimit,
    "invalid_name": InvalidName,
}
_WORDING = {
    "missing": "required; give a value",
    "extra_forbidden": "not a known field; remove it or check its spelling",
}


class Problem(Model):
    """One field at fault: its dotted path, its code, and what is wrong with it."""

    model_config = ConfigDict(frozen=True)

    field: str
    code: str
    text: str
    kind: str  # pydantic's error type: ``missing``, ``extra_forbidden``, ``int_parsing``...

    def __str__(self) -> str:
        return f"{self.field}: {self.text}"


def problems(exc: ValidationError) -> list[Problem]:
    """One problem per field at fault, in pydantic's order (a union's members fold into one)."""
    found: dict[str, Problem] = {}
    for error in exc.errors():
        problem = _problem(error)
        found.setdefault(problem.field, problem)
    return list(found.values())


def describe(exc: ValidationError) -> str:
    """Every problem, in one line: ``memory: ...; ttl_seconds: ...``."""
    return "; ".join(str(problem) for problem in problems(exc))


def refusal(exc: ValidationError) -> InvalidRequest:
    """The caller's error: the first field's code and name, every problem in the message."""
    first = problems(exc)[0]
    kind = _CLASSES.get(first.code, InvalidRequest)
    return kind(describe(exc), code=first.code, field=first.field)


def _problem(error: ErrorDetails) -> Problem:
    loc = error["loc"]
    at = _fault(loc)
    if at is None:
        return Problem(
            field=_path(loc) or "body", code=DEFAULT_CODE, text=_text(error), kind=error["type"]
        )
    name = str(loc[at])
    path = loc[: at + 1] if name in _LEAVES else loc
    return Problem(field=_path(path), code=FIELD_CODES[name], text=_text(error), kind=error["type"])


def _fault(loc: Sequence[int | str]) -> int | None:
    """The index of the innermost known field in ``loc``; a leaf's name followed by another
    field (the config's ``[user]`` section holds ``pids``) is a section, not that leaf."""
    for index in range(len(loc) - 1, -1, -1):
        name = loc[index]
        if name in FIELD_CODES and (
            name not in _LEAVES or all(_is_tag(part) for part in loc[index + 1 :])
        ):
            return index
    return None


def _is_tag(part: int | str) -> bool:
    """An item index or the union member pydantic tried (``int``, ``function-after[...]``)."""
    return isinstance(part, int) or part in _TYPE_TAGS or "[" in part or "-" in part


def _path(loc: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in loc)


def _text(error: ErrorDetails) -> str:
    return _WORDING.get(error["type"], str(error["msg"]).removeprefix("Value error, "))


def checked(check: Callable[[], object], value: T) -> T:
    """Run a parser for its errors only, turning slicebox errors into pydantic's ValueError
    (so a config or body field that fails its parser is refused naming that field)."""
    try:
        check()
    except SliceboxError as exc:
        raise ValueError(exc.message) from exc
    return value
