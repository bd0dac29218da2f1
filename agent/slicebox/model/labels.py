"""Lineage lives in immutable Docker labels under the ``slicebox.`` prefix (no database).

:class:`Lineage` is the typed form; :meth:`Lineage.to_labels` and :func:`decode` convert to and
from the flat string labels Docker stores. Secrets never go here: labels are visible to anyone
who can inspect the container.
"""

from collections.abc import Mapping
from datetime import UTC, datetime

from pydantic import ConfigDict, ValidationError

from slicebox.model.base import Model
from slicebox.model.errors import HostError
from slicebox.model.validation import Problem, problems

PREFIX = "slicebox."
MANAGED = f"{PREFIX}managed"
EGRESS_ADDRESS = f"{PREFIX}egress_address"


class Lineage(Model):
    """Everything a container's labels say about where it came from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sandbox_id: str
    instance_id: str
    root_task_id: str
    task_id: str
    parent_id: str = ""
    depth: int = 0
    user: str
    project: str
    backend: str = "docker"
    created_at: datetime
    expires_at: datetime | None = None
    provisioned_cpu: float
    provisioned_memory_bytes: int
    provisioned_pids: int
    # A warm pool's member (core.pool), made for its pool's user and project before any task
    # was known: its task facts, once acquired, are in a lease in systemd (model.pool.Lease),
    # and its labels' task ids are its own id. ``pool_key`` is the fingerprint of the key it
    # serves (model.pool.PoolKey), so a restarted agent adopts it into the right pool.
    pool: bool = False
    pool_key: str = ""
    # Made for a one-shot run (``POST /v1/run``), which removes it once its exec has ended:
    # one that no operation holds is left over (its agent stopped meanwhile, or the removal
    # failed), and the reaper removes it (``run_ended``).
    oneshot: bool = False
    # The workspace volume slicebox made or reused for this sandbox ("" when none).
    workspace_volume: str = ""
    # What credentials it was given ("git"), never their values ("" when none).
    credentials: str = ""
    # Its main process is a waiter that runs one command written to its stdin ("sh"; ""
    # when it runs ``sleep infinity`` or the command asked for): see ``core.launch``.
    launcher: str = ""
    # Network egress by allow-list (core.egress): its entries, comma-separated, and its fixed
    # address on the egress network ("" when it has none). Names and networks, no secret.
    egress: str = ""
    egress_address: str = ""
    # Nesting (core.nesting): whether it has a socket of its own, and what that socket may
    # make (children alive at once, levels below it); ``ancestors``: the ids of its parent's
    # line, root first, comma-separated ("" for a sandbox with no parent). A nested sandbox's
    # socket reaches exactly the sandboxes whose ``ancestors`` name it.
    nested: bool = False
    nested_max_children: int = 0
    nested_max_depth: int = 0
    ancestors: str = ""

    @property
    def ancestor_ids(self) -> tuple[str, ...]:
        return tuple(self.ancestors.split(",")) if self.ancestors else ()

    # A fork's snapshot (model.snapshots), by its owner's name for it ("" when none).
    from_snapshot: str = ""

    def to_labels(self) -> dict[str, str]:
        values = {
            "managed": "true",
            "sandbox_id": self.sandbox_id,
            "instance_id": self.instance_id,
            "root_task_id": self.root_task_id,
            "task_id": self.task_id,
            "parent_id": self.parent_id,
            "depth": str(self.depth),
            "user": self.user,
            "project": self.project,
            "backend": self.backend,
            "created_at": stamp(self.created_at),
            "expires_at": "" if self.expires_at is None else stamp(self.expires_at),
            "provisioned.cpu": repr(self.provisioned_cpu),
            "provisioned.memory_bytes": str(self.provisioned_memory_bytes),
            "provisioned.pids": str(self.provisioned_pids),
            "pool": "true" if self.pool else "false",
            "pool_key": self.pool_key,
            "oneshot": "true" if self.oneshot else "false",
            "workspace_volume": self.workspace_volume,
            "credentials": self.credentials,
            "launcher": self.launcher,
            "egress": self.egress,
            "egress_address": self.egress_address,
            "nested": "true" if self.nested else "false",
            "nested.max_children": str(self.nested_max_children),
            "nested.max_depth": str(self.nested_max_depth),
            "ancestors": self.ancestors,
        }
        if self.from_snapshot:  # a fork's only: other sandboxes' labels stay as they were
            values["from_snapshot"] = self.from_snapshot
        return {PREFIX + key: value for key, value in values.items()}


VOLUME_MARK = f"{PREFIX}volume"


class VolumeLineage(Model):
    """A workspace volume's labels: whose it is, the root task it goes with, whether it stays."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str
    project: str
    root_task_id: str
    sandbox_id: str  # the sandbox whose create made it
    keep: bool = False
    created_at: datetime

    def to_labels(self) -> dict[str, str]:
        values = {
            "user": self.user,
            "project": self.project,
            "root_task_id": self.root_task_id,
            "sandbox_id": self.sandbox_id,
            "keep": "true" if self.keep else "false",
            "created_at": stamp(self.created_at),
        }
        return {VOLUME_MARK: "true"} | {PREFIX + key: value for key, value in values.items()}


def decode_volume(labels: Mapping[str, str]) -> VolumeLineage | None:
    """A volume's lineage; None for a volume slicebox did not make (or whose labels are not
    all ours)."""
    if labels.get(VOLUME_MARK) != "true":
        return None
    ours = {k[len(PREFIX) :]: v for k, v in labels.items() if k.startswith(PREFIX)}
    ours.pop("volume")
    try:
        return VolumeLineage.model_validate(ours)
    except ValidationError:
        return None


def is_managed(labels: Mapping[str, str]) -> bool:
    return labels.get(MANAGED) == "true"


def decode(labels: Mapping[str, str]) -> Lineage:
    """The lineage of a container from its labels; refuses labels slicebox did not write.

    The refusal's message is a clause about the container ("its labels are incomplete
    (missing slicebox.user); ..."), for the reaper's reasons and the agent's answers alike.
    """
    ours = {
        key[len(PREFIX) :].replace(".", "_"): value
        for key, value in labels.items()
        if key.startswith(PREFIX) and key != MANAGED
    }
    if not is_managed(labels):
        raise HostError(
            f"it has no {MANAGED}=true label; slicebox did not make it", code="broken_labels"
        )
    if ours.get("expires_at") == "":
        ours.pop("expires_at")
    try:
        return Lineage.model_validate(ours)
    except ValidationError as exc:
        raise HostError(_broken(problems(exc)), code="broken_labels") from exc


def _broken(found: list[Problem]) -> str:
    """Missing labels mean a create that never finished; wrong ones, a hand that was not ours."""
    missing = [_label(p.field) for p in found if p.kind == "missing"]
    if missing:
        return (
            f"its labels are incomplete (missing {', '.join(missing)}); "
            "it was not made by a complete create"
        )
    wrong = "; ".join(f"{_label(p.field)}: {p.text}" for p in found)
    return f"its labels are malformed ({wrong}); slicebox did not write them"


def _label(field: str) -> str:
    """The label a :class:`Lineage` field is read from."""
    return PREFIX + field.replace("provisioned_", "provisioned.")


def selector(**labels: str) -> dict[str, str]:
    """Label filters for listing: ``selector(user='alice')`` -> ``{'slicebox.user': 'alice'}``."""
    return {MANAGED: "true"} | {PREFIX + key.replace("__", "."): v for key, v in labels.items()}


def stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds")
