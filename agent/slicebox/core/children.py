"""A nested sandbox's requests as the service runs them (core.nesting decides what they may
be): a child's create checked against its parent as systemd and the labels say it is now,
its place among the parent's children held while it is made, the parent's socket opened and
closed with it, and its subtree taken down before it, deepest first."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta

from slicebox.core.blocking import Blocking
from slicebox.core.nesting import Births, InnerSockets, check_deadline, child_request
from slicebox.core.policy import check_ttl
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.host.identity import Identity
from slicebox.model.api import CreateSandbox

log = logging.getLogger(__name__)


class Children:
    def __init__(
        self,
        sandboxes: SandboxManager,
        sockets: InnerSockets | None,
        clock: Callable[[], datetime],
        births: Births | None = None,
    ) -> None:
        self._sandboxes = sandboxes
        self._sockets = sockets
        self._clock = clock
        self._births = births or Births()

    async def child(
        self, who: Identity, request: CreateSandbox, blocking: Blocking
    ) -> tuple[CreateSandbox, AbstractContextManager[None]]:
        """``request`` as the calling sandbox's child, and the place among its children
        that its create holds (``nested_limit`` when there is none)."""
        parent = await self._parent(who, blocking)
        config = self._sandboxes.config
        made = child_request(request, parent, parent.expires_at, config, self._clock())
        find = functools.partial(self._sandboxes.find, user=parent.user, parent_id=parent.id)
        alive = len(await blocking(find))
        bound = config.nested.bound(parent.user, parent.project)
        assert bound.creates_per_minute is not None
        return made, self._births.taking(parent, alive, bound.creates_per_minute)

    async def check_extend(
        self, who: Identity, sandbox: Sandbox, ttl_seconds: int, blocking: Blocking
    ) -> None:
        """A nested sandbox's extend of its descendant: never past that one's parent's
        deadline (systemd's, which an extend of the parent may have moved)."""
        if not who.within or not sandbox.lineage.parent_id:
            return
        check_ttl(ttl_seconds, self._sandboxes.config)  # a sane number before any arithmetic
        at = self._clock() + timedelta(seconds=ttl_seconds)
        parent = await self._sandboxes.found(sandbox.lineage.parent_id, blocking)
        current = await blocking(functools.partial(self._sandboxes.with_deadline, parent))
        check_deadline(at, current.expires_at)

    async def opened(self, sandbox: Sandbox, blocking: Blocking) -> None:
        """A new nested sandbox's socket, before its create answers: a sandbox whose socket
        cannot be made is removed, and the create fails."""
        if not sandbox.lineage.nested or self._sockets is None:
            return
        try:
            await self._sockets.open(sandbox)
        except BaseException:
            destroy = functools.partial(self._sandboxes.destroy_sandbox, sandbox, _nothing)
            await asyncio.shield(blocking(destroy))
            raise

    async def closed(self, sandbox: Sandbox) -> None:
        """A nested sandbox removed: its socket and its counts go."""
        if sandbox.lineage.nested:
            self._births.forget(sandbox.id)
            if self._sockets is not None:
                await self._sockets.close(sandbox.id)

    async def subtree(self, sandbox: Sandbox, blocking: Blocking) -> list[Sandbox]:
        """A nested sandbox's descendants, deepest first (none for any other)."""
        if not sandbox.lineage.nested:
            return []
        found = await blocking(functools.partial(self._sandboxes.find, user=sandbox.user))
        below = [s for s in found if sandbox.id in s.lineage.ancestor_ids]
        return sorted(below, key=lambda s: -s.lineage.depth)

    async def _parent(self, who: Identity, blocking: Blocking) -> Sandbox:
        """The calling sandbox with the deadline systemd holds for it now."""
        parent = await self._sandboxes.found(who.within, blocking)
        return await blocking(functools.partial(self._sandboxes.with_deadline, parent))


def _nothing(sandbox: Sandbox) -> None:
    """No last look: a sandbox that never answered its create ran nothing to read."""
