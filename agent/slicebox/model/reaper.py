"""What a reaper pass planned and did, as the API answers it (``POST /v1/reaper``)."""

from datetime import datetime
from enum import StrEnum

from pydantic import ConfigDict

from slicebox.model.base import Model


class Rule(StrEnum):
    EXPIRED = "expired"
    PARENT_GONE = "parent_gone"
    ORPHAN = "orphan"
    MISSING_LINEAGE = "missing_lineage"
    EXITED = "exited"
    NEVER_STARTED = "never_started"
    POOL_SURPLUS = "pool_surplus"
    POOL_IDLE = "pool_idle"
    RUN_ENDED = "run_ended"
    ADOPT = "adopt"
    DEADLINE_MISSING = "deadline_missing"
    STALE_DEADLINE = "stale_deadline"
    LEFTOVER_FILES = "leftover_files"
    EMPTY_SLICE = "empty_slice"
    VOLUME_ORPHANED = "volume_orphaned"
    SNAPSHOT_RELEASED = "snapshot_released"


class Kind(StrEnum):
    REMOVE_CONTAINER = "remove_container"
    DESTROY = "destroy"
    ADOPT = "adopt"
    ARM_DEADLINE = "arm_deadline"
    STOP_TIMER = "stop_timer"
    REMOVE_FILES = "remove_files"
    STOP_SLICE = "stop_slice"
    REMOVE_VOLUME = "remove_volume"
    REMOVE_IMAGE = "remove_image"


class Action(Model):
    """One step of a plan; ``target`` is a sandbox id, container id, unit, directory, volume
    or image."""

    model_config = ConfigDict(frozen=True)

    kind: Kind
    rule: Rule
    target: str
    reason: str
    sandbox_id: str = ""
    container_id: str = ""
    user: str = ""
    project: str = ""
    root_task_id: str = ""
    depth: int = 0
    deadline: datetime | None = None


class Outcome(Model):
    model_config = ConfigDict(frozen=True)

    action: Action
    result: str  # "ok", "skipped", "deferred" (an operation was in flight) or an error code
    message: str = ""


class Report(Model):
    """A pass: the plan, and what became of each action (empty on a dry run)."""

    model_config = ConfigDict(frozen=True)

    dry_run: bool
    at: datetime
    instance_id: str
    plan: list[Action]
    outcomes: list[Outcome] = []
