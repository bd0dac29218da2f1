"""What one local user may hold of the agent's socket at once, and for how long.

Any local user can connect to the agent's socket, so what a connection holds is bounded: the
connections open and the requests in flight, per uid and in all; the request body bytes held
in memory at once, per uid and in all; and the time a request head, a body and a reader that
does not read may take. A refusal is answered at once (429 with ``Retry-After``), and logged at
most once per uid per ``LOG_EVERY`` seconds.

uid 0 is exempt from the per-uid caps (root owns the agent anyway), never from the totals;
members of ``slicebox-admin`` are capped like any uid (the group is looked up per request,
after the caps are passed, and an administrator's tools are as likely to run away as anyone's).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable
from typing import NamedTuple

log = logging.getLogger("slicebox.web.server")

MiB = 1024 * 1024
LOG_EVERY = 10.0  # seconds between two log lines about one uid's refusals
_REMEMBERED = 4096  # uids whose last refusal log line is remembered (older ones forgotten)


# Who a connection's caps count against: a uid (the kernel's word for a local peer), a TCP
# peer's address from elsewhere (the metrics listener's, ``host.tcpowner``), or None: unknown.
PeerKey = int | str | None


class Limits(NamedTuple):
    """The socket's caps and time limits (the defaults never refuse honest use: the load test
    runs 8 clients per user, the benches 8 as one user)."""

    connections_per_uid: int = 64
    connections: int = 1024  # below the unit's LimitNOFILE (16384), with room for the rest
    in_flight_per_uid: int = 32
    in_flight: int = 512
    body_bytes_per_uid: int = 32 * MiB  # request bodies read whole (JSON), held at once
    body_bytes: int = 128 * MiB
    # Each listener of its own (a nested sandbox's socket) at most this many at once, beside
    # its uid's caps.
    connections_per_listener: int = 16
    # Connections over a cap are read for one head, briefly: health is answered, anything else
    # refused 429. At most this many at once; past it, a connection is answered 429 at once,
    # unread, and closed.
    triage: int = 64
    triage_per_uid: int = 8
    triage_timeout: float = 2.0
    head_timeout: float = 10.0  # from a head's first byte to its end
    body_idle: float = 30.0  # the longest wait for the next bytes of a body
    body_timeout: float = 60.0  # a body read whole (a JSON request) arrives within this
    write_stall: float = 60.0  # an answer the client takes nothing of for this long is cut
    retry_after: int = 1  # seconds, in a refusal's Retry-After
    exempt_uids: frozenset[int] = frozenset({0})
    # Routes answered even over the caps (method, path as sent): the agent's health.
    always: frozenset[tuple[str, str]] = frozenset()


class Gate:
    """A count per uid and in all, each under its cap; ``take`` says which cap is full."""

    def __init__(self, per_uid: int, total: int, exempt: frozenset[int]) -> None:
        self.per_uid, self.total, self._exempt = per_uid, total, exempt
        self._held: dict[PeerKey, int] = {}
        self.held = 0

    def take(self, uid: PeerKey, amount: int = 1) -> str | None:
        """Count ``amount`` for ``uid``; None when it fits, else which cap is full ("uid",
        "total"), and nothing is counted."""
        mine = self._held.get(uid, 0)
        if uid not in self._exempt and mine + amount > self.per_uid:
            return "uid"
        if self.held + amount > self.total:
            return "total"
        self._held[uid] = mine + amount
        self.held += amount
        return None

    def give(self, uid: PeerKey, amount: int = 1) -> None:
        left = self._held.get(uid, 0) - amount
        if left > 0:
            self._held[uid] = left
        else:
            self._held.pop(uid, None)
        self.held -= amount

    def of(self, uid: PeerKey) -> int:
        return self._held.get(uid, 0)


class QuietLog:
    """A warning per key at most every ``every`` seconds; no traceback, ever."""

    def __init__(self, every: float = LOG_EVERY) -> None:
        self._every = every
        self._last: dict[Hashable, float] = {}
        self.suppressed = 0

    def warn(self, key: Hashable, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -math.inf) < self._every:
            self.suppressed += 1
            return
        if len(self._last) >= _REMEMBERED:
            cutoff = now - self._every
            self._last = {k: t for k, t in self._last.items() if t > cutoff}
        self._last[key] = now
        log.warning(message, *args)
