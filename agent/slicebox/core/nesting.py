"""Nested sandboxes: what a sandbox's own socket may ask, decided from labels alone.

A create that opts in (``"nested"``, model.nested) gets a socket the agent makes for that
sandbox alone (``server.inner``), in a directory bound into it at ``/run/slicebox``. A request
on it is the sandbox's (``Identity.within``): its user's, and it reaches exactly the sandboxes
whose ``ancestors`` label names it, its descendants. What it may do there:

- create a child: parent the calling sandbox, its user, project and root task inherited,
  depth one more; limits no larger than the parent's (the parent's when left out), no
  network but ``none`` or an allow-list within the parent's, no workspace but the parent's
  own volume, no bind, capability, credentials, namespace or other backend, a deadline no
  later than the parent's; nested itself only with fewer levels below it. Each is refused
  ``policy_nested`` before anything is made; at most ``max_children`` alive at once and
  ``creates_per_minute`` a minute per parent (``nested_limit``);
- exec, files, usage, extend (never past the parent's deadline) and destroy on its
  descendants; list shows them only. Another sandbox answers as one that does not exist,
  paused or not (``not_found``, never ``sandbox_paused``: core.pausing asks :func:`reaches`
  too). Everything else is refused ``nested_refused`` (``server.api``);
- a child forked from a snapshot (``from_snapshot``) only of a snapshot of the calling
  sandbox or one of its descendants (:func:`reaches_snapshot`); any other, of the same user
  or not, answers ``not_found`` as a snapshot that does not exist.

Nothing here is remembered that labels do not say: a restarted agent rebuilds it all from
them, and the per-parent counts of creates under way are only what this agent is doing now.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Protocol

from slicebox.core.policy import resolve_limits
from slicebox.core.sandbox import Sandbox
from slicebox.host.identity import Identity
from slicebox.model.api import CreateSandbox
from slicebox.model.config import Config
from slicebox.model.egress import NetworkSpec
from slicebox.model.errors import Forbidden, PolicyViolation, ShareFull, Unavailable
from slicebox.model.limits import Limits
from slicebox.model.nested import NestedSpec
from slicebox.model.spec import Backend, SandboxSpec, WorkspaceKind

MINUTE = 60.0
NESTED_BACKENDS = frozenset({Backend.DOCKER, Backend.NATIVE})


class InnerSockets(Protocol):
    """The nested sandboxes' sockets (``server.inner``): made for a new one before its
    create answers, closed with it."""

    async def open(self, sandbox: Sandbox) -> None: ...

    async def close(self, sandbox_id: str) -> None: ...


def refused(message: str, field: str | None = None) -> PolicyViolation:
    return PolicyViolation(message, code="policy_nested", field=field)


def reaches(who: Identity, sandbox: Sandbox) -> bool:
    """Whether a request may act on ``sandbox`` as far as nesting goes: a host caller's may
    (its user's checks are elsewhere); a nested sandbox's only on its descendants."""
    return not who.within or who.within in sandbox.lineage.ancestor_ids


def reaches_snapshot(who: Identity, line: tuple[str, ...]) -> bool:
    """Whether a request may fork a snapshot taken of the sandbox whose line (its ancestors,
    root first, then itself) is ``line``: a host caller's may (that it is its user's own is
    checked by the look-up); a nested sandbox's only a snapshot of itself or of one of its
    descendants, what its own subtree held, never one of an ancestor, a sibling or its user's
    other sandboxes (whose files the socket does not reach either)."""
    return not who.within or who.within in line


def ancestors_of(parent: Sandbox | None) -> str:
    """A child's ``ancestors`` label: its parent's line, root first, then the parent."""
    if parent is None:
        return ""
    return ",".join((*parent.lineage.ancestor_ids, parent.id))


def check_opt_in(spec: SandboxSpec, config: Config, backend: Backend, *, has_account: bool) -> None:
    """A create's ``nested`` against ``[nested]``'s bounds for its user and project."""
    nested, user, project = spec.nested, spec.user, spec.project
    if nested is None:
        return
    bound = config.nested.bound(user, project)
    if not bound.max_depth or not bound.max_children:
        raise refused(
            f"nesting is off for {user}/{project} ([nested] max_depth or max_children is 0); "
            "leave 'nested' out",
            "nested",
        )
    if backend not in NESTED_BACKENDS:
        raise Unavailable(
            f"backend {backend.value} cannot be nested (its sandboxes have no socket of "
            "their own); use backend docker or native",
            code="backend_unsupported",
        )
    if not has_account:
        raise refused(
            f"user {user!r} has no account on this host, so its sandboxes cannot be nested "
            "(their socket's requests are that user's); leave 'nested' out",
            "nested",
        )
    for name, asked, most in (
        ("max_children", nested.max_children, bound.max_children),
        ("max_depth", nested.max_depth, bound.max_depth),
    ):
        assert most is not None
        if asked > most:
            raise refused(
                f"nested.{name} {asked} is more than {user}/{project} may ask ({most}); ask "
                f"at most {most}",
                f"nested.{name}",
            )


def child_request(
    request: CreateSandbox,
    parent: Sandbox,
    parent_deadline: datetime | None,
    config: Config,
    now: datetime,
) -> CreateSandbox:
    """A nested sandbox's create as it will be made: ``parent``'s child, never wider than it.
    Refused ``policy_nested`` for anything the parent does not have."""
    lineage = parent.lineage
    if request.user not in (None, parent.user):
        raise refused(f"a child is its parent's user's ({parent.user}); leave 'user' out", "user")
    if request.project != parent.project:
        raise refused(
            f"a child is in its parent's project ({parent.project!r}), not {request.project!r}",
            "project",
        )
    if request.parent_id not in (None, parent.id):
        raise refused(
            f"a child's parent is the sandbox that asks ({parent.id}); leave 'parent_id' out",
            "parent_id",
        )
    if request.root_task_id not in (None, lineage.root_task_id):
        raise refused(
            f"a child is in its parent's root task ({lineage.root_task_id}); leave "
            "'root_task_id' out",
            "root_task_id",
        )
    if "backend" not in request.model_fields_set:  # left out: its parent's
        request = request.model_copy(update={"backend": Backend(parent.backend)})
    if request.backend.value != parent.backend:
        raise refused(f"a child runs on its parent's backend ({parent.backend})", "backend")
    _check_narrower(request, parent)
    nested = _child_nesting(request.nested, parent)
    limits = _child_limits(request, parent, config)
    ttl = _child_ttl(request.ttl_seconds, parent_deadline, config, now)
    return request.model_copy(
        update={
            "user": parent.user,
            "parent_id": parent.id,
            "root_task_id": lineage.root_task_id,
            "memory": limits.memory_bytes,
            "cpus": limits.cpus,
            "pids": limits.pids,
            "ttl_seconds": ttl,
            "nested": nested,
            "reuse": False,
        }
    )


def _check_narrower(request: CreateSandbox, parent: Sandbox) -> None:
    """No network, workspace or host access the parent does not have."""
    wider = [
        name
        for name, given in (
            ("mounts", request.mounts),
            ("credentials", request.credentials),
            ("cap_add", request.cap_add),
            ("privileged", request.privileged),
            ("pid_mode", request.pid_mode),
            ("ipc_mode", request.ipc_mode),
            ("wasm", request.wasm),
        )
        if given
    ]
    if wider:
        raise refused(
            f"a child takes no {', '.join(wider)}: its parent's socket gives no host access "
            "beyond the parent's own",
            wider[0],
        )
    network = request.network
    if isinstance(network, NetworkSpec):
        allowed = set(parent.lineage.egress.split(",")) if parent.lineage.egress else set()
        extra = sorted(set(network.egress.allow) - allowed)
        if extra:
            have = ", ".join(sorted(allowed)) or "none"
            raise refused(
                f"a child's egress is within its parent's allow-list ({have}); "
                f"{', '.join(extra)} is not in it",
                "network",
            )
    elif network != "none":
        raise refused(
            f"a child's network is 'none' or an allow-list within its parent's, not {network!r}",
            "network",
        )
    space = request.workspace
    if space is None:
        return
    own = parent.lineage.workspace_volume
    same = (
        space.kind is WorkspaceKind.VOLUME
        and space.name is not None
        and not space.keep
        and own == f"slicebox-{parent.user}-{space.name}"
    )
    if not same:
        raise refused(
            "a child's workspace is its own tmpfs or its parent's named volume "
            f"({own or 'the parent has none'}), never a host directory, a clone or another "
            "volume",
            "workspace",
        )


def _child_nesting(asked: NestedSpec | None, parent: Sandbox) -> NestedSpec | None:
    lineage = parent.lineage
    if asked is None:
        return None
    below = lineage.nested_max_depth - 1
    if asked.max_depth > below:
        raise refused(
            f"{parent.id} may have {lineage.nested_max_depth} level(s) below it, so a child of "
            f"it may ask nested.max_depth {below} at most"
            + ("" if below else ": leave 'nested' out"),
            "nested.max_depth",
        )
    if asked.max_children > lineage.nested_max_children:
        raise refused(
            f"a child may ask nested.max_children {lineage.nested_max_children} at most, its "
            "parent's",
            "nested.max_children",
        )
    return asked


def _child_limits(request: CreateSandbox, parent: Sandbox, config: Config) -> Limits:
    """The child's limits: each as asked, or the parent's when left out; none above it."""
    spec = request.model_copy(
        update={
            "memory": parent.limits.memory_bytes if request.memory is None else request.memory,
            "cpus": parent.limits.cpus if request.cpus is None else request.cpus,
            "pids": parent.limits.pids if request.pids is None else request.pids,
        }
    )
    limits = resolve_limits(spec, config)
    for name, asked, most in (
        ("memory", limits.memory_bytes, parent.limits.memory_bytes),
        ("cpus", limits.cpus, parent.limits.cpus),
        ("pids", limits.pids, parent.limits.pids),
    ):
        if asked > most:
            raise refused(
                f"a child's {name} ({asked}) is more than its parent's ({most}); ask at most "
                "the parent's, or leave it out to get it",
                name,
            )
    return limits


def _child_ttl(
    asked: int | None, deadline: datetime | None, config: Config, now: datetime
) -> int | None:
    """A child's TTL, its deadline never past its parent's."""
    if deadline is None:
        return asked
    left = math.floor((deadline - now).total_seconds())
    if left <= 0:
        raise refused("the parent's deadline has passed; it is about to go, and its children")
    if asked is None:
        return min(config.default_ttl_seconds or left, left)
    if asked > left:
        until = (now + timedelta(seconds=left)).isoformat(timespec="seconds")
        raise refused(
            f"a child's ttl_seconds ({asked}) would outlive its parent (its deadline is {until},"
            f" {left} s from now); ask at most {left}",
            "ttl_seconds",
        )
    return asked


def check_deadline(at: datetime | None, parent_deadline: datetime | None) -> None:
    """A nested sandbox's extend of a descendant: never past that sandbox's parent's deadline."""
    if parent_deadline is not None and (at is None or at > parent_deadline):
        raise refused(
            f"the new deadline would outlive the sandbox's parent (its deadline is "
            f"{parent_deadline.isoformat(timespec='seconds')}); ask less",
            "ttl_seconds",
        )


class Births:
    """Each nested sandbox's creates under way and in the last minute, so that neither its
    ``max_children`` nor its ``creates_per_minute`` can be outrun by creates at once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pending: collections.Counter[str] = collections.Counter()
        self._recent: dict[str, collections.deque[float]] = {}

    @contextlib.contextmanager
    def taking(self, parent: Sandbox, alive: int, per_minute: int) -> Iterator[None]:
        """Hold a place for one child of ``parent`` (``alive``: its children now) while its
        create runs; refused ``nested_limit`` when there is none."""
        most = parent.lineage.nested_max_children
        if alive + self._pending[parent.id] >= most:
            raise _limit(
                f"{parent.id} has {alive} children alive and {self._pending[parent.id]} being "
                f"made, its max_children {most}; destroy one first"
            )
        now = self._clock()
        recent = self._recent.setdefault(parent.id, collections.deque())
        while recent and now - recent[0] >= MINUTE:
            recent.popleft()
        if len(recent) >= per_minute:
            wait = max(1, math.ceil(MINUTE - (now - recent[0])))
            raise _limit(
                f"{parent.id} created {per_minute} children in the last minute, its "
                f"creates_per_minute; retry in {wait} s",
                retry_after=wait,
            )
        recent.append(now)
        self._pending[parent.id] += 1
        try:
            yield
        finally:
            self._pending[parent.id] -= 1
            if not self._pending[parent.id]:
                del self._pending[parent.id]

    def forget(self, sandbox_id: str) -> None:
        """A nested sandbox gone: its minute's count goes with it."""
        self._recent.pop(sandbox_id, None)


def _limit(message: str, retry_after: int = 1) -> ShareFull:
    error = ShareFull(message, code="nested_limit")
    error.retry_after = retry_after
    return error


def refuse_route() -> Forbidden:
    return Forbidden(
        "a nested sandbox's socket serves creates of children and acts on its own "
        "descendants only (docs/nested.md); ask this from the host",
        code="nested_refused",
    )
