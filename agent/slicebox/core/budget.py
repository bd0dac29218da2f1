"""One budget for the exec output the agent holds in memory, shared by every caller.

An exec keeps the head of its stdout and of its stderr, up to its ``output_cap`` each
(:class:`~slicebox.core.execution.OutputCapture`), until it is answered. A streaming exec keeps
them too: its final result carries both heads again. Caps are chosen per call (up to 16 MiB a
stream), so without a bound enough concurrent execs take the agent past its ``MemoryMax``, and
the kernel kills it with every caller's exec in flight.

So an exec reserves what it may hold before it starts and gives it back when it ends, however
it ends: finished, failed, timed out or abandoned by its caller. What it may hold is more than
its two heads: answering copies them into the result, then into base64 JSON (4/3 the size),
once as text and once as bytes; encoding a blocking answer or a stream's final line peaks at
4.7 times the kept bytes. An exec reserves ``2 * output_cap * HELD_PER_KEPT_BYTE`` (6), which
leaves room for the copy the transport keeps of what the socket did not take at once; a unit
test measures both answer paths against it. The HTTP layer holds the reservation until the
answer is sent, so a caller that reads slowly keeps its share reserved rather than leaving an
unaccounted copy behind. While a stream runs, each chunk kept is handed to the socket before
the next output is read, and the writer waits whenever the transport holds more than its
high-water mark: what waits there are copies of chunks already kept, at most as much again as
is kept, and little of it is left when the result is encoded: the final line is the peak. One
read buffer per exec (64 KiB) is not counted.

Each user (a caller's uid; root and ``slicebox-admin`` excepted) holds at most its share of the
budget, ``[shares] user_share`` of it (:mod:`slicebox.core.shares`), checked before the budget:
a user over its share is refused with ``output_share_full`` (429), whoever else holds what.
Over budget an exec is refused at once with ``busy`` (503), never queued: a queued exec would
hold its caller's connection for as long as others run. Both answer ``Retry-After``. An exec
that could not fit even in an idle agent (for a user: in its idle share) is refused with
``output_cap_over_budget`` (400): retrying cannot help.
"""

from __future__ import annotations

from collections.abc import Callable

from slicebox.core.shares import Bounds, Full, Holder, Reservation, Standing, Tally
from slicebox.model.errors import Busy, InvalidRequest, ShareFull
from slicebox.model.limits import human_bytes

STREAMS = 2  # stdout and stderr, each kept up to the cap
HELD_PER_KEPT_BYTE = 6


def exec_reservation(output_cap: int) -> int:
    """The bytes an exec with this ``output_cap`` may hold at its peak."""
    return STREAMS * output_cap * HELD_PER_KEPT_BYTE


class OutputBudget:
    """The agent's exec output budget; thread-safe: reservations are taken on worker threads
    and given back on the event loop.

    ``limit`` and ``share`` (one user's fraction of it; 1: no share) are read at each
    reservation, so a reload that changes them takes effect for the next exec; execs already
    running keep what they reserved.
    """

    def __init__(self, limit: Callable[[], int], share: Callable[[], float] = lambda: 1.0) -> None:
        self._limit = limit
        self._share = share
        self._tally = Tally()

    @classmethod
    def fixed(cls, nbytes: int, share: float = 1.0) -> OutputBudget:
        return cls(lambda: nbytes, lambda: share)

    @property
    def in_use(self) -> int:
        return self._tally.in_use

    def held_by(self, holder: int) -> int:
        """What the execs of ``holder`` (a uid) hold now."""
        return self._tally.held_by(holder)

    def reserve(self, output_cap: int, holder: Holder = None) -> Reservation:
        """Take what an exec with ``output_cap`` may hold for ``holder`` (a uid; None: the
        budget alone binds), or refuse it now: its share full, or the budget (busy)."""
        limit = self._limit()
        bounds = Bounds(total=limit, each=int(limit * self._share()))
        nbytes, most = exec_reservation(output_cap), limit
        if holder is not None and bounds.each < limit:
            most = bounds.each
        if nbytes > most:
            raise _never_fits(output_cap, nbytes, most, limit)
        try:
            return self._tally.take(holder, nbytes, bounds)
        except Full as full:
            raise _refusal(full.standing, holder, nbytes) from None


def _refusal(standing: Standing, holder: Holder, nbytes: int) -> ShareFull | Busy:
    limit = standing.bounds.total
    if standing.share:
        return ShareFull(
            f"your execs in flight ({standing.my_holds}) hold {human_bytes(standing.mine)} of "
            f"your {human_bytes(standing.bounds.each)} share (uid {holder}) of "
            f"the agent's {human_bytes(limit)} exec output budget and this exec needs "
            f"{human_bytes(nbytes)}; wait for one of them to end, ask for a smaller "
            "output_cap, or retry after a second",
            code="output_share_full",
        )
    return Busy(
        f"the agent is busy: execs in flight ({standing.holds}) hold "
        f"{human_bytes(standing.held)} of its {human_bytes(limit)} exec output budget and this "
        f"exec needs {human_bytes(nbytes)}; retry later, or ask for a smaller output_cap"
    )


def _never_fits(output_cap: int, nbytes: int, most: int, limit: int) -> InvalidRequest:
    largest = most // (STREAMS * HELD_PER_KEPT_BYTE)
    whole = (
        f"the agent's whole exec output budget ({human_bytes(limit)})"
        if most == limit
        else f"one user's share ({human_bytes(most)}) of the agent's {human_bytes(limit)} exec "
        "output budget"
    )
    return InvalidRequest(
        f"output_cap {human_bytes(output_cap)} needs {human_bytes(nbytes)} of memory "
        f"(two streams, kept and encoded), more than {whole}; ask for output_cap at most "
        f"{largest} bytes",
        code="output_cap_over_budget",
        field="output_cap",
    )
