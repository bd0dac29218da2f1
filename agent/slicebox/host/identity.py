"""Who is calling: the kernel's answer (SO_PEERCRED), never what a request claims.

The user level of the slice tree defaults to the caller's user name. Root and members of the
admin group (``slicebox-admin``) may act for any user name, as an orchestrator serving many
people does. Everyone else acts only for themselves; another user's sandboxes answer 404.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from pydantic import ConfigDict

from slicebox.model.audit import Caller
from slicebox.model.base import Model
from slicebox.model.errors import Forbidden

ADMIN_GROUP = "slicebox-admin"
USER_CACHE_SECONDS = 10.0  # how long a name and its groups are trusted (nscd: 600 s)
K = TypeVar("K")
V = TypeVar("V")
_UCRED = struct.Struct("3i")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }


class PeerCredentials(Model):
    model_config = ConfigDict(frozen=True)

    pid: int
    uid: int
    gid: int


class SocketOptions(Protocol):
    """What reading SO_PEERCRED needs of a socket (a socket.socket, or asyncio's wrapper of one)."""

    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...


def peer_credentials(sock: SocketOptions) -> PeerCredentials:
    """The credentials the kernel recorded for the peer of a unix socket when it connected."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


class UserDirectory(Protocol):
    def user_name(self, uid: int) -> str | None: ...

    def group_names(self, user: str, gid: int) -> frozenset[str]: ...


class SystemUsers:
    """The host's user database (NSS), as the socket's group check sees it."""

    def user_name(self, uid: int) -> str | None:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return None

    def group_names(self, user: str, gid: int) -> frozenset[str]:
        names = set()
        for group_id in os.getgrouplist(user, gid):
            try:
                names.add(grp.getgrgid(group_id).gr_name)
            except KeyError:
                continue
        return frozenset(names)


class CachedUsers:
    """A ``UserDirectory`` that remembers answers for ``ttl`` seconds: every request resolves
    its caller, and NSS (files, LDAP, sssd) need not be asked each time. Thread-safe."""

    def __init__(
        self,
        users: UserDirectory,
        ttl: float = USER_CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._users = users
        self._ttl = ttl
        self._clock = clock
        self._names: dict[int, tuple[float, str | None]] = {}
        self._groups: dict[tuple[str, int], tuple[float, frozenset[str]]] = {}
        self._lock = threading.Lock()

    def user_name(self, uid: int) -> str | None:
        return self._cached(self._names, uid, lambda: self._users.user_name(uid))

    def group_names(self, user: str, gid: int) -> frozenset[str]:
        return self._cached(self._groups, (user, gid), lambda: self._users.group_names(user, gid))

    def _cached(self, table: dict[K, tuple[float, V]], key: K, look_up: Callable[[], V]) -> V:
        now = self._clock()
        with self._lock:
            hit = table.get(key)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        value = look_up()  # outside the lock: one slow look-up does not hold up the others
        with self._lock:
            table[key] = (now, value)
        return value


class Identity(Model):
    model_config = ConfigDict(frozen=True)

    uid: int
    gid: int
    pid: int
    user_name: str
    is_admin: bool
    comm: str = ""

    @property
    def caller(self) -> Caller:
        return Caller(uid=self.uid, gid=self.gid, pid=self.pid, comm=self.comm)

    def acting_user(self, requested: str | None) -> str:
        """The user level a request acts for: the caller's own unless an admin names another."""
        if requested is None or requested == self.user_name:
            return self.user_name
        if not self.is_admin:
            raise Forbidden(
                f"uid {self.uid} ({self.user_name}) may not act for user {requested!r}; only "
                f"root and members of group {ADMIN_GROUP} may. Leave 'user' out to act as yourself."
            )
        return requested

    def may_see(self, owner: str) -> bool:
        return self.is_admin or owner == self.user_name


def resolve(
    creds: PeerCredentials, users: UserDirectory, admin_group: str = ADMIN_GROUP
) -> Identity:
    """Turn kernel credentials into an identity. A uid without a name acts as ``uid<N>``."""
    name = users.user_name(creds.uid)
    groups = users.group_names(name, creds.gid) if name else frozenset()
    return Identity(
        uid=creds.uid,
        gid=creds.gid,
        pid=creds.pid,
        user_name=name or f"uid{creds.uid}",
        is_admin=creds.uid == 0 or admin_group in groups,
        comm=_comm(creds.pid),
    )


def _comm(pid: int) -> str:
    """The caller's command name; the process may already be gone, which is not an error."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
