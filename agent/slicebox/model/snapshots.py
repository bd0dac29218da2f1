"""Pause, snapshots and forks on the wire and in the engine's store: names, bodies, labels.

A snapshot is one image in the engine's own store, named ``slicebox-snapshot:<tag>`` where the
tag is a digest of its owner and its name (:func:`snapshot_image`): a user names snapshots
freely, the engine never sees those names as references, and no user can name an image of
another's (the digest covers the owner). What a snapshot is and where it came from is in its
labels (``slicebox-snapshot.*``), read back from the engine's image list: no state of the
agent's own. The sandbox's ``/workspace`` (a tmpfs, invisible to the engine) is the image's own
``/workspace``: a fork runs with it there, copy-on-write, and no copy is made.

Labels alone prove nothing: any image a user pulls may carry ``slicebox-snapshot.user=bob``.
A snapshot is attributed only through the agent's own reference (:func:`attribute`): an image
is user U's snapshot N only when it carries the reference the agent gave U's N, in the
snapshots' repository, which no create may name or pull (``is_snapshot_image``). A snapshot
deleted while a fork still runs its image keeps a retired reference of the agent's
(:func:`retired_image`): it is no snapshot any more, but its bytes stay its owner's (counted
against their quota) until the reaper removes it, once nothing runs it (:func:`released`).
"""

import hashlib
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Annotated, Any

from pydantic import ConfigDict, Field, RootModel, ValidationError, field_validator

from slicebox.model.base import Model
from slicebox.model.limits import RawSize, parse_size

SNAPSHOT_REPO = "slicebox-snapshot"
# How engines spell that repository in an image's RepoTags: Docker's short name, Podman's.
REPOSITORIES = frozenset(
    {SNAPSHOT_REPO, f"localhost/{SNAPSHOT_REPO}", f"docker.io/library/{SNAPSHOT_REPO}"}
)
# "true" on every snapshot image; the rest below it. Not below "slicebox.": a fork inherits
# its image's labels, and those are its lineage's alone (model.labels refuses others there).
LABEL = "slicebox-snapshot"
LABEL_NAME = f"{LABEL}.name"
LABEL_USER = f"{LABEL}.user"
LABEL_PROJECT = f"{LABEL}.project"
LABEL_ORIGIN = f"{LABEL}.origin"  # the sandbox it was taken of
LABEL_ROOT_TASK = f"{LABEL}.root_task_id"
LABEL_BASE = f"{LABEL}.base_image"
LABEL_CREATED = f"{LABEL}.created_at"
# The origin's line: its ancestors, root first, then the origin itself (a nested sandbox forks
# only a snapshot of its own subtree: core.nesting.reaches_snapshot).
LABEL_LINE = f"{LABEL}.line"

# Like a workspace volume's name (model.spec.VolumeName): letters, digits, '.', '_'.
SnapshotName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.]{0,63}$")]


def snapshot_image(user: str, name: str) -> str:
    """The image reference of ``user``'s snapshot ``name``: one per owner and name."""
    return f"{SNAPSHOT_REPO}:{_digest(user, name)}"


def retired_image(user: str, name: str, image_id: str) -> str:
    """The reference the image of ``user``'s deleted snapshot ``name`` keeps while a fork
    still runs it: the agent's own as the snapshot's was, naming that one image (its id)."""
    return f"{SNAPSHOT_REPO}:{_digest(user, name)}-{image_id.removeprefix('sha256:')[:24]}"


def _digest(user: str, name: str) -> str:
    return hashlib.sha256(f"{user}\0{name}".encode()).hexdigest()[:40]


def is_snapshot_image(image: str) -> bool:
    """Whether ``image`` names the snapshots' repository (by any tag or digest)."""
    name = image.rsplit("/", maxsplit=1)[-1]
    return name.split("@", maxsplit=1)[0].split(":", maxsplit=1)[0] == SNAPSHOT_REPO


class SnapshotRequest(Model):
    """``POST /v1/sandboxes/{id}/snapshots``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: SnapshotName


class SnapshotView(Model):
    """One snapshot as its owner sees it."""

    model_config = ConfigDict(frozen=True)

    name: str
    user: str
    project: str
    origin: str  # the sandbox it was taken of
    root_task_id: str
    base_image: str
    created_at: datetime
    size_bytes: int  # the image's size in the engine's store


class SnapshotList(RootModel[list[SnapshotView]]):
    model_config = ConfigDict(defer_build=True)  # as slicebox.model.base.Model


class SnapshotQuery(Model):
    """``?user=`` of the snapshot routes: an admin's choice of whose; others' own always."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str | None = Field(default=None, max_length=64)


class SnapshotDeleted(Model):
    model_config = ConfigDict(frozen=True)

    name: str
    deleted: bool


class PauseState(Model):
    """What a pause or a resume left: whether the sandbox is frozen now."""

    model_config = ConfigDict(frozen=True)

    id: str
    paused: bool


class SnapshotConfig(Model):
    """``[snapshots]``: each user's bounds, and whether paused time counts to a deadline."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_count: int = Field(
        default=10, ge=0, le=1000, description="the most snapshots one user may keep"
    )
    max_bytes: RawSize = Field(
        default="10GB",
        description="the most disk one user's snapshots may take, all together (a deleted "
        "snapshot's image counts until the last fork running it is gone)",
    )
    paused_time_counts: bool = Field(
        default=True,
        description="a paused sandbox's deadline keeps running; false: a resume moves it "
        "later by the time it was paused",
    )

    @field_validator("max_bytes")
    @classmethod
    def _size(cls, value: RawSize) -> RawSize:
        parse_size("snapshots.max_bytes", value)
        return value

    @property
    def max_bytes_value(self) -> int:
        return parse_size("snapshots.max_bytes", self.max_bytes)


class EngineImage(Model):
    """One entry of the engine's image list (``GET /images/json``), as far as snapshots read
    it; an entry that is not this shape is no snapshot."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str = Field(alias="Id")
    tags: list[str] | None = Field(default=None, alias="RepoTags")
    labels: dict[str, str] | None = Field(default=None, alias="Labels")
    size: int = Field(default=0, alias="Size")

    @property
    def references(self) -> list[str]:
        """Its references in the snapshots' repository, each as the agent wrote it."""
        found = []
        for tag in self.tags or []:
            repository, _, name = tag.rpartition(":")
            if repository in REPOSITORIES:
                found.append(f"{SNAPSHOT_REPO}:{name}")
        return found

    @property
    def untagged(self) -> bool:
        return not [tag for tag in self.tags or [] if tag != "<none>:<none>"]


class HeldSnapshot(Model):
    """An image the agent made for a snapshot, attributed by the agent's own reference: a
    snapshot, or (``retired``) one deleted while a fork still runs its image."""

    model_config = ConfigDict(frozen=True)

    image_id: str
    reference: str
    retired: bool
    user: str
    name: str
    size_bytes: int
    labels: dict[str, str]

    @property
    def line(self) -> tuple[str, ...]:
        """Its origin's line (:data:`LABEL_LINE`); a snapshot made before there was one knows
        its origin only."""
        line = self.labels.get(LABEL_LINE) or self.labels.get(LABEL_ORIGIN, "")
        return tuple(part for part in line.split(",") if part)

    def view(self) -> SnapshotView | None:
        """How its owner sees it; None when its labels do not make one."""
        labels = self.labels
        try:
            return SnapshotView(
                name=self.name,
                user=self.user,
                project=labels.get(LABEL_PROJECT, ""),
                origin=labels.get(LABEL_ORIGIN, ""),
                root_task_id=labels.get(LABEL_ROOT_TASK, ""),
                base_image=labels.get(LABEL_BASE, ""),
                created_at=labels.get(LABEL_CREATED) or "1970-01-01T00:00:00+00:00",
                size_bytes=self.size_bytes,
            )
        except ValidationError:
            return None


def attribute(entry: Mapping[str, Any]) -> HeldSnapshot | None:
    """The snapshot image ``entry`` is, or None: only an image that carries the reference the
    agent gives its labels' owner and name (or a retired one of that image's) is one. Labels
    alone (a pulled image's) or malformed ones make none."""
    try:
        image = EngineImage.model_validate(entry)
    except ValidationError:
        return None
    labels = image.labels or {}
    user, name = labels.get(LABEL_USER), labels.get(LABEL_NAME)
    if not user or not name:
        return None
    own, retired = snapshot_image(user, name), retired_image(user, name, image.id)
    references = image.references
    for reference, is_retired in ((own, False), (retired, True)):
        if reference in references:
            return HeldSnapshot(
                image_id=image.id,
                reference=reference,
                retired=is_retired,
                user=user,
                name=name,
                size_bytes=image.size,
                labels=labels,
            )
    return None


class Released(Model):
    """A snapshot image no snapshot names any more, for the reaper to remove once nothing runs
    it: a retired one, or an untagged one (what an agent before retired references left of a
    snapshot deleted while a fork ran it). Its user and name are its labels', said in the
    reaper's reason; they attribute nothing."""

    model_config = ConfigDict(frozen=True)

    target: str  # its retired reference, or (untagged) its id
    image_id: str
    user: str
    name: str
    size_bytes: int


def released(entries: Iterable[Mapping[str, Any]]) -> list[Released]:
    """The released images among the entries of the engine's list of images labelled
    ``slicebox-snapshot=true``."""
    return [gone for gone in map(_released, entries) if gone is not None]


def _released(entry: Mapping[str, Any]) -> Released | None:
    held = attribute(entry)
    if held is not None:
        if not held.retired:
            return None
        return Released(
            target=held.reference,
            image_id=held.image_id,
            user=held.user,
            name=held.name,
            size_bytes=held.size_bytes,
        )
    try:
        image = EngineImage.model_validate(entry)
    except ValidationError:
        return None
    labels = image.labels or {}
    if not image.untagged or labels.get(LABEL) != "true":
        return None
    return Released(
        target=image.id,
        image_id=image.id,
        user=labels.get(LABEL_USER, ""),
        name=labels.get(LABEL_NAME, ""),
        size_bytes=image.size,
    )
