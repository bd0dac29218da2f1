"""The warm pool as data: a pool as the config declares it, the key that decides which request a
member may serve, the lease that records an acquired member's lineage, and what ``GET
/v1/pool`` answers.

A key is exactly the settings that decide a container once it runs: its owner (user and
project: the project slice is its cgroup parent, which cannot change), image, limits, network,
the uid it runs as, added capabilities, mounts, and whether it is reused. Anything a request
sets beyond them (a command, env, a workspace, credentials, a working directory) makes it no
pool's: it is created cold. Requests and pools get their keys from the same function
(``core.poolkeys.key_of``), after the same admission, so equal keys mean equal containers.

A :class:`Lease` is what an acquired member's labels cannot say (they were written before its
task was known): its task, root task, parent and depth, and whether a one-shot run holds it. It
lives in the Description of the member's deadline timer in systemd (``docs/pool.md``), so the
reaper and a restarted agent read it from systemd alone.
"""

import hashlib
import re
from typing import Annotated

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from slicebox.model.base import Model
from slicebox.model.limits import Limits, OptionalCpus, OptionalPids, RawSize, parse_size
from slicebox.model.names import slice_names
from slicebox.model.spec import Backend, Id, Mount
from slicebox.model.validation import checked
from slicebox.model.wasm import Sha256

# The most members one pool keeps ready: each is a running container in its project's slice.
MAX_POOL_SIZE = 64


class PoolConfig(Model):
    """One ``[[pool]]`` table. Limits, image, network and run_as left out are the sandbox
    defaults, as for a request that leaves them out (so such a request matches)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str = Field(description="the user whose requests it serves")
    project: str = Field(description="and the project")
    size: int = Field(ge=1, le=MAX_POOL_SIZE, description="members kept ready")
    image: str | None = Field(default=None, description="unset: default_image")
    memory: RawSize | None = Field(default=None, description="unset: [sandbox]'s")
    cpus: OptionalCpus = Field(default=None, description="unset: [sandbox]'s")
    pids: OptionalPids = Field(default=None, description="unset: [sandbox]'s")
    network: str = Field(default="none", description="one of allowed_networks")
    run_as: str | None = Field(
        default=None,
        pattern=r"^[1-9][0-9]*:[1-9][0-9]*$",
        description="uid:gid; unset: default_run_as",
    )
    idle_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        description="a member nobody acquired for this long is removed (pool_idle) and a "
        "fresh one made, so an image updated meanwhile is what members run",
    )
    reuse: bool = Field(
        default=False,
        description="members are reset and handed out again after a release, to requests "
        "that ask for reuse; false: every release destroys its member",
    )
    backend: Backend = Field(default=Backend.DOCKER, description="docker, or wasm")
    wasm_sha256: Sha256 | None = Field(
        default=None, description="a wasm pool's plugin (one the agent holds)"
    )

    @model_validator(mode="after")
    def _kind(self) -> "PoolConfig":
        if self.backend not in (Backend.DOCKER, Backend.WASM):
            raise ValueError("a pool's backend is docker or wasm")
        if (self.backend is Backend.WASM) != (self.wasm_sha256 is not None):
            raise ValueError("a wasm pool names its plugin (wasm_sha256), and only a wasm pool")
        return self

    @field_validator("project")
    @classmethod
    def _names(cls, project: str, info: ValidationInfo) -> str:
        user = info.data.get("user")  # absent when it failed its own check
        return project if user is None else checked(lambda: slice_names(user, project), project)

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: RawSize | None) -> RawSize | None:
        return checked(lambda: value is None or parse_size("memory", value), value)


class PoolKey(Model):
    """What decides a container; two requests with equal keys get equal containers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str
    project: str
    image: str
    limits: Limits
    network: str
    run_as: str
    cap_add: tuple[str, ...] = ()
    mounts: tuple[Mount, ...] = ()
    reuse: bool = False
    backend: str = "docker"
    plugin: str = ""  # a wasm pool's plugin (its sha256)

    def fingerprint(self) -> str:
        """The key as a short stable digest, for the ``slicebox.pool_key`` label: a member
        adopted after a restart is matched by it (a Docker key's as before wasm pools came)."""
        docker = self.backend == "docker" and not self.plugin
        data = self.model_dump_json(exclude={"backend", "plugin"} if docker else None)
        return hashlib.sha256(data.encode()).hexdigest()[:24]


class Lease(Model):
    """An acquired member's lineage, kept in systemd (its deadline timer's Description)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: Id
    root_task_id: Id
    parent_id: Annotated[str, Field(pattern=r"^$|^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")] = ""
    depth: int = Field(default=0, ge=0)
    oneshot: bool = False

    def describe(self) -> str:
        """The lease as words of a unit Description (ids hold no space and no '=')."""
        return (
            f"lease task={self.task_id} root={self.root_task_id} parent={self.parent_id or '-'} "
            f"depth={self.depth} oneshot={int(self.oneshot)}"
        )


_LEASE = re.compile(
    r"lease task=(?P<task>\S+) root=(?P<root>\S+) parent=(?P<parent>\S+) "
    r"depth=(?P<depth>\d+) oneshot=(?P<oneshot>[01])"
)


def parse_lease(description: str) -> Lease | None:
    """The lease a Description holds; None when it holds none (or one slicebox did not write)."""
    found = _LEASE.search(description)
    if found is None:
        return None
    try:
        return Lease(
            task_id=found["task"],
            root_task_id=found["root"],
            parent_id="" if found["parent"] == "-" else found["parent"],
            depth=int(found["depth"]),
            oneshot=found["oneshot"] == "1",
        )
    except ValueError:
        return None


class PoolStats(Model):
    """One pool as ``GET /v1/pool`` and ``slicebox pool`` show it."""

    model_config = ConfigDict(frozen=True)

    key: PoolKey
    fingerprint: str
    size: int
    ready: int
    busy: int  # acquired members still running
    creating: int
    hits: int
    misses: int  # requests of this key that found no member ready and were created cold
    hit_rate: float | None  # hits / (hits + misses); None before the first request
    refill_seconds_last: float | None
    refill_seconds_p50: float | None
    acquire_seconds_p50: float | None
    held_back: str = ""  # why the refill stops short of ``size``: headroom, or a create refused
    learned: bool = False  # learned from demand (``[pool_learning]``), not a ``[[pool]]`` table


class PoolList(Model):
    model_config = ConfigDict(frozen=True)

    pools: list[PoolStats]
    cold: int  # creates and runs that matched no pool's key
