"""The agent's configuration: a TOML file parsed once into frozen pydantic models.

A missing file means the defaults below. Ceilings are given per level (``managed``, ``user``,
``project``) and overridden per user (``[users.alice]``) and per project
(``[projects."alice/demo"]``); an override replaces only the fields it sets. Sizes are checked
when the file is loaded, so a bad value is refused at load time, naming its field.

    default_image = "alpine:3.19"
    default_ttl_seconds = 3600   # a sandbox's TTL when its request gives none
    max_ttl_seconds = 86400      # the most a create or an extend may ask (at most a year)
    bind_roots = ["/srv/slicebox/{user}"]  # {user}: the caller's own name; host workspaces too
    default_run_as = "65534:65534"  # uid:gid of a sandbox without a host workspace
    root_users = ["ops"]          # users whose sandboxes may run as uid 0 (none by default)
    exec_output_budget = "512MB"  # exec output held at once, all callers; default below
    files_max_bytes = "1GB"       # the most one file transfer (PUT/GET .../files) moves
    [shares]                      # what one user holds at once (core/shares.py)
    user_share = 0.5              # of exec_output_budget and of each bound below, per uid
    streams_in_flight = 64        # streamed execs and runs at once, all users
    transfers_in_flight = 32      # file transfers at once, all users
    [managed]
    memory = "75%"
    [project]
    memory = "2GB"
    pids = 1024
    [projects."alice/demo"]
    memory = "400MB"
    [reaper]
    interval_seconds = 30
    orphans = "adopt"        # or "reap": what becomes of another agent run's sandboxes
    pool_size = 0            # idle pool members kept per kind
    empty_slice_grace_seconds = 300  # an empty user or project slice is kept this long
    [admission]              # count the sandboxes' limits against each ceiling (docs/capacity.md)
    memory_ratio = 1.0       # unset (the default): not counted, the kernel shares the ceiling
    [[pool]]                 # members kept ready for one key (docs/pool.md); one table each
    user = "alice"
    project = "web"
    size = 3
    memory = "256MB"         # image, memory, cpus, pids, network, run_as: the defaults if unset
    idle_timeout_seconds = 1800
    reuse = false            # true: a release resets the member for the next reuse request
    [pool_learning]          # pools learned from demand, for keys no [[pool]] declares
    enabled = false          # on: a key asked for `uses` times in `window_seconds` gets a pool
    uses = 3
    window_seconds = 600     # kept while asked for within it; then its members are trimmed
    size = 1                 # members per learned key
    max_pools = 8            # learned pools at once, all users
    [metrics]                # GET /metrics (docs/metrics.md)
    listen = "127.0.0.1:9464"  # a TCP listener for a scraper (bearer token); unset: none
    token_file = "/etc/slicebox/metrics.token"  # root's, mode 0600
    per_sandbox = false      # series of each sandbox, at most per_sandbox_max of them
    [nested]                 # sandboxes that create children (docs/nested.md)
    max_children = 8         # the most a create may ask; per user/project: [nested.users.NAME]
    max_depth = 2            # levels below a nested sandbox; 0: no nesting
    creates_per_minute = 30  # children one sandbox creates in any minute
"""

import logging
import tomllib
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from slicebox.model.base import Model
from slicebox.model.capacity import AdmissionConfig
from slicebox.model.egress import EgressConfig
from slicebox.model.errors import ConfigError
from slicebox.model.limits import (
    Ceiling,
    Limits,
    OptionalCpus,
    OptionalPids,
    RawSize,
    parse_cpus,
    parse_pids,
    parse_size,
)
from slicebox.model.metrics import MetricsConfig
from slicebox.model.nested import NestedConfig
from slicebox.model.paths import CONFIG_PATH
from slicebox.model.pool import MAX_POOL_SIZE, PoolConfig
from slicebox.model.pulls import RegistryCredential
from slicebox.model.shares import SharesConfig
from slicebox.model.snapshots import SnapshotConfig
from slicebox.model.socketcaps import SocketConfig
from slicebox.model.validation import checked, describe, problems

log = logging.getLogger(__name__)

DEFAULT_PATH = CONFIG_PATH
DEFAULT_CAPABILITIES = frozenset(
    {"CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "NET_BIND_SERVICE"}
)
_ANY_TOTAL = 1 << 40  # validates a percentage at load time; the real total comes later
# No deadline further than a year: beyond that a sandbox is a server, and a deadline that far
# off is a typo (and datetime arithmetic overflows long before any int runs out).
TTL_CEILING_SECONDS = 366 * 24 * 3600

# The exec output budget when the config sets none and the agent runs without a MemoryMax.
DEFAULT_EXEC_OUTPUT_BUDGET = 256 * 1024 * 1024


def _table(description: str, **fields: object) -> Any:
    """A nested table's default as the file would give it, validated by ``Config``'s own (a
    model instance would build its validator at every import: docs/benchmarks.md)."""
    return Field(default=fields, validate_default=True, description=description)


class _Strict(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CeilingConfig(_Strict):
    """One level's ceilings as written in the file; ``None`` leaves the field to the default."""

    memory: RawSize | None = Field(
        default=None, description="MemoryMax: the kernel's hard limit (a size, or a % of RAM)"
    )
    memory_high: RawSize | None = Field(
        default=None, description="MemoryHigh: where the kernel starts reclaiming and throttling"
    )
    cpus: OptionalCpus = Field(default=None, description="CPUQuota, in CPUs (1.5 = 150%)")
    pids: OptionalPids = Field(default=None, description="TasksMax: processes and threads")

    @field_validator("memory", "memory_high")
    @classmethod
    def _size(cls, value: RawSize | None) -> RawSize | None:
        return checked(lambda: value is None or parse_size("size", value, _ANY_TOTAL), value)

    def over(self, base: "CeilingConfig") -> "CeilingConfig":
        """This override laid over ``base``: fields set here win."""
        return base.model_copy(update=self.model_dump(exclude_none=True))

    def resolve(self, host_memory: int) -> Ceiling:
        return Ceiling(
            memory_bytes=_size_or_none("memory", self.memory, host_memory),
            memory_high_bytes=_size_or_none("memory_high", self.memory_high, host_memory),
            cpus=self.cpus,
            pids=self.pids,
        )


class CallersConfig(_Strict):
    """Who may call the agent beyond the kernel's socket check (host.identity.resolve).

    ``group``: every caller but root must be a member of it in the user database (NSS: the
    user's primary and supplementary groups, by its uid), checked on every request; the admin
    group implies it. ``unknown_uids``: a uid range ``[first, last]`` whose callers have no
    passwd entry yet are served (processes of a user namespace mapped into subordinate ids),
    all as the one user level ``unknown_user`` (its ``[users.<name>]`` ceilings, if any, are
    their shared ceilings); left out, such callers are refused ``unknown_user``."""

    group: str = Field(
        default="slicebox",
        min_length=1,
        description="every caller but root must be a member (checked on every request)",
    )
    unknown_uids: tuple[int, int] | None = Field(
        default=None,
        description="[first, last]: uids without a passwd entry that are served (user "
        "namespaces); unset: refused unknown_user",
    )
    unknown_user: str = Field(
        default="unknown",
        pattern=r"^[a-z_][a-z0-9_.-]*$",
        description="the one user level all such callers share",
    )

    @field_validator("unknown_uids")
    @classmethod
    def _range(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 0 < value[0] <= value[1]:
            raise ValueError("give [first, last] uids, 0 < first <= last")
        return value

    def admits_unknown(self, uid: int) -> bool:
        return self.unknown_uids is not None and self.unknown_uids[0] <= uid <= self.unknown_uids[1]


class CredentialsConfig(_Strict):
    """Bounds of the git credentials a create hands over (core.credentials): the bytes each
    user's sandboxes together may hold in the shared credential tmpfs (16 MiB as installed);
    a create beyond its user's share is refused ``credentials_share_exceeded``."""

    user_share: RawSize = Field(
        default="2MB",
        description="the bytes one user's sandboxes together may hold in the credential tmpfs",
    )

    @field_validator("user_share")
    @classmethod
    def _share(cls, value: RawSize) -> RawSize:
        return checked(lambda: parse_size("credentials.user_share", value), value)

    def user_share_bytes(self) -> int:
        return parse_size("credentials.user_share", self.user_share)


class SandboxDefaults(_Strict):
    """What a sandbox gets when its request leaves a limit out."""

    memory: RawSize = Field(default="256MB", description="a sandbox's memory limit")
    cpus: float = Field(default=0.5, description="a sandbox's CPUs")
    pids: int = Field(default=100, description="a sandbox's processes and threads")

    def limits(self) -> Limits:
        return Limits(
            cpus=parse_cpus("cpus", self.cpus),
            memory_bytes=parse_size("memory", self.memory),
            pids=parse_pids("pids", self.pids),
        )


class OrphanPolicy(StrEnum):
    ADOPT = "adopt"  # another agent run's sandboxes become this run's; deadlines still hold
    REAP = "reap"  # they are destroyed


class ReaperConfig(_Strict):
    interval_seconds: float = Field(default=30.0, gt=0, description="time between passes")
    orphans: OrphanPolicy = Field(
        default=OrphanPolicy.ADOPT,
        description="what becomes of another agent run's sandboxes: adopted (their deadlines "
        "still hold) or reaped",
    )
    pool_size: int = Field(
        default=0,
        ge=0,
        description="idle members kept of a key no [[pool]] declares (one a removed table "
        "left); 0 trims them",
    )
    empty_slice_grace_seconds: float = Field(
        default=300.0,
        ge=0,
        description="an empty user or project slice is stopped once empty this long, so the "
        "next sandbox of a project that comes and goes finds its slices in place",
    )
    state_dir: Path = Field(
        default=Path("/run/slicebox/sandboxes"),
        description="per-sandbox files (credential helpers, sockets) live in <state_dir>/<id>/",
    )


class PoolLearning(_Strict):
    """Pools learned from demand (core.pool): a key that no ``[[pool]]`` declares, asked for
    ``uses`` times within ``window_seconds``, gets a pool of ``size`` of its own, kept while it
    is asked for within the window; off unless enabled (its members are running containers in
    the project's slice, and count against its ceilings)."""

    enabled: bool = Field(default=False, description="learn pools from demand")
    uses: int = Field(default=3, ge=1, description="how many asks for one key make it a pool")
    window_seconds: float = Field(
        default=600.0,
        gt=0,
        description="within this long; a learned pool not asked for within it is trimmed",
    )
    size: int = Field(default=1, ge=1, le=MAX_POOL_SIZE, description="members per learned key")
    max_pools: int = Field(default=8, ge=1, description="learned pools at once, all users")


class DaytonaConfig(_Strict):
    """``[daytona]``: the Daytona API remote sandboxes run on (backends.daytona). The key is
    read from ``api_key_file`` (root's, mode 0600) when the agent starts: never in this file,
    which any local user may read."""

    api_url: str = Field(pattern=r"^https?://", description="the Daytona API's URL")
    api_key_file: PurePosixPath = Field(
        description="root's file (mode 0600) holding the API key, read at the agent's start"
    )
    target: str | None = Field(default=None, description="the Daytona target (region)")

    def api_key(self) -> str:
        path = Path(str(self.api_key_file))
        try:
            found = path.stat()
            key = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"daytona.api_key_file {path}: {exc.strerror}") from exc
        if found.st_mode & 0o077:
            raise ValueError(
                f"daytona.api_key_file {path} is readable by others: chmod 600 it (it is a secret)"
            )
        if not key:
            raise ValueError(f"daytona.api_key_file {path} is empty")
        return key


class Config(_Strict):
    default_image: str = Field(
        default="alpine:3.19", description="the image of a request that names none"
    )
    max_ttl_seconds: int = Field(
        default=24 * 3600,
        gt=0,
        le=TTL_CEILING_SECONDS,
        description="the most a create or an extend may ask (at most a year)",
    )
    # Checked even when left out: a lowered max_ttl_seconds may be below the built-in default.
    default_ttl_seconds: int | None = Field(
        default=3600,
        gt=0,
        validate_default=True,
        description="a sandbox's TTL when its request gives none",
    )
    managed: CeilingConfig = _table("ceilings of everything slicebox runs", memory="75%")
    user: CeilingConfig = _table("ceilings of each user's slice", memory="4GB", pids=2048)
    project: CeilingConfig = _table("ceilings of each project's slice", memory="2GB", pids=1024)
    users: dict[str, CeilingConfig] = Field(
        default={}, description="one user's ceilings: only the fields set replace [user]'s"
    )
    projects: dict[str, CeilingConfig] = Field(
        default={},
        description='one project\'s ceilings, as [projects."user/project"]: only the fields '
        "set replace [project]'s",
    )
    sandbox: SandboxDefaults = _table("what a sandbox gets when its request leaves a limit out")
    admission: AdmissionConfig = _table(
        "whether a create counts what each level's sandboxes are provisioned against its "
        "ceilings (docs/capacity.md); by default it does not, and the kernel shares them"
    )
    bind_roots: tuple[PurePosixPath, ...] = Field(
        default=(),
        description="the roots a caller may bind from and use as host workspaces; {user} is "
        "the caller's own name",
    )
    default_run_as: str = Field(
        default="65534:65534",
        pattern=r"^[1-9][0-9]*:[1-9][0-9]*$",
        description="uid:gid of a sandbox whose request names no one and that has no host "
        "workspace (one with runs as the caller); numeric, so stock images run it",
    )
    root_users: frozenset[str] = Field(
        default=frozenset(),
        description="the only users whose sandboxes may run as uid 0, never with a writable "
        "host mount",
    )
    git_clone_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description="how long a git workspace's clone may take before its create fails "
        "(git_clone_failed)",
    )
    pull_timeout_seconds: float = Field(
        default=900.0,
        gt=0,
        description="how long an image's pull may take before the creates waiting for it fail "
        "(image_pull_failed)",
    )
    registry_credentials: tuple[RegistryCredential, ...] = Field(
        default=(),
        description="credentials a pull may send, per registry and user (model/pulls.py)",
    )
    allowed_capabilities: frozenset[str] = Field(
        default=DEFAULT_CAPABILITIES,
        description="the capabilities a request may add (a sandbox starts with none)",
    )
    allowed_networks: frozenset[str] = Field(
        default=frozenset({"none"}),
        description='the networks a request may ask for; "bridge" only when an operator adds '
        "it, and then on slicebox's own bridge, whose sandboxes cannot reach each other",
    )
    egress: EgressConfig = _table("network egress by allow-list: its network, resolver, rules")
    allow_native_fallback: bool = Field(
        default=True,
        description="a create for Docker while Docker does not answer runs on the native "
        "backend instead (its answer says so); false: refused backend_unavailable",
    )
    native_allow_jit: bool = Field(
        default=False,
        description="native sandboxes may map memory writable and executable (node, java, "
        "pypy); off, such runtimes fail to start",
    )
    daytona: DaytonaConfig | None = Field(
        default=None,
        description='the Daytona API that "backend": "daytona" sandboxes run on; unset: none',
    )
    reaper: ReaperConfig = _table("the reaper: its pace, orphans, empty slices")
    callers: CallersConfig = _table("who may call the agent beyond the kernel's socket check")
    credentials: CredentialsConfig = _table("bounds of the git credentials a create hands over")
    exec_output_budget: RawSize | None = Field(
        default=None,
        description="memory for the output of every exec in flight, all callers; unset: half "
        "the agent's own MemoryMax, or 256 MiB without one",
    )
    files_max_bytes: RawSize = Field(
        default="1GB",
        description="the most one file transfer moves, either way (more is file_too_large)",
    )
    shares: SharesConfig = _table(
        "what one user may hold at once of the output budget, streams and transfers"
    )
    socket: SocketConfig = _table("the agent socket's caps per uid and in all, read at start")
    snapshots: SnapshotConfig = _table("each user's snapshot bounds; paused time and deadlines")
    pool: tuple[PoolConfig, ...] = Field(
        default=(), description="warm pools, one [[pool]] table each (docs/pool.md)"
    )
    pool_learning: PoolLearning = _table("pools learned from demand, for keys no [[pool]] names")
    metrics: MetricsConfig = _table(
        "GET /metrics: per-sandbox series, a TCP listener (docs/metrics.md)"
    )
    nested: NestedConfig = _table(
        "nested sandboxes: how many children and levels a create may ask (docs/nested.md)"
    )

    @field_validator("pool")
    @classmethod
    def _pools(cls, pools: tuple[PoolConfig, ...], info: ValidationInfo) -> tuple[PoolConfig, ...]:
        networks = info.data.get("allowed_networks", frozenset())
        for index, pool in enumerate(pools):
            if pool.network not in networks:
                raise ValueError(
                    f"pool {index}: network {pool.network!r} is not in allowed_networks"
                )
            if pool in pools[:index]:
                raise ValueError(f"pool {index} repeats an earlier [[pool]] table; remove one")
        return pools

    @field_validator("files_max_bytes")
    @classmethod
    def _files_max(cls, value: RawSize) -> RawSize:
        return checked(lambda: parse_size("files_max_bytes", value), value)

    def files_max_bytes_value(self) -> int:
        return parse_size("files_max_bytes", self.files_max_bytes)

    @field_validator("exec_output_budget")
    @classmethod
    def _budget(cls, value: RawSize | None) -> RawSize | None:
        return checked(lambda: value is None or parse_size("exec_output_budget", value), value)

    def exec_output_budget_bytes(self, agent_memory_max: int | None) -> int:
        """The budget in bytes, given the agent's own memory limit (None: it has none)."""
        if self.exec_output_budget is not None:
            return parse_size("exec_output_budget", self.exec_output_budget)
        return agent_memory_max // 2 if agent_memory_max else DEFAULT_EXEC_OUTPUT_BUDGET

    @field_validator("default_ttl_seconds")
    @classmethod
    def _default_within_max(cls, value: int | None, info: ValidationInfo) -> int | None:
        most = info.data.get("max_ttl_seconds")  # absent when it failed its own check
        if value is not None and most is not None and value > most:
            raise ValueError(
                f"{value} is more than max_ttl_seconds ({most}); lower default_ttl_seconds "
                "or raise max_ttl_seconds"
            )
        return value

    def managed_ceiling(self, host_memory: int) -> Ceiling:
        return self.managed.resolve(host_memory)

    def bind_roots_for(self, user: str) -> tuple[PurePosixPath, ...]:
        """The roots ``user`` may bind from: each configured root with ``{user}`` replaced
        by that user's name (user names hold no ``/``), so one root serves everyone and
        nobody reaches another's directory."""
        return tuple(PurePosixPath(str(root).replace("{user}", user)) for root in self.bind_roots)

    def user_ceiling(self, user: str, host_memory: int) -> Ceiling:
        return self._user_config(user).resolve(host_memory)

    def project_ceiling(self, user: str, project: str, host_memory: int) -> Ceiling:
        override = self.projects.get(f"{user}/{project}", CeilingConfig())
        return override.over(self.project).resolve(host_memory)

    def _user_config(self, user: str) -> CeilingConfig:
        return self.users.get(user, CeilingConfig()).over(self.user)


def load_config(path: Path = DEFAULT_PATH) -> Config:
    """Read the TOML config at ``path``; a missing file means the defaults."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        log.info("no config at %s, using the defaults", path)
        return Config()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}; check its permissions") from exc
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        return Config.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}; fix the syntax") from exc
    except ValidationError as exc:
        where = problems(exc)[0].field
        raise ConfigError(f"{source}: {describe(exc)}; fix these settings", field=where) from exc


def read_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Total host memory in bytes, the base of percentage ceilings."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ConfigError(f"{meminfo} has no MemTotal line; is /proc mounted?")


def _size_or_none(field: str, value: RawSize | None, total: int) -> int | None:
    return None if value is None else parse_size(field, value, total)
