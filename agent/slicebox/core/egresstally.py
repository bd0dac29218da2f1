"""Egress counted per (user, project) for ``GET /metrics``: what the sandboxes with an
allow-list let through and dropped (their nftables counters) and the names their resolver
refused, summed over the sandboxes guarded now and those released since the agent started.

A sandbox's counters die with its rules, so each released sandbox's last reading is kept here,
summed into its project's: the sum a scrape reads never goes down while the agent runs (it
starts from zero with the agent, as a Prometheus counter may). Bounded: one entry per project
that ever had an egress sandbox, and projects are names the agent validated.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from slicebox.host.nft import Counts


class EgressTally(NamedTuple):
    allowed_packets: int = 0
    allowed_bytes: int = 0
    denied_packets: int = 0
    denied_bytes: int = 0
    refused_names: int = 0

    def plus(self, counts: Counts | None, refused_names: int) -> EgressTally:
        """This tally with one sandbox's counters (None: unreadable, or gone) and names."""
        more = counts or Counts(0, 0, 0, 0)
        return EgressTally(
            self.allowed_packets + more.allowed_packets,
            self.allowed_bytes + more.allowed_bytes,
            self.denied_packets + more.denied_packets,
            self.denied_bytes + more.denied_bytes,
            self.refused_names + refused_names,
        )


Project = tuple[str, str]  # (user, project)


class Released:
    """The last readings of released sandboxes, summed by project; thread-safe."""

    def __init__(self) -> None:
        self._sums: dict[Project, EgressTally] = {}
        self._lock = threading.Lock()

    def add(self, project: Project, counts: Counts | None, refused_names: int) -> None:
        with self._lock:
            self._sums[project] = self._sums.get(project, EgressTally()).plus(counts, refused_names)

    def sums(self) -> dict[Project, EgressTally]:
        with self._lock:
            return dict(self._sums)
