"""The agent's HTTP/1.1 server on a unix socket: the subset of ``aiohttp.web`` its handlers use.

Handlers, middlewares, typed app state and the response classes keep aiohttp's meaning, so the
agent's routes ported one to one (``web.app``, ``web.request``, ``web.response``). What is gone
is what the agent never used: TCP sites (but the metrics listener's one socket, served the same
way: ``server.scrape``), TLS, HEAD, websockets, access logs, and most of aiohttp's resident
memory.

This module serves: ``Serving`` accepts on the listening socket, knows each peer's uid before
it spends anything on its connection, and holds each uid to ``Limits``; one task per
connection (``web.connection``) serves its requests one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
import struct
from collections.abc import Callable
from typing import NamedTuple

from slicebox.web.app import Application
from slicebox.web.connection import Connection
from slicebox.web.limits import Gate, Limits, PeerKey, QuietLog
from slicebox.web.message import phrase
from slicebox.web.response import StreamResponse

BACKLOG = 1024  # a socket bound here (systemd's socket unit sets its own)
_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
ACCEPT_RETRY = 0.1  # seconds between two accepts while descriptors are out
_PEERCRED = struct.Struct("3i")


PeerOf = Callable[[socket.socket], PeerKey]  # who a connection is counted under


class Vetted(NamedTuple):
    """What a listener of its own (``Serving.add_listener``) says of a new connection: the
    uid it is counted under, or the answer that refuses it."""

    uid: int | None = None
    refusal: StreamResponse | None = None


Vet = Callable[[socket.socket], Vetted]


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (None: not known, as for a
    TCP peer: a TCP listener names its peers with a ``PeerOf`` of its own, or all of its
    connections are held to one uid's caps)."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except (OSError, AttributeError):
        return None
    uid: int = _PEERCRED.unpack(raw)[1]
    return uid


class Serving:
    """An application answering on a listening socket (a unix socket, or the metrics
    listener's TCP one), until ``close``: it accepts, and holds each uid to ``limits``."""

    def __init__(
        self,
        app: Application,
        keepalive_timeout: float,
        limits: Limits,
        peer: PeerOf = peer_uid,
    ) -> None:
        """``peer``: who a new connection's caps are counted under (``peer_uid``)."""
        self.app = app
        self._peer = peer
        self.keepalive_timeout = keepalive_timeout
        self.limits = limits
        self.closing = False
        exempt = limits.exempt_uids
        self.open = Gate(limits.connections_per_uid, limits.connections, exempt)
        self.over = Gate(limits.triage_per_uid, limits.triage, frozenset())
        self.in_flight = Gate(limits.in_flight_per_uid, limits.in_flight, exempt)
        self.bodies = Gate(limits.body_bytes_per_uid, limits.body_bytes, exempt)
        self.quiet = QuietLog()
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._open: dict[Connection, asyncio.Task[None]] = {}
        self._closed = asyncio.Event()
        # Listeners of their own beside the main socket (a nested sandbox's: server.inner),
        # by name: each socket and its accept loop, and its connections open now.
        self._listeners: dict[str, tuple[socket.socket, asyncio.Task[None]]] = {}
        self._per_listener: dict[str, int] = {}

    @property
    def connections(self) -> int:
        """The connections open now."""
        return len(self._open)

    def full_of(self, uid: PeerKey) -> str:
        """Which connection cap ``uid`` is over ("uid" or "total")."""
        exempt = uid in self.limits.exempt_uids
        return "uid" if not exempt and self.open.of(uid) >= self.open.per_uid else "total"

    def refused(self, uid: PeerKey, what: str, why: str) -> str:
        """Log (at most once per uid per 10 s) that ``uid`` was refused ``what`` because
        ``why`` cap is full; the refusal's message."""
        gate = {"connections": self.open, "requests in flight": self.in_flight}.get(what)
        if why == "uid":
            cap = f"{gate.per_uid} of yours" if gate else "your share"
        else:
            cap = f"{gate.total} on the agent, everyone's" if gate else "the agent's whole budget"
        self.quiet.warn(uid, "uid %s refused: too many %s at once (%s cap)", uid, what, why)
        return (
            f"too many {what} at once ({cap} are in use); finish or close some, and retry "
            f"after {self.limits.retry_after} s"
        )

    async def close(self, timeout: float = 30.0) -> None:
        """Stop accepting; close idle connections now and the others once answered (or cut
        after ``timeout``); then run the app's ``on_cleanup``. Once; later calls wait for it."""
        if self.closing:
            await self._closed.wait()
            return
        self.closing = True
        try:
            if self._accepting is not None:
                self._accepting.cancel()
                await asyncio.gather(self._accepting, return_exceptions=True)
            if self._sock is not None:
                self._sock.close()
            for name in list(self._listeners):
                await self.remove_listener(name, cut=False)
            for conn, task in list(self._open.items()):
                if not conn.busy:
                    task.cancel()
            await self._finish(timeout)
            for callback in self.app.on_cleanup:
                await callback(self.app)
        finally:
            self._closed.set()

    def listen(self, sock: socket.socket) -> None:
        """Answer on ``sock``, the main listening socket, from now on."""
        self._listen(sock)

    def _listen(self, sock: socket.socket) -> None:
        # Our own accept loop, not asyncio.start_server: it knows the peer's uid before it
        # spends anything on a connection, and at the descriptor limit it waits and says so
        # once, where asyncio's logs a traceback per try. (It never unlinks the socket's file,
        # which systemd's socket unit owns.)
        sock.setblocking(False)
        self._sock = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock))

    async def add_listener(self, name: str, sock: socket.socket, vet: Vet) -> None:
        """Accept on ``sock`` too, a bound and listening unix socket, until ``remove_listener``:
        each connection is vetted first (``vet``: who it is counted under, or its refusal),
        at most ``limits.connections_per_listener`` of them open at once, and its requests
        know ``name`` (``Request.listener``). A name already listening is replaced."""
        sock.setblocking(False)
        # The old socket's accept is over before it is closed: a closed descriptor the loop
        # still waits on could be the new socket's number.
        await self.remove_listener(name, cut=False)
        task = asyncio.get_running_loop().create_task(self._accept(sock, name, vet))
        self._listeners[name] = (sock, task)

    async def remove_listener(self, name: str, *, cut: bool = True) -> bool:
        """Stop accepting on ``name``'s socket and close it; ``cut``: its connections too (a
        sandbox gone: nothing it asks is answered any more). False when it had none."""
        found = self._listeners.pop(name, None)
        if found is None:
            return False
        sock, task = found
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
        if cut:
            for conn, running in list(self._open.items()):
                if conn.listener == name:
                    running.cancel()
        return True

    @property
    def listeners(self) -> frozenset[str]:
        return frozenset(self._listeners)

    async def _accept(
        self, sock: socket.socket, listener: str = "", vet: Vet | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(sock)
            except OSError as exc:
                why = "descriptors are out" if exc.errno in _OUT_OF_FDS else "it failed"
                self.quiet.warn("accept", "cannot accept a connection (%s: %s); retrying", why, exc)
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            if vet is None:
                self._admit(client)
                continue
            vetted = vet(client)
            refusal = vetted.refusal
            if (
                refusal is None
                and self._per_listener.get(listener, 0) >= self.limits.connections_per_listener
            ):
                most = self.limits.connections_per_listener
                self.quiet.warn(listener, "%s refused: %d connections open on it", listener, most)
                reason = (
                    f"too many connections at once ({most} on this socket are open); close "
                    f"some, and retry after {self.limits.retry_after} s"
                )
                refusal = self.app.error_response(429, reason)
            if refusal is None:
                self._admit(client, vetted.uid, listener)
            elif self.over.take(None) is not None:  # refusals in triage are full: a flood
                self._turn_away(client, "", refusal)
            else:  # its request's head is read, then refused: its client reads why
                self._serve(
                    Connection(self, client, None, True, listener=listener, refusal=refusal)
                )

    def _admit(self, client: socket.socket, *vetted: int | str | None) -> None:
        """Serve ``client``; ``vetted``: a listener's connection, (its uid, the listener)."""
        uid = self._peer(client) if not vetted else vetted[0]
        listener = str(vetted[1]) if vetted else ""
        triage = False
        why = self.open.take(uid)
        if why is not None:
            reason = self.refused(uid, "connections", why)
            if self.over.take(uid) is not None:
                self._turn_away(client, reason)
                return
            triage = True
        conn = Connection(self, client, uid, triage, listener=listener)
        if listener:
            self._per_listener[listener] = self._per_listener.get(listener, 0) + 1
        self._serve(conn)

    def _serve(self, conn: Connection) -> None:
        task = asyncio.get_running_loop().create_task(conn.run())
        self._open[conn] = task
        task.add_done_callback(lambda _: self._gone(conn))

    def _turn_away(
        self, client: socket.socket, reason: str, answer: StreamResponse | None = None
    ) -> None:
        """Refuse a connection of a flood without reading it: its 429 (or ``answer``) goes out
        in one send (the kernel keeps it for the client to read after the close), and it is
        closed."""
        refusal = answer or self.app.error_response(429, reason)
        body = refusal._payload() or b""
        fields = [("Content-Type", refusal.headers.get("Content-Type", "text/plain"))]
        fields += [
            ("Content-Length", str(len(body))),
            ("Retry-After", str(self.limits.retry_after)),
        ]
        status = refusal.status
        head = [f"HTTP/1.1 {status} {phrase(status)}", *(f"{k}: {v}" for k, v in fields)]
        try:
            client.setblocking(False)
            client.send("\r\n".join([*head, "Connection: close", "", ""]).encode() + body)
        except OSError:
            pass  # the client is gone, or reads nothing: it is closed all the same
        finally:
            client.close()

    def _gone(self, conn: Connection) -> None:
        if self._open.pop(conn, None) is not None:
            (self.over if conn.triage else self.open).give(conn.uid)
            if conn.listener and conn.refusal is None:
                left = self._per_listener.get(conn.listener, 1) - 1
                if left > 0:
                    self._per_listener[conn.listener] = left
                else:
                    self._per_listener.pop(conn.listener, None)

    async def _finish(self, timeout: float) -> None:
        tasks = list(self._open.values())
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=timeout)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve(
    app: Application,
    sock: socket.socket,
    *,
    keepalive_timeout: float = 75.0,
    limits: Limits | None = None,
    peer: PeerOf = peer_uid,
) -> Serving:
    """Serve ``app`` on ``sock``, a bound and listening unix socket (systemd's, say), or a
    TCP one whose ``peer`` names who connected."""
    serving = Serving(app, keepalive_timeout, limits or Limits(), peer)
    serving._listen(sock)
    return serving


async def serve_path(
    app: Application,
    path: str,
    *,
    keepalive_timeout: float = 75.0,
    limits: Limits | None = None,
) -> Serving:
    """Serve ``app`` on a new unix socket at ``path`` (a stale socket file there is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return await serve(app, sock, keepalive_timeout=keepalive_timeout, limits=limits)
