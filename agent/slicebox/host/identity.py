"""Who is calling: the kernel's answer (SO_PEERCRED), never what a request claims.

The user level of the slice tree defaults to the caller's user name. Root and members of the
admin group (``slicebox-admin``) may act for any user name, as an orchestrator serving many
people does. Everyone else acts only for themselves; another user's sandboxes answer 404.

The kernel checks the socket's group when a process connects, against the groups that process
happened to start with (a login's, however stale). So on every request the agent asks the user
database itself, by the caller's uid: a uid with no passwd entry is refused ``unknown_user``
(unless the operator names its range: ``[callers] unknown_uids``), a user who is no member of
the socket's group (nor of the admin group) ``not_member`` — at most ``USER_CACHE_SECONDS``
after their removal. Group membership, the admin's included, is the user's in NSS (primary
and supplementary groups), never the caller's gid or supplementary groups of the moment.
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
from slicebox.model.config import CallersConfig
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

    def groups_of(self, user: str) -> tuple[int, frozenset[str]]:
        """The user's primary gid and the names of all its groups (primary, supplementary);
        (-1, no groups) for a user the database does not know (any more)."""
        ...


class SystemUsers:
    """The host's user database (NSS), as a login would see it."""

    def user_name(self, uid: int) -> str | None:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return None

    def groups_of(self, user: str) -> tuple[int, frozenset[str]]:
        try:
            gid = pwd.getpwnam(user).pw_gid
        except KeyError:
            return -1, frozenset()
        names = set()
        for group_id in os.getgrouplist(user, gid):
            try:
                names.add(grp.getgrgid(group_id).gr_name)
            except KeyError:
                continue
        return gid, frozenset(names)


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
        self._groups: dict[str, tuple[float, tuple[int, frozenset[str]]]] = {}
        self._lock = threading.Lock()

    def user_name(self, uid: int) -> str | None:
        return self._cached(self._names, uid, lambda: self._users.user_name(uid))

    def groups_of(self, user: str) -> tuple[int, frozenset[str]]:
        return self._cached(self._groups, user, lambda: self._users.groups_of(user))

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
    gid: int  # the kernel's, for the audit trail; who a sandbox runs as uses ``primary_gid``
    pid: int
    user_name: str
    is_admin: bool
    comm: str = ""
    primary_gid: int = -1  # the user's in the user database (-1: taken from ``gid``)
    # A nested sandbox's request (core.nesting): the sandbox whose own socket accepted it. Its
    # uid and user are that sandbox's user's; it reaches that sandbox's descendants only.
    within: str = ""

    @property
    def owner(self) -> tuple[int, int]:
        """The uid and primary gid a sandbox of this caller's with a host directory runs as."""
        return self.uid, self.primary_gid if self.primary_gid >= 0 else self.gid

    @property
    def caller(self) -> Caller:
        return Caller(uid=self.uid, gid=self.gid, pid=self.pid, comm=self.comm, sandbox=self.within)

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

    def within_sandbox(self, sandbox_id: str) -> Identity:
        """This identity as a nested sandbox's request: never an admin's, whoever its user."""
        return self.model_copy(update={"within": sandbox_id, "is_admin": False})


def resolve(
    creds: PeerCredentials,
    users: UserDirectory,
    admin_group: str = ADMIN_GROUP,
    callers: CallersConfig | None = None,
) -> Identity:
    """Turn kernel credentials into an identity, or refuse the caller: ``unknown_user`` for a
    uid without a passwd entry, ``not_member`` for a user outside the callers' group."""
    callers = callers or CallersConfig()
    name = users.user_name(creds.uid)
    if creds.uid == 0:  # exempt: root is the host's
        return _identity(creds, name or "root", admin=True, primary_gid=0)
    if name is None:
        return _unknown(creds, callers)
    gid, groups = users.groups_of(name)
    admin = admin_group in groups
    if not admin and callers.group not in groups:
        raise Forbidden(
            f"uid {creds.uid} ({name}) is not a member of group {callers.group!r}, whose members "
            "alone may use slicebox; ask an operator to add you to it",
            code="not_member",
        )
    return _identity(creds, name, admin=admin, primary_gid=gid)


def _unknown(creds: PeerCredentials, callers: CallersConfig) -> Identity:
    """A caller whose uid has no passwd entry: refused, unless the operator allowed its range,
    whose callers all share one user level (and never act as admins)."""
    if not callers.admits_unknown(creds.uid):
        raise Forbidden(
            f"uid {creds.uid} has no entry in this host's user database, and slicebox serves "
            "known users only; call as a user of the host, or ask an operator to allow this "
            "uid range ([callers] unknown_uids)",
            code="unknown_user",
        )
    gid = creds.gid if callers.admits_unknown(creds.gid) else creds.uid
    return _identity(creds, callers.unknown_user, admin=False, primary_gid=gid)


def _identity(creds: PeerCredentials, name: str, *, admin: bool, primary_gid: int) -> Identity:
    return Identity(
        uid=creds.uid,
        gid=creds.gid,
        pid=creds.pid,
        user_name=name,
        is_admin=admin,
        comm=_comm(creds.pid),
        primary_gid=primary_gid,
    )


def _comm(pid: int) -> str:
    """The caller's command name; the process may already be gone, which is not an error."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
