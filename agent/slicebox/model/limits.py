"""Sizes, cpus and pids: parsing at the edge and ceilings as data.

Sizes are bytes (an int) or strings like ``'256MB'``, ``'1GB'``, ``'512KiB'``, ``'64m'``. Units
are binary (``MB`` = MiB), as Docker reads ``--memory 256m``, so the same string means the same
bytes whether it limits a container or a slice. A percentage (``'75%'``) is only allowed where a
total is known (the managed ceiling, relative to host memory).

:func:`ceiling_properties` turns a :class:`Ceiling` into the systemd properties to write, a pure
list that is table-tested before anything touches systemd. An unset value is written as
``infinity`` so that removing a limit from the config lifts it live.
"""

import math
import re
from typing import Annotated

from pydantic import AfterValidator, ConfigDict

from slicebox.model.base import Model
from slicebox.model.errors import InvalidLimit
from slicebox.model.validation import checked

INFINITY = 2**64 - 1  # systemd's "no limit" for uint64 properties
USEC_PER_SEC = 1_000_000
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", re.IGNORECASE)
_PERCENT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_HUMAN_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))

Property = tuple[str, int]
RawSize = int | str
RawNumber = int | float | str


def _cpus_or_none(value: float | None) -> float | None:
    return checked(lambda: value is None or parse_cpus("cpus", value), value)


def _pids_or_none(value: int | None) -> int | None:
    return checked(lambda: value is None or parse_pids("pids", value), value)


# A config's optional cpus and pids, checked when the file is loaded (naming the field).
OptionalCpus = Annotated[float | None, AfterValidator(_cpus_or_none)]
OptionalPids = Annotated[int | None, AfterValidator(_pids_or_none)]


def parse_size(field: str, value: RawSize, total: int | None = None) -> int:
    """Bytes from an int, ``'256MB'``-like string or (with a total) ``'75%'``; must be > 0."""
    if isinstance(value, bool):
        raise InvalidLimit(f"{field}: {value!r} is not a size; use bytes or '256MB', '1GB'")
    nbytes = value if isinstance(value, int) else _size_from_text(field, value, total)
    if nbytes <= 0:
        raise InvalidLimit(f"{field}: {value!r} must be larger than zero")
    return nbytes


def _size_from_text(field: str, text: str, total: int | None) -> int:
    percent = _PERCENT.fullmatch(text)
    match = _SIZE.fullmatch(text)
    if percent and total is not None:
        nbytes = total * float(percent.group(1)) / 100
    elif match is not None:
        nbytes = float(match.group(1)) * _UNITS[match.group(2).lower()]
    else:
        where = " or a percentage of host memory like '75%'" if total is not None else ""
        raise InvalidLimit(f"{field}: {text!r} is not a size; use bytes or '256MB', '1GB'{where}")
    if not math.isfinite(nbytes):  # more digits than a float holds: no memory is that large
        raise InvalidLimit(f"{field}: {text[:40]!r}... is too large a size; use '256MB', '1GB'")
    return int(nbytes)


def parse_cpus(field: str, value: RawNumber) -> float:
    """A positive, finite number of CPUs (``0.5`` is half a CPU)."""
    try:
        cpus = float(value) if not isinstance(value, bool) else math.nan
    except ValueError:
        cpus = math.nan
    if not math.isfinite(cpus) or cpus <= 0:
        raise InvalidLimit(f"{field}: {value!r} is not a positive number of CPUs, like 0.5 or 2")
    return cpus


def parse_pids(field: str, value: RawNumber) -> int:
    """A positive whole number of tasks."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) <= 0:
        raise InvalidLimit(f"{field}: {value!r} is not a positive whole number of tasks")
    return int(text)


def human_bytes(nbytes: int) -> str:
    """``512 B``, ``256 MiB``, ``3.0 GiB``: whole units exactly, otherwise one decimal."""
    for unit, size in _HUMAN_UNITS:
        if abs(nbytes) >= size:
            whole, rest = divmod(nbytes, size)
            return f"{whole} {unit}" if rest == 0 else f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def plain_number(value: float) -> str:
    """A number as people write it: ``0.5``, ``2``, ``0.125`` (no exponent, no trailing zeros);
    a whole number as it is, however large (a float cannot hold every int)."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.6f}".rstrip("0").rstrip(".")


def cpu_quota_usec(cpus: float) -> int:
    """systemd's CPUQuotaPerSecUSec for ``cpus`` CPUs (1.0 -> 1 s of CPU per second)."""
    return round(cpus * USEC_PER_SEC)


def nano_cpus(cpus: float) -> int:
    """Docker's NanoCpus for ``cpus`` CPUs."""
    return round(cpus * 1_000_000_000)


class Limits(Model):
    """What one sandbox is provisioned with: all three are always set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: float
    memory_bytes: int
    pids: int


class Ceiling(Model):
    """A slice's ceilings; ``None`` means no limit at that level."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    memory_bytes: int | None = None
    memory_high_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None


def ceiling_properties(ceiling: Ceiling) -> list[Property]:
    """The systemd slice properties that enforce ``ceiling`` (unset -> infinity)."""
    properties: list[Property] = [
        ("MemoryMax", _or_infinity(ceiling.memory_bytes)),
        ("MemoryHigh", _or_infinity(ceiling.memory_high_bytes)),
        ("TasksMax", _or_infinity(ceiling.pids)),
    ]
    quota = INFINITY if ceiling.cpus is None else cpu_quota_usec(ceiling.cpus)
    properties.append(("CPUQuotaPerSecUSec", quota))
    return properties


def _or_infinity(value: int | None) -> int:
    return INFINITY if value is None else value
