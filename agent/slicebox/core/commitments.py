"""What the sandboxes on this host are provisioned, below each project and user slice and in
all: the ledger a create's admission counts against the ceilings (``[admission]``,
``core.headroom``) and the capacity answer reads, kept in memory so that neither lists Docker.

A create reserves its sandbox's limits as it is admitted, checked and added under one lock, so
two creates at once never both take the last room; the reservation stays while the sandbox
lives (its create in flight, then made) and goes with its destroy or its create's failure. A
remote sandbox (Daytona) takes nothing under this host's ceilings and is never counted.

What the agent did not do itself (the sandboxes of an earlier run, one a deadline timer's
expiry or an operator's ``docker rm`` removed) comes in with the reaper's listing (``sync``),
at start and at each pass: a sandbox listed and unknown is counted; one made before the
listing began and not in it is gone. A create in flight is never dropped by a listing, and a
sandbox released after the listing began is not counted again by it. Until that pass, a
sandbox removed behind the agent's back still counts: admission errs on the side of refusing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from slicebox.core.headroom import Amounts, LevelUse, Ratios, Used, admit, amounts, levels
from slicebox.core.policy import Admitted, Placement
from slicebox.model.limits import Limits
from slicebox.model.names import SliceNames
from slicebox.model.spec import Backend

# Backends whose sandboxes run elsewhere: nothing of theirs is under this host's ceilings.
REMOTE = frozenset({Backend.DAYTONA})

# Released sandboxes remembered until a listing that began after their release: at most this
# many (the oldest forgotten first), should no listing come.
RELEASED = 4096


class Listed(NamedTuple):
    """A sandbox as the reaper's listing shows it."""

    sandbox_id: str
    names: SliceNames
    limits: Limits


class _Entry(NamedTuple):
    user: str  # its user's slice unit
    project: str  # its project's slice unit
    amounts: Amounts
    made: int | None  # the ledger's count when it was made or listed; None: in flight


class Commitments:
    """Thread-safe; every call is short and never blocks on I/O (the core loop makes them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._sums: dict[str, Amounts] = {}  # user or project slice unit -> below it
        self._all = Amounts()
        self._count = 0  # events so far: what ``mark`` and ``made`` are counted in
        self._released: dict[str, int] = {}  # sandbox id -> the count at its release

    def mark(self) -> int:
        """Now, in the ledger's count: taken before a listing that ``sync`` is given."""
        with self._lock:
            self._count += 1
            return self._count

    def levels(self, user: str, project: str, placement: Placement) -> tuple[LevelUse, ...]:
        """The three levels above ``placement`` with what is provisioned below each now."""
        with self._lock:
            return levels(user, project, placement, self._used(placement.names))

    def reserve(self, sandbox_id: str, admitted: Admitted, ratios: Ratios) -> None:
        """Admit the sandbox and count it, in flight; refused ``admission_refused`` (and not
        counted) when a level above it has no room left for its limits."""
        spec, placement, names = admitted.spec, admitted.placement, admitted.placement.names
        with self._lock:
            found = levels(spec.user, spec.project, placement, self._used(names))
            admit(admitted.limits, found, ratios)
            entry = _Entry(names.user, names.project, amounts(admitted.limits), None)
            self._add(sandbox_id, entry)

    @contextmanager
    def held(
        self, sandbox_id: str, admitted: Admitted, ratios: Ratios, *, counted: bool = True
    ) -> Iterator[None]:
        """``reserve`` for the block, the sandbox made when it ends, released when it fails;
        nothing is counted unless ``counted``."""
        if counted:
            self.reserve(sandbox_id, admitted, ratios)
        try:
            yield
        except BaseException:
            self.release(sandbox_id)
            raise
        self.made(sandbox_id)

    def made(self, sandbox_id: str) -> None:
        """Its create succeeded: the sandbox now counts as made, as a listing would show it."""
        with self._lock:
            entry = self._entries.get(sandbox_id)
            if entry is not None and entry.made is None:
                self._count += 1
                self._entries[sandbox_id] = entry._replace(made=self._count)

    def release(self, sandbox_id: str) -> None:
        """The sandbox is gone (destroyed, or its create failed): it counts no more."""
        with self._lock:
            self._count += 1
            self._released[sandbox_id] = self._count
            while len(self._released) > RELEASED:
                del self._released[next(iter(self._released))]
            self._drop(sandbox_id)

    def sync(self, listed: Iterable[Listed], mark: int) -> None:
        """In line with a listing that began at ``mark``: what it shows and the ledger does not
        know is counted (unless released since the listing began), and what the ledger knows
        as made before it began and it does not show is gone."""
        with self._lock:
            seen = set[str]()
            for each in listed:
                seen.add(each.sandbox_id)
                known = each.sandbox_id in self._entries
                if known or self._released.get(each.sandbox_id, 0) >= mark:
                    continue
                self._count += 1
                names = each.names
                entry = _Entry(names.user, names.project, amounts(each.limits), self._count)
                self._add(each.sandbox_id, entry)
            for sandbox_id, entry in list(self._entries.items()):
                if entry.made is not None and entry.made < mark and sandbox_id not in seen:
                    self._drop(sandbox_id)
            self._released = {k: at for k, at in self._released.items() if at >= mark}

    def _used(self, names: SliceNames) -> Used:
        empty = Amounts()
        return self._all, self._sums.get(names.user, empty), self._sums.get(names.project, empty)

    def _add(self, sandbox_id: str, entry: _Entry) -> None:
        self._drop(sandbox_id)
        self._entries[sandbox_id] = entry
        self._change(entry, 1)

    def _drop(self, sandbox_id: str) -> None:
        entry = self._entries.pop(sandbox_id, None)
        if entry is not None:
            self._change(entry, -1)

    def _change(self, entry: _Entry, sign: int) -> None:
        self._all = self._all.plus(entry.amounts, sign)
        for unit in (entry.user, entry.project):
            total = self._sums.get(unit, Amounts()).plus(entry.amounts, sign)
            if total.sandboxes:
                self._sums[unit] = total
            else:
                self._sums.pop(unit, None)
