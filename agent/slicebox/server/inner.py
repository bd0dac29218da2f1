"""The nested sandboxes' sockets: one per sandbox that opted in (core.nesting), served by the
agent's one server beside its main socket.

Each is ``/run/slicebox/nested/<id>/slicebox.sock``, in a directory that the sandbox's create
bound into it at ``/run/slicebox`` (the directory, not the socket: this one is re-made after a
restart, a new file a bind of the old would not show). The socket is open to any uid (a
sandbox runs as whom it likes), so who may use it is the kernel's answer at accept: the
connecting process must be in that sandbox's cgroup (``host.peercgroup``), or it is answered
``nested_refused`` and closed. What it asks is then that sandbox's request (the server's
middleware gives it the sandbox's user, ``Identity.within``), its connections counted under
its user's uid with the main socket's, and under its own listener's cap.

A restarted agent re-makes every nested sandbox's socket before it answers anyone
(``restore``); each reaper interval, sockets whose sandbox is gone (an expiry, the reaper, a
``docker rm``) are closed and their directories removed (``sync``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import socket
import stat
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from slicebox.core.innerdirs import drop_inner_directory, inner_directory
from slicebox.core.sandbox import Sandbox
from slicebox.host.peercgroup import peer_cgroup, within
from slicebox.model.nested import INNER_SOCKET_NAME
from slicebox.model.paths import NESTED_ROOT
from slicebox.server.api import error_response
from slicebox.web.server import Serving, Vetted

log = logging.getLogger(__name__)

BACKLOG = 64


class Owner(NamedTuple):
    """Whose a nested sandbox's requests are: its id, and its user's uid and primary gid."""

    sandbox_id: str
    uid: int
    gid: int


class InnerListeners:
    """``core.nesting.InnerSockets`` on the agent's server (``attach`` gives it, before the
    main socket is answered)."""

    def __init__(self, root: Path = NESTED_ROOT) -> None:
        self._root = root
        self._serving: Serving | None = None
        self._owners: dict[str, Owner] = {}
        self._scopes: dict[str, str] = {}

    def attach(self, serving: Serving) -> None:
        self._serving = serving

    def owner_of(self, listener: str) -> Owner | None:
        """Whose requests come in on ``listener`` (None: no such socket now)."""
        return self._owners.get(listener)

    @property
    def open_ids(self) -> frozenset[str]:
        return frozenset(self._owners)

    async def open(self, sandbox: Sandbox) -> None:
        """``sandbox``'s socket, bound anew (a stale file from a killed agent replaced)."""
        if self._serving is None:
            raise RuntimeError("the inner sockets are not attached to a server yet")
        try:
            entry = pwd.getpwnam(sandbox.user)
        except KeyError:
            log.warning(
                "%s is nested but %s has no account now; no socket", sandbox.id, sandbox.user
            )
            return
        directory = inner_directory(self._root, sandbox.id)
        path = directory / INNER_SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o666)  # noqa: S103 - any uid of the sandbox's; the peer's cgroup is what counts
            sock.listen(BACKLOG)
        except BaseException:
            sock.close()
            raise
        scope = str(sandbox.scope_cgroup(PurePosixPath("/")))
        self._scopes[sandbox.id] = scope
        self._owners[sandbox.id] = Owner(sandbox.id, entry.pw_uid, entry.pw_gid)
        await self._serving.add_listener(
            sandbox.id, sock, lambda client: self._vet(client, sandbox.id)
        )

    async def close(self, sandbox_id: str) -> None:
        """``sandbox_id``'s socket closed, its connections cut, its directory removed."""
        self._owners.pop(sandbox_id, None)
        self._scopes.pop(sandbox_id, None)
        if self._serving is not None:
            await self._serving.remove_listener(sandbox_id)
        drop_inner_directory(self._root, sandbox_id)

    async def restore(self, nested: list[Sandbox]) -> int:
        """Every running nested sandbox's socket re-made (an agent's start); how many."""
        made = 0
        for sandbox in nested:
            try:
                await self.open(sandbox)
                made += 1
            except OSError as exc:
                log.error("cannot re-make the socket of nested sandbox %s: %s", sandbox.id, exc)
        return made

    def directories(self) -> set[str]:
        """The sandbox ids with a socket directory now."""
        with contextlib.suppress(FileNotFoundError):
            return {directory.name for directory in self._root.iterdir()}
        return set()

    async def sync(
        self, alive: set[str], seen: set[str] | None = None, spared: frozenset[str] = frozenset()
    ) -> list[str]:
        """The sockets of sandboxes no longer ``alive`` closed, and the stray directories
        among ``seen`` (all there are when None) removed, but those of ``spared`` sandboxes;
        the ids closed.

        A create makes its sandbox's directory before the engine knows the sandbox, so a
        directory nobody serves and no running sandbox owns may be a create's in flight: its
        caller passes the creates in flight as ``spared``, read after ``seen`` and before
        ``alive`` (:mod:`slicebox.server.daemon`), which leaves a create no moment to fall
        between them. Removing such a directory failed the create's start: runc found no
        source to bind (a slow host's CI lane, issue 58)."""
        gone = [sandbox_id for sandbox_id in self._owners if sandbox_id not in alive]
        for sandbox_id in gone:
            await self.close(sandbox_id)
        keep = set(self._owners) | alive | spared
        for sandbox_id in (self.directories() if seen is None else seen) - keep:
            drop_inner_directory(self._root, sandbox_id)
        return gone

    def _vet(self, client: socket.socket, sandbox_id: str) -> Vetted:
        owner, scope = self._owners.get(sandbox_id), self._scopes.get(sandbox_id)
        cgroup = peer_cgroup(client)
        if owner is None or scope is None or cgroup is None or not within(cgroup, scope):
            log.warning(
                "refused a connection to %s's socket from outside it (cgroup %s)",
                sandbox_id,
                cgroup or "unknown",
            )
            answer = error_response(
                403,
                "nested_refused",
                "this socket serves the processes of its own sandbox alone",
            )
            return Vetted(refusal=answer)
        return Vetted(uid=owner.uid)
