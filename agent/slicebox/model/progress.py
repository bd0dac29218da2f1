"""Progress of long work as data: an image's pull, a git workspace's clone, a sandbox's start.

A streamed create (``/v1/sandboxes/stream``) and a streamed run (``/v1/run/stream``) send these
as ``{"progress": {...}}`` lines before their result, and the MCP server forwards them as
progress notifications. Each event is a snapshot of its phase (never a delta), so a reader that
missed some (a slow one is sent only the latest) still shows where the work stands.
"""

from enum import StrEnum

from pydantic import ConfigDict, Field

from slicebox.model.base import Model
from slicebox.model.limits import human_bytes

# How many layers one event names: an image has tens at most; a stream naming more is cut.
MAX_LAYERS = 128


class Phase(StrEnum):
    PULLING = "pulling"  # the engine pulls the image: bytes per layer
    CLONING = "cloning"  # git clones the workspace: git's own counts
    STARTING = "starting"  # the container is being created and started


class LayerProgress(Model):
    """One layer of a pull as the engine last said: its status and bytes downloaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(max_length=128)
    status: str = Field(max_length=200)
    current: int | None = Field(default=None, ge=0)
    total: int | None = Field(default=None, ge=0)


class ProgressEvent(Model):
    """Where one phase of a create stands. ``done``/``total``: bytes over all layers of a pull
    (those whose size is known), objects of git's current step (``step``) for a clone."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: Phase
    subject: str = Field(default="", max_length=1000, description="the image or the git URL")
    step: str = Field(default="", max_length=200, description="git's step, an engine's status")
    done: int | None = Field(default=None, ge=0)
    total: int | None = Field(default=None, ge=0)
    layers: tuple[LayerProgress, ...] = Field(default=(), max_length=MAX_LAYERS)

    def describe(self) -> str:
        """One line for a log or a piped CLI."""
        if self.phase is Phase.PULLING:
            done, total = human_bytes(self.done or 0), human_bytes(self.total or 0)
            finished = sum(1 for each in self.layers if each.total and each.current == each.total)
            return (
                f"pulling {self.subject}: {done} of {total}, {finished}/{len(self.layers)} layers"
            )
        words = [self.phase.value, self.subject]
        if self.step:
            words.append(self.step)
        if self.total:
            words.append(f"{self.done or 0}/{self.total}")
        elif self.done:
            words.append(str(self.done))
        if self.layers:
            finished = sum(
                1 for layer in self.layers if layer.total and layer.current == layer.total
            )
            words.append(f"({finished}/{len(self.layers)} layers)")
        return " ".join(word for word in words if word)


class ProgressLine(Model):
    """A line of a streamed create or run before its result: where a long step stands."""

    model_config = ConfigDict(extra="forbid")

    progress: ProgressEvent
