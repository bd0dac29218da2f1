"""What one user may hold at once of what the agent bounds for every caller together.

Four things are bounded for all callers: the bytes of the exec output budget
(:mod:`slicebox.core.budget`), streamed execs and runs answering at once, file transfers moving
at once, and distinct image pulls at once (:mod:`slicebox.core.pulls`). A bound for all alone
lets one user take all of it: two execs with a 16 MiB ``output_cap`` and a third fill a 512 MiB
budget, and every other user's exec is refused for as long as their holder keeps them. So each
is also bounded per user, by ``[shares] user_share`` of it (half by default): a user's share is
checked first (``*_share_full``, 429), then the bound for all (``busy``, ``streams_busy``,
``transfers_busy``, ``pulls_busy``, 503); both answer ``Retry-After``.

The holder is the caller's kernel identity, its uid (SO_PEERCRED, :mod:`slicebox.host.identity`),
whatever user name it acts for: the only name a hostile caller cannot choose. Root and members
of ``slicebox-admin`` hold no share and are bound by the totals only: they act for many users
(an orchestrator serving many people, which would starve its own users at half), and may end
any user's sandboxes anyway.

What is held is given back once, however the request ends (:class:`Reservation`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import NamedTuple

from slicebox.host.identity import Identity
from slicebox.model.errors import Busy, ShareFull
from slicebox.model.shares import SharesConfig

Holder = int | None  # a caller's uid; None: bound by the totals only (admins)


def holder_of(who: Identity | None) -> Holder:
    """Who a request's holdings are counted against (None: the agent's own, as a pool's
    refill: the totals only)."""
    return None if who is None or who.is_admin else who.uid


class Reservation:
    """What a request holds until :meth:`release` (or the end of a ``with`` block)."""

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back: Callable[[], None] | None = give_back

    def release(self) -> None:
        """Give it back; releasing twice gives it back once."""
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def also(self, other: Reservation) -> Reservation:
        """One reservation holding this and ``other``, released together."""

        def both() -> None:
            try:
                other.release()
            finally:
                self.release()

        return Reservation(both)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Bounds(NamedTuple):
    total: int  # every holder together
    each: int  # one holder (a uid); a holder None is bound by the total only


class Standing(NamedTuple):
    """What was held when a take was refused, for the refusal's message."""

    share: bool  # the holder's own share was full (else the total)
    bounds: Bounds
    held: int  # by everyone
    holds: int  # takes in flight, everyone's
    mine: int  # by this holder
    my_holds: int


class Full(Exception):
    """A take that does not fit now; callers answer it with their own code."""

    def __init__(self, standing: Standing) -> None:
        super().__init__(standing)
        self.standing = standing


class Tally:
    """Amounts held at once, in all and by holder; thread-safe: taken on worker threads and
    given back on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = 0
        self._holds = 0
        self._by: dict[int, tuple[int, int]] = {}  # holder -> (held, holds)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._held

    def held_by(self, holder: int) -> int:
        with self._lock:
            return self._by.get(holder, (0, 0))[0]

    def take(self, holder: Holder, amount: int, bounds: Bounds) -> Reservation:
        """``amount`` for ``holder``, or :class:`Full`: its share first, then the total."""
        with self._lock:
            mine, my_holds = self._by.get(holder, (0, 0)) if holder is not None else (0, 0)
            share = holder is not None and mine + amount > bounds.each
            if share or self._held + amount > bounds.total:
                raise Full(Standing(share, bounds, self._held, self._holds, mine, my_holds))
            self._held += amount
            self._holds += 1
            if holder is not None:
                self._by[holder] = (mine + amount, my_holds + 1)
        return Reservation(lambda: self._give_back(holder, amount))

    def _give_back(self, holder: Holder, amount: int) -> None:
        with self._lock:
            self._held -= amount
            self._holds -= 1
            if holder is None:
                return
            mine, my_holds = self._by.pop(holder)
            if my_holds > 1:
                self._by[holder] = (mine - amount, my_holds - 1)


class Kind(NamedTuple):
    """One kind of request bounded by count, as its refusals name it."""

    noun: str  # "streamed execs and runs"
    key: str  # its bound's key in [shares]
    codes: tuple[str, str]  # a full share's, a full total's
    advice: str  # what to do besides waiting


# Each kind's refusal codes (model/codes.py): its share full, then the total full.
STREAM_CODES = ("stream_share_full", "streams_busy")
TRANSFER_CODES = ("transfer_share_full", "transfers_busy")
PULL_CODES = ("pull_share_full", "pulls_busy")
STREAMS = Kind(
    noun="streamed execs and runs",
    key="streams_in_flight",
    codes=STREAM_CODES,
    advice="end one of them (close its stream), or use exec without streaming",
)
TRANSFERS = Kind(
    noun="file transfers",
    key="transfers_in_flight",
    codes=TRANSFER_CODES,
    advice="let one of them finish first, or send several files as one tar",
)
PULLS = Kind(
    noun="image pulls",
    key="pulls_in_flight",
    codes=PULL_CODES,
    advice="let one of them finish first (or cancel its create)",
)


class Slots:
    """Requests of one kind in flight: a count, bound for all and per user by ``[shares]``
    of the config in force (a reload applies to the next request)."""

    def __init__(self, kind: Kind, config: Callable[[], SharesConfig]) -> None:
        self.kind = kind
        self._config = config
        self._tally = Tally()

    @property
    def in_use(self) -> int:
        return self._tally.in_use

    def bounds(self) -> Bounds:
        config = self._config()
        total: int = getattr(config, self.kind.key)
        return Bounds(total=total, each=config.share_of(total))

    def take(self, who: Identity | None) -> Reservation:
        """One slot for ``who``'s request, or its refusal (``ShareFull`` or ``Busy``); None:
        the agent's own, bound by the total only."""
        try:
            return self._tally.take(holder_of(who), 1, self.bounds())
        except Full as full:
            raise self._refusal(who, full.standing) from None

    def _refusal(self, who: Identity | None, standing: Standing) -> ShareFull | Busy:
        kind, bounds = self.kind, standing.bounds
        if standing.share and who is not None:
            return ShareFull(
                f"uid {who.uid} ({who.user_name}) has {standing.mine} {kind.noun} in flight, its "
                f"whole share ({bounds.each} of the agent's {kind.key} {bounds.total}, "
                f"[shares] user_share); {kind.advice}, or retry after a second",
                code=kind.codes[0],
            )
        return Busy(
            f"the agent is busy: {standing.held} {kind.noun} are in flight, all its "
            f"{kind.key} ({bounds.total}); retry after a second",
            code=kind.codes[1],
        )
