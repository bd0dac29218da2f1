"""A bounded map that keeps the most recently used entries, safe across threads: what the agent
remembers of things that do not change (images a create found present, sandboxes' labels)."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most ``size`` entries; a new one beyond that pushes out the least recently used."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: dict[K, V] = {}  # least recently used first
        self._lock = threading.Lock()

    def __contains__(self, key: K) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: K) -> V | None:
        """The entry, now the most recently used; None when there is none."""
        with self._lock:
            if key not in self._entries:
                return None
            value = self._entries[key] = self._entries.pop(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = value
            while len(self._entries) > self._size:
                del self._entries[next(iter(self._entries))]

    def items(self) -> list[tuple[K, V]]:
        """Every entry, least recently used first (none becomes more recent for it)."""
        with self._lock:
            return list(self._entries.items())

    def pop(self, key: K) -> None:
        with self._lock:
            self._entries.pop(key, None)
