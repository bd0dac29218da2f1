"""Pause and resume: a sandbox frozen (no CPU, its memory kept), and what a frozen one refuses.

A pause is the engine's own (``docker pause``: the container's cgroup frozen, its state
recorded by the engine), so the engine, ``docker`` and a restarted agent all read the same
``State.Paused``: a user's pause outlives the agent that made it. A freeze the agent makes only
for a snapshot is marked first in :data:`FREEZES` (``/run``: gone at a reboot, which leaves no
frozen container either); a restarted agent thaws every marked sandbox (:meth:`thaw_leftovers`),
so an agent killed mid-snapshot leaves no sandbox frozen that its user did not pause. A native
sandbox is paused by its own slice's freezer (host.freezer): the kernel keeps that state, and a
restarted agent reads it back from ``cgroup.freeze``.

A paused sandbox refuses an exec or a file transfer (``sandbox_paused``), unless the caller asks
``?resume=1``: then it is resumed first. Whether it is frozen is read from its scope's
``cgroup.freeze`` (a file read per exec), and only a frozen one is confirmed with the engine:
an exec's kill freezes a sandbox for milliseconds too (host.procs), which is no pause.

Its deadline keeps running while it is paused, unless ``[snapshots] paused_time_counts`` is
false: then a pause moves its deadline out of the way (the longest TTL allowed), remembering
how long it had left (:data:`HELD`), and its resume gives it that long again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from slicebox.backends.base import SnapshotEngine
from slicebox.core.blocking import Blocking
from slicebox.core.execaudit import audited, subject
from slicebox.core.files import Files
from slicebox.core.nesting import reaches
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.host.cgroupfs import CgroupFiles
from slicebox.host.freezer import CgroupFreezer, Freezer
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.audit import AuditEvent
from slicebox.model.errors import InvalidRequest, SandboxNotFound, SandboxNotRunning
from slicebox.model.snapshots import PauseState
from slicebox.model.spec import Backend

log = logging.getLogger(__name__)

FREEZES = Path("/run/slicebox/freezes")  # a file per container frozen for a snapshot
HELD = Path("/run/slicebox/paused-deadlines")  # a file per paused sandbox's time left

NATIVE_OR_DOCKER = frozenset({Backend.DOCKER.value, Backend.NATIVE.value})
LookUp = Callable[[Identity, str, Blocking], Awaitable[Sandbox]]


def paused_error(sandbox_id: str) -> SandboxNotRunning:
    return SandboxNotRunning(
        f"sandbox {sandbox_id} is paused; resume it (slicebox resume {sandbox_id}) or ask "
        "again with ?resume=1",
        code="sandbox_paused",
    )


def docker_only(sandbox: Sandbox, what: str, also: tuple[Backend, ...] = ()) -> None:
    if sandbox.backend not in {Backend.DOCKER.value, *also}:
        raise InvalidRequest(
            f"a {sandbox.backend} sandbox cannot be {what} yet; a docker sandbox can",
            code="backend_unsupported",
        )


class Pausing:
    def __init__(
        self,
        engine: SnapshotEngine,
        transfers: Files,
        cgroups: CgroupFiles,
        *,
        marks: tuple[Path, Path] = (FREEZES, HELD),
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        freezer: Freezer | None = None,
    ) -> None:
        """``transfers``: the Service's files, whose look-up, audit and sandboxes these share."""
        self.engine = engine
        self._auditor: Auditor = transfers.auditor
        self._sandboxes: SandboxManager = transfers.sandboxes
        self._looked_up: LookUp = transfers.looked_up
        self._files = cgroups
        self._freezer = freezer or CgroupFreezer()  # a native sandbox's pause
        self._freezes, self._held = marks
        self._clock = clock

    async def pause(self, who: Identity, sandbox_id: str, blocking: Blocking) -> PauseState:
        return await self._switch(who, sandbox_id, blocking, paused=True)

    async def resume(self, who: Identity, sandbox_id: str, blocking: Blocking) -> PauseState:
        return await self._switch(who, sandbox_id, blocking, paused=False)

    async def _switch(
        self, who: Identity, sandbox_id: str, blocking: Blocking, *, paused: bool
    ) -> PauseState:
        sandbox = await self._looked_up(who, sandbox_id, blocking)
        event = AuditEvent.SANDBOX_PAUSED if paused else AuditEvent.SANDBOX_RESUMED
        async with audited(self._auditor, event, who, blocking, **subject(sandbox)):
            docker_only(sandbox, "paused" if paused else "resumed", also=(Backend.NATIVE,))
            step = self._pause if paused else self._resume
            await blocking(functools.partial(step, sandbox))
        return PauseState(id=sandbox.id, paused=paused)

    async def ensure_running(
        self, who: Identity, sandbox_id: str, resume: bool, blocking: Blocking
    ) -> None:
        """Refuse (``sandbox_paused``) a paused sandbox's exec or transfer, or resume it first
        when ``resume``. Another user's sandbox (and one gone), and one a nested sandbox's
        request does not reach (its sibling, its ancestor), are left to the action's own
        look-up, which answers for them as for one that does not exist: whether such a
        sandbox is paused is nothing the caller may learn."""
        # The sandbox as the agent knows it (its labels never change): an exec costs no Docker
        # call more for this; one not known yet is looked up, and remembered.
        sandbox = self._sandboxes.known(sandbox_id)
        try:
            sandbox = sandbox or await self._looked_up(who, sandbox_id, blocking)
        except SandboxNotFound:
            return
        if not who.may_see(sandbox.user) or not reaches(who, sandbox):
            return
        if sandbox.backend not in NATIVE_OR_DOCKER or not self.frozen(sandbox):
            return
        if sandbox.backend == Backend.DOCKER.value:
            paused = functools.partial(self.engine.paused, sandbox.container_id)
            if not await blocking(paused):
                return  # an exec's kill, frozen for milliseconds
        if not resume:
            raise paused_error(sandbox.id)
        await self.resume(who, sandbox_id, blocking)

    def frozen(self, sandbox: Sandbox) -> bool:
        """Whether its cgroup is frozen now (by a pause, or a kill's moment)."""
        return (self._files.read(self._cgroup(sandbox), "cgroup.freeze") or "").strip() == "1"

    @contextlib.contextmanager
    def frozen_for(self, sandbox: Sandbox) -> Iterator[bool]:
        """The sandbox paused for the block (a snapshot's), then resumed; one its user paused
        stays paused. Yields whether the block froze it."""
        container = sandbox.container_id
        if self.engine.paused(container):
            yield False
            return
        self._freezes.mkdir(parents=True, exist_ok=True)
        mark = self._freezes / container
        mark.write_text(sandbox.id)
        try:
            self.engine.pause(container)
            yield True
        finally:
            self._thaw(container)
            mark.unlink(missing_ok=True)

    def thaw_leftovers(self) -> list[str]:
        """At the agent's start: resume what an agent killed mid-snapshot left frozen."""
        thawed = []
        for mark in sorted(self._freezes.glob("*")) if self._freezes.is_dir() else []:
            if self._thaw(mark.name):
                thawed.append(mark.name)
                log.warning("resumed %s, left frozen by a snapshot that did not end", mark.name)
            mark.unlink(missing_ok=True)
        return thawed

    def _thaw(self, container: str) -> bool:
        try:
            if not self.engine.paused(container):
                return False
            self.engine.unpause(container)
        except SandboxNotFound:
            return False
        return True

    def _pause(self, sandbox: Sandbox) -> None:
        if sandbox.backend == Backend.NATIVE.value:
            if not self.frozen(sandbox):
                self._freezer.set_frozen(self._cgroup(sandbox), True)
                self._hold_deadline(sandbox)
        elif not self.engine.paused(sandbox.container_id):
            self.engine.pause(sandbox.container_id)
            self._hold_deadline(sandbox)

    def _resume(self, sandbox: Sandbox) -> None:
        if sandbox.backend == Backend.NATIVE.value:
            self._freezer.set_frozen(self._cgroup(sandbox), False)
        elif self.engine.paused(sandbox.container_id):
            self.engine.unpause(sandbox.container_id)
        self._give_back_deadline(sandbox)

    @staticmethod
    def _cgroup(sandbox: Sandbox) -> str:
        """A docker sandbox's scope, a native sandbox's own slice (the whole machine)."""
        return str(sandbox.scope_cgroup(PurePosixPath("/"))).lstrip("/")

    def _hold_deadline(self, sandbox: Sandbox) -> None:
        """Paused time that does not count: the deadline moved out, its time left kept."""
        config = self._sandboxes.config
        if config.snapshots.paused_time_counts:
            return
        current = self._sandboxes.with_deadline(sandbox).expires_at
        if current is None:
            return
        left = max(1, int((current - self._clock()).total_seconds()))
        self._held.mkdir(parents=True, exist_ok=True)
        (self._held / sandbox.id).write_text(str(left))
        self._sandboxes.extend(sandbox.id, config.max_ttl_seconds)

    def _give_back_deadline(self, sandbox: Sandbox) -> None:
        mark = self._held / sandbox.id
        try:
            left = int(mark.read_text())
        except (OSError, ValueError):
            return
        self._sandboxes.extend(sandbox.id, left)
        mark.unlink(missing_ok=True)
