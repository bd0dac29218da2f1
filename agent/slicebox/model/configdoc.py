"""``docs/configuration.md``: every key of ``/etc/slicebox/config.toml`` with its type, its
default and what it does, generated from the config model itself (``model.config``: each
field's type, default and description), so it cannot go stale: a unit test compares the file
with what this module makes. ``python3 -m slicebox.model.configdoc > docs/configuration.md``
regenerates it. Nothing of the agent imports this module."""

import enum
import functools
import operator
import types
import typing
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from slicebox.model.config import Config

# What each scalar type is called in TOML's words.
_SCALARS: dict[object, str] = {
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    Path: "path",
    PurePosixPath: "path",
    IPv4Network: "IPv4 network",
    IPv4Address: "IPv4 address",
}
_SIZE = int | str  # model.limits.RawSize: "512MB", "2GB", "75%" (of host memory) or bytes

# How a table of many is named in the file: [users.NAME], [projects."user/project"].
_KEY_NAMES = {"users": "NAME", "projects": '"user/project"'}


class Key(NamedTuple):
    name: str
    type: str
    default: str
    description: str


class Table(NamedTuple):
    header: str  # "" for the file's top level, "[reaper]", "[[pool]]"
    description: str
    keys: list[Key]


def tables() -> list[Table]:
    """Every table of the file, the top level first, in the model's order."""
    found: list[Table] = []
    _walk(Config, "", "", Config(), found)
    return found


def _walk(
    model: type[BaseModel], header: str, description: str, values: Any, found: list[Table]
) -> None:
    keys: list[Key] = []
    nested: list[tuple[type[BaseModel], str, str, Any]] = []
    found.append(Table(header, description, keys))
    prefix = header.strip("[]")
    for name, field in model.model_fields.items():
        inner, many = _table_of(field.annotation)
        about = field.description or ""
        if inner is not None and many == "one":
            value = getattr(values, name) if values is not None else None
            nested.append((inner, f"[{_join(prefix, name)}]", about, value))
        elif inner is not None and many == "map":
            table = f"[{_join(prefix, name)}.{_KEY_NAMES.get(name, 'NAME')}]"
            nested.append((inner, table, about, None))
        elif inner is not None:
            nested.append((inner, f"[[{_join(prefix, name)}]]", about, None))
        else:
            keys.append(
                Key(name, _type_name(field.annotation), _default(field, values, name), about)
            )
    for inner, table, about, value in nested:
        _walk(inner, table, about, value, found)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _table_of(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds as a table, and how: ``one`` table (or an optional one),
    a ``map`` of named tables, or an array of tables (``list``); None for a plain key."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, "one"
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _table_of(args[0])
    if origin is dict and _is_model(args[-1]):
        return args[-1], "map"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and _is_model(args[0]):
        return args[0], "list"
    return None, ""


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType) and annotation != _SIZE:
        rest = [a for a in args if a is not type(None)]
        return _type_name(rest[0] if len(rest) == 1 else functools.reduce(operator.or_, rest))
    if (origin is tuple and len(args) == 2 and args[1] is Ellipsis) or origin is frozenset:
        item = _type_name(args[0])
        return f"array of {item}{'es' if item.endswith('s') else 's'}"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    return _scalar_name(annotation)


def _scalar_name(annotation: Any) -> str:
    if annotation == _SIZE:
        return 'size ("512MB", "2GB", bytes)'
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " or ".join(f'"{member.value}"' for member in annotation)
    if annotation not in _SCALARS:
        raise ValueError(f"no TOML name for {annotation!r}: add it to slicebox.model.configdoc")
    return _SCALARS[annotation]


def _default(field: FieldInfo, values: Any, name: str) -> str:
    if values is not None:
        return _toml(getattr(values, name))
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    return _toml(field.get_default(call_default_factory=True))


def _toml(value: Any) -> str:
    """A value as the file would spell it (unset: left out of the file)."""
    if isinstance(value, tuple | list | frozenset | set):
        items = sorted(value, key=str) if isinstance(value, frozenset | set) else value
        return "[" + ", ".join(_toml(item) for item in items) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return _toml_scalar(value.value if isinstance(value, enum.Enum) else value)


def _toml_scalar(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def markdown() -> str:
    """The whole of ``docs/configuration.md``."""
    lines = [
        "# slicebox configuration",
        "",
        "The agent reads `/etc/slicebox/config.toml` at its start and again on",
        "`systemctl reload slicebox`; a missing file means the defaults below, and a bad value",
        'is refused at load time, naming its key. Sizes are `"512MB"`, `"2GB"` or bytes;',
        'a ceiling\'s memory may also be `"75%"` of the host\'s memory. "unset" means the key is',
        "left out of the file. Generated by `python3 -m slicebox.model.configdoc` from the",
        "config model; do not edit by hand.",
    ]
    for table in tables():
        title = table.header or "The top level"
        lines += ["", f"## `{title}`" if table.header else f"## {title}", ""]
        if table.description:
            lines += [table.description[0].upper() + table.description[1:] + ".", ""]
        lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
        for key in table.keys:
            default = key.default.replace("|", "\\|")
            lines.append(f"| `{key.name}` | {key.type} | `{default}` | {key.description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
