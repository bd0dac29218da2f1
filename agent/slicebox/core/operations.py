"""What is in progress on the sandboxes, so the reaper takes none of it for a leftover.

Creates in flight, by sandbox id: their half-made containers and slices are no leftovers. A
create registers before it ensures its slices, and a slice is stopped only under the same
lock (``placing``) after checking them. Every other operation (an exec, a destroy, an extend, a
reaper action) is counted by sandbox id under a lock of its own, taken after ``placing`` when
both are and never held across a call: an exec marks itself from the event loop, which must
not wait while a slice stop holds ``placing``. And when a destroy last took a sandbox out of
each slice: the reaper counts a slice's grace from then at the earliest.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime

from slicebox.model.labels import Lineage
from slicebox.model.names import SliceNames, slice_names


class Operations:
    def __init__(self) -> None:
        # Sandbox id -> (user, project) of each create in progress.
        self._in_flight: dict[str, tuple[str, str]] = {}
        self._placing = threading.Lock()
        # Sandbox id -> how many other operations on it are in progress.
        self._operations: Counter[str] = Counter()
        self._counting = threading.Lock()
        # Slice unit -> when a destroy last took a sandbox out of it. An entry goes when the
        # slice is stopped here.
        self._vacated: dict[str, datetime] = {}

    def in_flight(self) -> dict[str, tuple[str, str]]:
        """Sandbox id -> (user, project) of every create still in progress."""
        with self._placing:
            return dict(self._in_flight)

    def vacated(self) -> dict[str, datetime]:
        """Slice unit -> when a destroy last took a sandbox out of it."""
        with self._placing:
            return dict(self._vacated)

    def engaged(self) -> frozenset[str]:
        """The sandboxes an operation holds now, and those a create is making. The creates are
        read without ``placing``, which a slice stop may hold across a systemd call."""
        return self.busy() | frozenset(self._in_flight)

    @contextmanager
    def operation(self, sandbox_id: str) -> Iterator[None]:
        """Mark an operation on the sandbox while it runs (an exec, a destroy, an extend): the
        reaper leaves the sandbox alone until it ends."""
        self.begin(sandbox_id)
        try:
            yield
        finally:
            self.end(sandbox_id)

    def busy(self) -> frozenset[str]:
        """The sandboxes an operation holds now."""
        with self._counting:
            return frozenset(self._operations)

    def begin(self, sandbox_id: str) -> None:
        """``operation`` in two calls, for async callers; never blocks on I/O."""
        with self._counting:
            self._operations[sandbox_id] += 1

    def end(self, sandbox_id: str) -> None:
        with self._counting:
            self._operations[sandbox_id] -= 1
            if self._operations[sandbox_id] <= 0:
                del self._operations[sandbox_id]

    @contextmanager
    def claim(self, sandbox_id: str) -> Iterator[bool]:
        """The reaper's claim, taken when it acts (not when it plans): True, and held as an
        operation until the block ends, when nothing else is in flight on the sandbox; False
        when a create or any other operation is."""
        with self._placing, self._counting:
            free = sandbox_id not in self._in_flight and self._operations[sandbox_id] == 0
            if free:
                self._operations[sandbox_id] += 1
        if not free:
            yield False
            return
        try:
            yield True
        finally:
            self.end(sandbox_id)

    @contextmanager
    def creating(self, lineage: Lineage, *, hold: bool = False) -> Iterator[None]:
        """The create is in flight while the block runs; with ``hold``, a block that succeeds
        leaves an operation held on the sandbox, taken under the same lock."""
        with self._placing:
            self._in_flight[lineage.sandbox_id] = (lineage.user, lineage.project)
        made = False
        try:
            yield
            made = True
        finally:
            with self._placing:
                del self._in_flight[lineage.sandbox_id]
                if made and hold:
                    self.begin(lineage.sandbox_id)

    def vacate(self, names: SliceNames, now: datetime) -> None:
        """A destroy took a sandbox out of the user and project slices ``names`` at ``now``."""
        with self._placing:
            self._vacated[names.user] = self._vacated[names.project] = now

    def stop_slice_if_idle(
        self, unit: str, remove_if_empty: Callable[[str], bool], *, creating: str | None = None
    ) -> bool:
        """Stop (``remove_if_empty``) a user or project slice that no create (other than
        ``creating``, the one undoing itself) is placing into."""
        with self._placing:
            busy = self._busy_slices(exclude=creating)
            stopped = unit not in busy and remove_if_empty(unit)
            if stopped:
                self._vacated.pop(unit, None)
            return stopped

    def _busy_slices(self, exclude: str | None = None) -> set[str]:
        """The user and project slices creates in progress are placing into."""
        busy = set[str]()
        for sandbox_id, (user, project) in self._in_flight.items():
            if sandbox_id != exclude:
                names = slice_names(user, project)
                busy |= {names.user, names.project}
        return busy
