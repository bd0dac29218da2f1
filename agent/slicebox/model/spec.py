"""The request to create a sandbox, as a later HTTP API takes it: strict, unknown fields refused.

Limits are accepted as written (``'256MB'``, ``0.5``, ``100``) and parsed by the policy, so an
unparsable value like ``'lots'`` gets the stable ``invalid_limit`` code naming the field; schema
errors get their field's code too (:mod:`slicebox.model.validation`).
"""

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import (
    ConfigDict,
    Field,
    SecretStr,
    SerializationInfo,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from slicebox.model.base import Model
from slicebox.model.egress import NetworkSpec
from slicebox.model.nested import NestedSpec
from slicebox.model.snapshots import SnapshotName, is_snapshot_image, snapshot_image
from slicebox.model.validation import refusal
from slicebox.model.wasm import WasmSpec

# The serialization context under which a dump carries secrets: a client's request body only.
SEND_SECRETS = {"send_secrets": True}


def wire_secrets(info: SerializationInfo) -> bool:
    context = info.context
    return isinstance(context, dict) and context.get("send_secrets") is True


Id = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
# A workspace volume's name as the caller gives it. Docker's own is slicebox-<user>-<name>: with
# no '-' in a name the last '-' ends the user's part, so no two users' names can meet.
IMAGE_ID = re.compile(r"(sha256:)?[0-9a-f]+")  # an image's id, or a prefix the engine resolves
VolumeName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.]{0,63}$")]


class Backend(StrEnum):
    DOCKER = "docker"
    NATIVE = "native"  # a systemd slice of transient services on the host (backends.native)
    WASM = "wasm"  # Extism WebAssembly plugins in a native sandbox's slice (backends.wasm)
    DAYTONA = "daytona"  # a remote sandbox on a Daytona API (backends.daytona)


class MountKind(StrEnum):
    BIND = "bind"
    VOLUME = "volume"


class Mount(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: MountKind = MountKind.BIND
    source: str = Field(min_length=1)
    target: str = Field(pattern=r"^/")
    read_only: bool = False


class WorkspaceKind(StrEnum):
    HOST = "host"  # a directory under the caller's own bind roots
    VOLUME = "volume"  # a Docker volume slicebox makes for the caller, with lineage labels
    GIT = "git"  # a fresh volume with a git remote cloned into it before the sandbox is given


class Workspace(Model):
    """What the sandbox finds at ``/workspace``; without one it is a tmpfs that goes with it.

    ``host``: ``path`` is a directory under one of the caller's ``bind_roots``, resolved by
    the kernel (no symlink, ``..`` or mount crossing) and mounted as is; the sandbox runs as
    the caller's own uid:gid, so what it writes there is theirs.
    ``volume``: a volume made for this sandbox, labelled with its lineage and removed with
    its root task; ``name`` names it so that a later sandbox of the same user can mount it
    again, and ``keep`` keeps it after its root task is gone.
    ``git``: a fresh volume as above, with ``url`` cloned into it (at ``ref``, a branch, tag or
    commit; ``depth`` commits deep, 0 for the whole history) before the create answers. A
    token goes in ``credentials.git``, never in the URL."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: WorkspaceKind
    path: str | None = Field(default=None, min_length=1)
    name: VolumeName | None = None
    keep: bool = False
    read_only: bool = False
    url: str | None = Field(default=None, max_length=2048)
    ref: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
    depth: int = Field(default=1, ge=0)

    @field_validator("url")
    @classmethod
    def _plain_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("a git url is http:// or https:// with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "a git url carries no user or token: give them in credentials.git, where they "
                "never reach argv, logs or .git/config"
            )
        return url

    @model_validator(mode="after")
    def _fits_kind(self) -> "Workspace":
        given = {
            name for name in ("path", "name", "url", "ref") if getattr(self, name) is not None
        } | ({"keep"} if self.keep else set())
        allowed = {
            WorkspaceKind.HOST: {"path"},
            WorkspaceKind.VOLUME: {"name", "keep"},
            WorkspaceKind.GIT: {"url", "ref", "keep"},
        }[self.kind]
        if self.kind is WorkspaceKind.HOST and self.path is None:
            raise ValueError("a host workspace needs 'path', a directory under your roots")
        if self.kind is WorkspaceKind.GIT and self.url is None:
            raise ValueError("a git workspace needs 'url', the remote to clone")
        if given - allowed:
            raise ValueError(
                f"{', '.join(sorted(given - allowed))} not for a {self.kind.value} workspace; "
                "host takes path; volume takes name, keep; git takes url, ref, depth, keep"
            )
        return self


# The most hosts one git credential names: with the token's and username's bounds, one
# credential is at most about 25 KiB (the credential tmpfs is shared: core.credentials).
MAX_GIT_HOSTS = 64


class GitCredential(Model):
    """A token for git over HTTP(S), given to git through an askpass helper only: never argv,
    the URL, ``.git/config``, labels, logs or audit. ``hosts`` (``host`` or ``host:port``)
    limits where it is answered; empty: any host the sandbox's git asks for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token: SecretStr = Field(min_length=1, max_length=8192)
    username: str = Field(default="x-access-token", pattern=r"^[^\s:]{1,256}$")
    hosts: tuple[Annotated[str, Field(pattern=r"^[A-Za-z0-9.\[\]:-]{1,261}$")], ...] = Field(
        default=(), max_length=MAX_GIT_HOSTS
    )

    @field_serializer("token", when_used="json")
    def _token(self, token: SecretStr, info: SerializationInfo) -> str:
        """Masked in any JSON, unless the dump says it sends the request (a client's body)."""
        return token.get_secret_value() if wire_secrets(info) else str(token)

    @field_validator("token")
    @classmethod
    def _one_line(cls, token: SecretStr) -> SecretStr:
        if any(c in token.get_secret_value() for c in "\r\n\0"):
            raise ValueError("a token is one line")
        return token


class Credentials(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    git: GitCredential | None = None


class SandboxSpec(Model):
    """What a caller asks for. Everything left out gets the configured secure default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str
    project: str
    image: str | None = None
    command: tuple[str, ...] | None = None
    memory: int | str | None = None
    cpus: float | str | None = None
    pids: int | str | None = None
    # A mode's name ("none", "bridge", as the config allows) or {"egress": {"allow": [...]}}.
    network: str | NetworkSpec = "none"
    env: dict[str, str] = {}
    run_as: str | None = None
    workdir: str | None = None
    mounts: tuple[Mount, ...] = ()
    workspace: Workspace | None = None
    credentials: Credentials | None = None
    cap_add: tuple[str, ...] = ()
    privileged: bool = False
    pid_mode: str | None = None
    ipc_mode: str | None = None
    ttl_seconds: int | None = Field(default=None, gt=0)  # at most max_ttl_seconds: the policy
    task_id: Id | None = None
    root_task_id: Id | None = None
    parent_id: Id | None = None
    backend: Backend = Backend.DOCKER
    # backend wasm: the Extism plugin its execs call (model.wasm); only with that backend.
    wasm: WasmSpec | None = None
    # Opt in to a reused warm-pool member (a ``[[pool]]`` with ``reuse = true``): one a run
    # before used, its processes killed and scratch places emptied at its release
    # (core.poolreset). Without it a request only ever gets a container nothing ran in.
    reuse: bool = False
    # Opt in to nesting (model.nested): the sandbox gets a socket of its own, on which it may
    # create children and act on its descendants, and on nothing else.
    nested: NestedSpec | None = None
    # A fork: the sandbox starts with the filesystem of the caller's snapshot of this name
    # (model.snapshots); its image is that snapshot's, set here from the name and the user.
    from_snapshot: SnapshotName | None = None

    @model_validator(mode="after")
    def _snapshot(self) -> "SandboxSpec":
        """Only a fork runs a snapshot's image, and only its owner's (the reference is a
        digest of owner and name)."""
        if self.image is not None and IMAGE_ID.fullmatch(self.image):
            # The engine resolves any unique prefix of an image's id, two characters will do:
            # by id, anyone could name another user's snapshot.
            raise ValueError("name the image by repository[:tag], not by its id or a prefix of it")
        if self.from_snapshot is None:
            if self.image is not None and is_snapshot_image(self.image):
                raise ValueError('a snapshot is forked with "from_snapshot": its name')
            return self
        owner: str | None = self.user  # None: a create request's, before it is known
        if owner is None:
            return self
        image = snapshot_image(owner, self.from_snapshot)
        if self.image not in (None, image):
            raise ValueError('give "from_snapshot" or "image", not both')
        object.__setattr__(self, "image", image)
        return self

    @model_validator(mode="after")
    def _plugin(self) -> "SandboxSpec":
        if (self.backend is Backend.WASM) != (self.wasm is not None):
            raise ValueError(
                'backend wasm takes its plugin in \'wasm\' ({"path": ...}, {"module": '
                'base64} or {"sha256": ...}), and only that backend takes one'
            )
        return self


def parse_spec(data: Mapping[str, object]) -> SandboxSpec:
    """A :class:`SandboxSpec` from untrusted data; errors name each offending field."""
    try:
        return SandboxSpec.model_validate(data)
    except ValidationError as exc:
        raise refusal(exc) from exc
