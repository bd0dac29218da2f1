"""Nested sandboxes: a sandbox that may ask the agent for children of its own, on a socket the
agent made for it alone (:mod:`slicebox.core.nesting`, :mod:`slicebox.server.inner`).

A create opts in with ``"nested": {"max_children": N, "max_depth": D}``: at most N children
alive at once, and D levels below it (a child may itself be nested with ``max_depth`` below
D). The configuration bounds both, per user and per project; ``max_depth = 0`` there turns
nesting off for them:

    [nested]
    max_children = 8            # the most a create may ask (children alive at once)
    max_depth = 2               # the most levels below a nested sandbox; 0: nesting off
    creates_per_minute = 30     # children one sandbox may create in any minute
    [nested.users.alice]
    max_depth = 0               # alice's sandboxes are never nested
    [nested.projects."bob/ci"]
    max_children = 32
"""

from pydantic import ConfigDict, Field

from slicebox.model.base import Model
from slicebox.model.paths import SOCKET_ENV

__all__ = ["SOCKET_ENV"]

# Where a nested sandbox finds its socket: the directory the agent made for it is bound here,
# so the slicebox client's default path is the right one inside (and SLICEBOX_SOCKET says so).
INNER_DIRECTORY = "/run/slicebox"
INNER_SOCKET_NAME = "slicebox.sock"
INNER_SOCKET = f"{INNER_DIRECTORY}/{INNER_SOCKET_NAME}"
PROJECT_ENV = "SLICEBOX_PROJECT"  # the CLI's default project inside: its children's
MOST_CHILDREN = 1024
MOST_DEPTH = 8


class NestedSpec(Model):
    """A create's opt-in to nesting."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_children: int = Field(ge=1, le=MOST_CHILDREN, description="children alive at once, at most")
    max_depth: int = Field(
        default=1, ge=1, le=MOST_DEPTH, description="levels of descendants below it, at most"
    )


class NestedBound(Model):
    """One user's or project's bounds: only the fields set replace ``[nested]``'s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_children: int | None = Field(
        default=None, ge=0, le=MOST_CHILDREN, description="replaces [nested] max_children"
    )
    max_depth: int | None = Field(
        default=None, ge=0, le=MOST_DEPTH, description="replaces [nested] max_depth; 0: none"
    )
    creates_per_minute: int | None = Field(
        default=None, ge=1, le=10_000, description="replaces [nested] creates_per_minute"
    )


class NestedConfig(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_children: int = Field(
        default=8,
        ge=0,
        le=MOST_CHILDREN,
        description="the most children alive at once a create may ask for its sandbox",
    )
    max_depth: int = Field(
        default=2,
        ge=0,
        le=MOST_DEPTH,
        description="the most levels of descendants below a nested sandbox; 0: no nesting",
    )
    creates_per_minute: int = Field(
        default=30,
        ge=1,
        le=10_000,
        description="children one nested sandbox may create in any minute",
    )
    users: dict[str, NestedBound] = Field(
        default={}, description="one user's bounds: only the fields set replace [nested]'s"
    )
    projects: dict[str, NestedBound] = Field(
        default={},
        description='one project\'s bounds, as [nested.projects."user/project"]: only the '
        "fields set replace the user's and [nested]'s",
    )

    def bound(self, user: str, project: str) -> NestedBound:
        """The bounds in force for ``user``'s ``project``: every field set."""
        found = NestedBound(
            max_children=self.max_children,
            max_depth=self.max_depth,
            creates_per_minute=self.creates_per_minute,
        )
        for override in (self.users.get(user), self.projects.get(f"{user}/{project}")):
            if override is not None:
                found = found.model_copy(update=override.model_dump(exclude_none=True))
        return found
