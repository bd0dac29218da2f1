"""The metrics listener: ``GET /metrics`` on TCP for a scraper, behind a bearer token.

Off unless ``[metrics] listen`` names an address. Any local user can connect to a TCP port and
the kernel names no caller there, so the listener answers only the token of ``[metrics]
token_file`` (``Authorization: Bearer <token>``, what Prometheus' ``authorization`` setting
sends), compared in constant time; without it, or with another, 401 with
``WWW-Authenticate: Bearer``. A scraper with the token sees every series, as an admin does.
Nothing but ``/metrics`` is served there.

The token file must be the agent's own (root's), a regular file, not a link, readable by no one
else (mode 0600 or stricter) and not empty: otherwise the listener does not start, a log line
says why, and the agent serves its socket all the same. The token is read when the listener
starts and at every reload (``apply``: a new token takes over without dropping the port; a new
address moves the listener); it is never logged.

What a connection may hold is bounded as on the socket (``web.limits``), tighter: a scraper
needs a connection or two, each reading one head and sending no body. The caps count per local
user, as the socket's do: a connection from one of this host's own addresses (loopback, or its
LAN address) is counted under the uid that owns its far end, which the kernel says
(``host.tcpowner``), so a user who holds every connection they may open leaves the scraper's
own uid its share. A peer from elsewhere is counted under its address (an IPv6 one's /64), so
a local user, or one remote machine, at its caps leaves a remote scraper its own.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import socket
import stat
from ipaddress import ip_address
from pathlib import Path

from slicebox.host.tcpowner import peer_key
from slicebox.model.metrics import MetricsConfig
from slicebox.server.api import error_response, http_error
from slicebox.server.metrics import AgentMetrics
from slicebox.web.app import Application, Handler
from slicebox.web.limits import Limits
from slicebox.web.request import Request
from slicebox.web.response import StreamResponse
from slicebox.web.server import Serving, serve

log = logging.getLogger(__name__)

TOKEN_MOST = 4096  # bytes: a token file longer than this is no token
BACKLOG = 16
# Per local user, or per remote address (host.tcpowner.peer_key): a scraper needs a
# connection or two; the totals leave room for a few dozen users at their caps at once.
SCRAPER_LIMITS = Limits(
    connections_per_uid=4,
    connections=128,
    in_flight_per_uid=2,
    in_flight=32,
    body_bytes_per_uid=64 * 1024,
    body_bytes=1024 * 1024,
    triage=32,
    triage_per_uid=2,
    exempt_uids=frozenset(),
)
KEEPALIVE = 120.0  # seconds: a scraper keeps its connection between scrapes a minute apart


class TokenRefused(Exception):
    """Why a token file cannot be used; its message names the file, never what it holds."""


def read_token(path: Path) -> str:
    """The token in ``path``, checked as the module says; TokenRefused otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = (
            "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})"
        )
        raise TokenRefused(f"{path} {why}") from exc
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise TokenRefused(f"{path} is not a regular file")
        if found.st_uid != os.geteuid():
            raise TokenRefused(f"{path} is not the agent's own (chown root {path})")
        if found.st_mode & 0o077:
            raise TokenRefused(f"{path} is open to group or others (chmod 600 {path})")
        raw = os.read(fd, TOKEN_MOST + 1)
    finally:
        os.close(fd)
    token = raw.decode(errors="replace").strip()
    if len(raw) > TOKEN_MOST or not token or any(c.isspace() for c in token):
        raise TokenRefused(
            f"{path} holds no token (one line, no spaces, at most {TOKEN_MOST} bytes)"
        )
    return token


class ScrapeListener:
    """The listener as ``[metrics]`` says: started, moved, re-keyed or stopped by ``apply``."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics
        self._token = ""
        self._serving: Serving | None = None
        self._wanted: tuple[str, int] | None = None  # as configured
        self._address: tuple[str, int] | None = None  # as bound

    @property
    def address(self) -> tuple[str, int] | None:
        """Where it listens now (the port the kernel gave for port 0); None: it does not."""
        if self._serving is None or self._address is None:
            return None
        return self._address

    async def apply(self, config: MetricsConfig) -> None:
        """Bring the listener in line with ``config``: the token read again, the port kept
        when the address is the same. A problem is logged, and leaves no listener."""
        wanted = config.address()
        if wanted is None:
            await self.close()
            return
        try:
            self._token = read_token(Path(str(config.token_file)))
        except TokenRefused as exc:
            log.error("metrics listener on %s not started: token file %s", config.listen, exc)
            await self.close()
            return
        if self._serving is not None and wanted == self._wanted:
            return
        await self.close()
        try:
            sock = _bound(*wanted)
        except OSError as exc:
            log.error("metrics listener not started: cannot listen on %s: %s", config.listen, exc)
            return
        self._wanted = wanted
        self._address = sock.getsockname()[:2]
        self._serving = await serve(
            self._app(),
            sock,
            keepalive_timeout=KEEPALIVE,
            limits=SCRAPER_LIMITS,
            peer=peer_key,
        )
        log.info("metrics listener on %s (bearer token from %s)", config.listen, config.token_file)

    async def close(self) -> None:
        serving, self._serving = self._serving, None
        if serving is not None:
            await serving.close(timeout=5.0)

    def _app(self) -> Application:
        app = Application(middlewares=[self._bearer], error_response=http_error)
        app.router.add_get("/metrics", self._scrape)
        return app

    async def _bearer(self, request: Request, handler: Handler) -> StreamResponse:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = self._token
        if (
            not token
            or scheme.lower() != "bearer"
            or not hmac.compare_digest(given.strip().encode(), token.encode())
        ):
            refusal = error_response(
                401, "unauthorized", "send the bearer token of [metrics] token_file"
            )
            refusal.headers["WWW-Authenticate"] = 'Bearer realm="slicebox"'
            return refusal
        return await handler(request)

    async def _scrape(self, request: Request) -> StreamResponse:
        return await self._metrics.answer(None, request.headers.get("accept", ""))


def _bound(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock
