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

Over budget an exec is refused at once with ``busy`` (503), never queued: a queued exec would
hold its caller's connection for as long as others run. An exec that could not fit
even in an idle agent is refused with ``output_cap_over_budget`` (400): retrying cannot help.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from slicebox.model.errors import InvalidRequest, Unavailable
from slicebox.model.limits import human_bytes

STREAMS = 2  # stdout and stderr, each kept up to the cap
HELD_PER_KEPT_BYTE = 6


def exec_reservation(output_cap: int) -> int:
    """The bytes an exec with this ``output_cap`` may hold at its peak."""
    return STREAMS * output_cap * HELD_PER_KEPT_BYTE


class Reservation:
    """Bytes taken from a budget until :meth:`release` (or the end of a ``with`` block)."""

    def __init__(self, budget: OutputBudget, nbytes: int) -> None:
        self.nbytes = nbytes
        self._budget: OutputBudget | None = budget

    def release(self) -> None:
        """Give the bytes back; releasing twice gives them back once."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.nbytes)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class OutputBudget:
    """The agent's exec output budget; thread-safe: reservations are taken on worker threads
    and given back on the event loop.

    ``limit`` is read at each reservation, so a reload that changes it takes effect for the
    next exec; execs already running keep what they reserved.
    """

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._in_use = 0
        self._holders = 0

    @classmethod
    def fixed(cls, nbytes: int) -> OutputBudget:
        return cls(lambda: nbytes)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._in_use

    def reserve(self, output_cap: int) -> Reservation:
        """Take what an exec with ``output_cap`` may hold, or refuse it now (busy)."""
        nbytes, limit = exec_reservation(output_cap), self._limit()
        if nbytes > limit:
            raise _never_fits(output_cap, nbytes, limit)
        with self._lock:
            if self._in_use + nbytes > limit:
                raise _busy(nbytes, self._in_use, self._holders, limit)
            self._in_use += nbytes
            self._holders += 1
        return Reservation(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self._in_use -= nbytes
            self._holders -= 1


def _busy(nbytes: int, in_use: int, holders: int, limit: int) -> Unavailable:
    return Unavailable(
        f"the agent is busy: execs in flight ({holders}) hold {human_bytes(in_use)} of its "
        f"{human_bytes(limit)} exec output budget and this exec needs {human_bytes(nbytes)}; "
        "retry later, or ask for a smaller output_cap",
        code="busy",
    )


def _never_fits(output_cap: int, nbytes: int, limit: int) -> InvalidRequest:
    largest = limit // (STREAMS * HELD_PER_KEPT_BYTE)
    return InvalidRequest(
        f"output_cap {human_bytes(output_cap)} needs {human_bytes(nbytes)} of memory "
        f"(two streams, kept and encoded), more than the agent's whole exec output budget "
        f"({human_bytes(limit)}); ask for output_cap at most {largest} bytes",
        code="output_cap_over_budget",
        field="output_cap",
    )
