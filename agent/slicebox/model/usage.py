"""ResourceUsage and the level tree as they travel: strict, unknown keys rejected.

``ResourceUsage`` is the seed's contract (cogmo ``ResourceUsageSchema``): optional fields are
omitted rather than ``null`` on the wire, timestamps are UTC ISO-8601 with ``Z``. slicebox adds
the optional ``memory_seconds``, ``disk_bytes_written``, ``network_bytes`` and ``egress``.
"""

from collections.abc import Iterator
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    AwareDatetime,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    StrictFloat,
    StrictInt,
)

from slicebox.model.base import Model


def _to_utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


UtcDatetime = Annotated[AwareDatetime, AfterValidator(_to_utc)]
Bytes = Annotated[StrictInt, Field(ge=0)]
Seconds = Annotated[StrictFloat | StrictInt, Field(ge=0)]


class _Strict(Model):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemoryBytes(_Strict):
    """memory.current of the three slices the sandbox lives in."""

    managed: Bytes
    user: Bytes
    project: Bytes


class Provisioned(_Strict):
    cpu: Seconds
    memory_bytes: Bytes


class SandboxInfo(_Strict):
    backend: Annotated[str, Field(min_length=1)]
    created_at: UtcDatetime
    deleted_at: UtcDatetime | None = None
    provisioned: Provisioned


class EgressCounters(_Strict):
    """A sandbox with an egress allow-list: packets and bytes slicebox's nftables rules let
    through (``allowed_*``) and dropped (``denied_*``); names its resolver refused; queries
    its resolver dropped past the sandbox's rate, and TCP connections past its share."""

    allowed_packets: Bytes
    allowed_bytes: Bytes
    denied_packets: Bytes
    denied_bytes: Bytes
    denied_names: Bytes
    dropped_queries: Bytes = 0
    refused_connections: Bytes = 0


class ResourceUsage(_Strict):
    """The seed's ResourceUsage plus optional slicebox counters."""

    memory_bytes: MemoryBytes | None = None
    cpu_seconds: Seconds | None = None
    sandbox: SandboxInfo | None = None
    memory_seconds: Seconds | None = None  # byte-seconds of memory.current while sampled
    disk_bytes_written: Bytes | None = None
    network_bytes: Bytes | None = None
    egress: EgressCounters | None = None  # only a sandbox with an egress allow-list
    paused: bool | None = None  # frozen now (a pause, a snapshot's moment); None: unknown

    def to_wire(self) -> dict[str, Any]:
        """JSON-ready dict; absent values are omitted (the seed's schema has no nulls)."""
        return self.model_dump(mode="json", exclude_none=True)


class Level(StrEnum):
    MANAGED = "managed"
    USER = "user"
    PROJECT = "project"
    SANDBOX = "sandbox"


class LevelNode(_Strict):
    """One level: its counters and whether its own ceiling bit.

    ``oom_kills`` counts processes killed at or below this level (memory.events), wherever the
    limit was. ``ooms_caused`` counts OOMs that THIS level's memory.max caused
    (memory.events.local ``oom``); ``memory_max_hits`` how often it was at its max.
    ``cpu_throttled_*`` come from this level's own cpu.stat, which counts throttling by this
    level's own quota only: nonzero means this level's CPU ceiling bit.
    """

    level: Level
    unit: str
    cgroup: str
    name: str | None = None
    memory_current: NonNegativeInt | None = None
    memory_peak: NonNegativeInt | None = None
    memory_max: NonNegativeInt | None = None
    memory_high: NonNegativeInt | None = None
    cpu_usage_usec: NonNegativeInt | None = None
    cpu_quota: NonNegativeFloat | None = None
    cpu_nr_throttled: NonNegativeInt | None = None
    cpu_throttled_usec: NonNegativeInt | None = None
    pids_current: NonNegativeInt | None = None
    pids_max: NonNegativeInt | None = None
    oom_kills: NonNegativeInt | None = None
    ooms_caused: NonNegativeInt | None = None
    memory_max_hits: NonNegativeInt | None = None
    egress: EgressCounters | None = None  # a sandbox node's, with an egress allow-list
    frozen: bool | None = None  # the cgroup is frozen: a paused sandbox (or all below it)
    children: tuple["LevelNode", ...] = ()

    @property
    def caused_oom(self) -> bool:
        return bool(self.ooms_caused)

    @property
    def caused_throttling(self) -> bool:
        return bool(self.cpu_nr_throttled)

    def with_egress(self, by_unit: dict[str, EgressCounters]) -> "LevelNode":
        """The tree with each sandbox node in ``by_unit`` given its egress counters."""
        if not by_unit:
            return self
        children = tuple(child.with_egress(by_unit) for child in self.children)
        return self.model_copy(update={"egress": by_unit.get(self.unit), "children": children})

    def walk(self) -> Iterator["LevelNode"]:
        yield self
        for child in self.children:
            yield from child.walk()

    def find(self, cgroup: str) -> "LevelNode | None":
        return next((n for n in self.walk() if n.cgroup == cgroup.strip("/")), None)

    def path_to(self, cgroup: str) -> list["LevelNode"]:
        """The nodes from this one down to ``cgroup`` (empty when it is not in the tree)."""
        if self.cgroup == cgroup.strip("/"):
            return [self]
        for child in self.children:
            below = child.path_to(cgroup)
            if below:
                return [self, *below]
        return []


def oom_blame(tree: LevelNode, sandbox: str) -> list[LevelNode]:
    """The levels on a sandbox's path whose own memory ceiling caused an OOM."""
    return [node for node in tree.path_to(sandbox) if node.caused_oom]


def throttle_blame(tree: LevelNode, sandbox: str) -> list[LevelNode]:
    """The levels on a sandbox's path whose own CPU quota throttled it."""
    return [node for node in tree.path_to(sandbox) if node.caused_throttling]
