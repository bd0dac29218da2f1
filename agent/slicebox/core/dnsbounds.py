"""What the resolver keeps per egress sandbox, each part bounded (issue 38): code in a sandbox
sends what it likes to port 53, so nothing it sends may grow the agent without end.

- ``Bucket``: a token bucket, ``[egress] resolver_queries_per_second`` with bursts of
  ``resolver_burst`` (100 and 300 by default); a query past it gets no answer (the client
  retries, as for a lost datagram) and is counted.
- ``DeniedTally``: the names refused, at most ``DENIED_NAMES_KEPT`` with their counts, plus the
  total; when full, a new name takes the place of one seen only once (a flood of one-off names
  never pushes out a name asked again and again), else it is only in the total.
- ``Opened``: when each answered address's set element times out, at most ``OPENED_KEPT``; past
  that the expired go, then all (it only spares nftables calls for repeated answers).
"""

from __future__ import annotations

from collections.abc import Callable
from ipaddress import IPv4Address

DENIED_NAMES_KEPT = 64
OPENED_KEPT = 1024

OpenedKey = tuple[IPv4Address, tuple[int, ...]]


class Bucket:
    def __init__(self, clock: Callable[[], float], rate: float, burst: float) -> None:
        self._clock, self._rate, self._burst = clock, rate, burst
        self._tokens, self._at = burst, clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class DeniedTally:
    def __init__(self, kept: int = DENIED_NAMES_KEPT) -> None:
        self._kept = kept
        self._counts: dict[str, int] = {}
        self.total = 0

    def add(self, name: str) -> None:
        self.total += 1
        if name in self._counts or len(self._counts) < self._kept:
            self._counts[name] = self._counts.get(name, 0) + 1
            return
        least = min(self._counts, key=self._counts.__getitem__)
        if self._counts[least] == 1:
            del self._counts[least]
            self._counts[name] = 1

    def most_common(self, count: int | None = None) -> list[tuple[str, int]]:
        ranked = sorted(self._counts.items(), key=lambda pair: (-pair[1], pair[0]))
        return ranked if count is None else ranked[:count]


class Opened:
    def __init__(self, kept: int = OPENED_KEPT) -> None:
        self._kept = kept
        self._until: dict[OpenedKey, float] = {}

    def get(self, key: OpenedKey) -> float:
        return self._until.get(key, 0.0)

    def put(self, key: OpenedKey, until: float, now: float) -> None:
        if key not in self._until and len(self._until) >= self._kept:
            self._until = {k: t for k, t in self._until.items() if t > now}
            if len(self._until) >= self._kept:
                self._until.clear()
        self._until[key] = until

    def clear(self) -> None:
        self._until.clear()

    def __len__(self) -> int:
        return len(self._until)


class SandboxDns:
    """One sandbox's resolver state; ``dropped`` counts queries past its rate, ``refused``
    TCP connections past its share."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.denied = DeniedTally()
        self.opened = Opened()
        self.dropped = 0
        self.refused = 0
