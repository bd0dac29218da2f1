"""Pause, snapshots and forks on the wire and in the engine's store: names, bodies, labels.

A snapshot is one image in the engine's own store, named ``slicebox-snapshot:<tag>`` where the
tag is a digest of its owner and its name (:func:`snapshot_image`): a user names snapshots
freely, the engine never sees those names as references, and no user can name an image of
another's (the digest covers the owner). What a snapshot is, who owns it and where it came from
is in its labels (``slicebox.snapshot.*``), read back from the engine's image list: no state
of the agent's own. The sandbox's ``/workspace`` (a tmpfs, invisible to the engine) is the
image's own ``/workspace``: a fork runs with it there, copy-on-write, and no copy is made.
"""

import hashlib
from datetime import datetime
from typing import Annotated

from pydantic import ConfigDict, Field, RootModel, field_validator

from slicebox.model.base import Model
from slicebox.model.limits import RawSize, parse_size

SNAPSHOT_REPO = "slicebox-snapshot"
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

# Like a workspace volume's name (model.spec.VolumeName): letters, digits, '.', '_'.
SnapshotName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.]{0,63}$")]


def snapshot_image(user: str, name: str) -> str:
    """The image reference of ``user``'s snapshot ``name``: one per owner and name."""
    digest = hashlib.sha256(f"{user}\0{name}".encode()).hexdigest()[:40]
    return f"{SNAPSHOT_REPO}:{digest}"


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
        default="10GB", description="the most disk one user's snapshots may take, all together"
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
