"""Long work shown as it goes, on stderr: an image's pull, a clone, a start, a copy.

On a terminal a bar (tqdm, Debian's ``python3-tqdm``: the package depends on it); otherwise
one plain line per update, at most one a second per phase and always at its end, so a log or
a CI job reads how the work went without carriage returns. ``--json`` and ``-q`` show nothing:
stdout stays the answer alone, stderr stays empty.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TextIO

from slicebox.model.limits import human_bytes
from slicebox.model.progress import Phase, ProgressEvent

LINE_EVERY = 1.0  # seconds between two plain lines of one phase


class Shown(Protocol):
    def event(self, event: ProgressEvent) -> None: ...

    def close(self) -> None: ...


class Silent:
    """``--json``/``-q``: nothing."""

    def event(self, event: ProgressEvent) -> None:
        pass

    def close(self) -> None:
        pass


class Lines:
    """Plain lines (stderr is not a terminal)."""

    def __init__(self, out: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._clock = clock
        self._last: dict[Phase, tuple[float, str]] = {}

    def event(self, event: ProgressEvent) -> None:
        if event.phase is Phase.STARTING and not self._last:
            return  # a start after nothing long: nothing to tell
        line = event.describe()
        when, said = self._last.get(event.phase, (float("-inf"), ""))
        finished = event.total is not None and event.done == event.total
        if line == said or (not finished and self._clock() - when < LINE_EVERY and said):
            return
        self._last[event.phase] = (self._clock(), line)
        print(line, file=self._out, flush=True)

    def close(self) -> None:
        pass


class Bars:
    """A tqdm bar per phase on a terminal; a phase's bar closes when the next phase starts."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._phase: Phase | None = None
        self._bar: Any = None

    def event(self, event: ProgressEvent) -> None:
        if event.phase is Phase.STARTING and self._phase is None:
            return  # a start after nothing long: no bar
        if event.phase is not self._phase:
            self.close()
            self._phase = event.phase
            if event.phase is Phase.STARTING:  # nothing to count: its line, no bar
                print(event.describe(), file=self._out, flush=True)
                return
            self._bar = self._new(event)
        if self._bar is None:
            return
        bar = self._bar
        if event.total is not None and bar.total != event.total:
            bar.total = event.total
        bar.n = event.done or 0
        bar.set_description_str(_label(event), refresh=False)
        bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _new(self, event: ProgressEvent) -> Any:
        from tqdm import tqdm  # only a terminal's command pays for it

        pulling = event.phase is Phase.PULLING
        return tqdm(
            desc=_label(event),
            total=event.total,
            file=self._out,
            unit="B" if pulling else "",
            unit_scale=pulling,
            unit_divisor=1024,
            leave=True,
            dynamic_ncols=True,
        )


def shown(*, quiet: bool, out: TextIO | None = None) -> Shown:
    """What a command shows its progress with: nothing when ``quiet``, a bar on a terminal,
    else plain lines."""
    out = out or sys.stderr
    if quiet:
        return Silent()
    return Bars(out) if out.isatty() else Lines(out)


@contextlib.contextmanager
def showing(*, quiet: bool) -> Iterator[Shown]:
    """``shown`` on stderr, closed (a bar's last state left on its line) at the end."""
    view = shown(quiet=quiet)
    try:
        yield view
    finally:
        view.close()


def _label(event: ProgressEvent) -> str:
    if event.phase is Phase.CLONING:
        return f"cloning: {event.step}"
    return f"{event.phase.value} {event.subject}"


class Bytes:
    """A copy's bytes as they move: a bar (no total: a tar's size is known only at its end)
    on a terminal, plain lines otherwise, nothing when quiet; a copy done within a second
    (a small tree) shows nothing either."""

    def __init__(
        self,
        what: str,
        *,
        quiet: bool,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.moved = 0
        self._what = what
        self._out = out or sys.stderr
        self._quiet = quiet
        self._clock = clock
        self._bar: Any = None
        self._last = clock()
        self._said = False

    def counted(self, pieces: Iterable[bytes]) -> Iterator[bytes]:
        if not self._quiet and self._out.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                desc=self._what,
                file=self._out,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                delay=LINE_EVERY,
            )
        for piece in pieces:
            self.moved += len(piece)
            self._show(len(piece))
            yield piece

    def done(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._said:
            print(f"{self._what}: {human_bytes(self.moved)}, done", file=self._out, flush=True)

    def _show(self, size: int) -> None:
        if self._bar is not None:
            self._bar.update(size)
        elif not self._quiet and self._clock() - self._last >= LINE_EVERY:
            self._last, self._said = self._clock(), True
            print(f"{self._what}: {human_bytes(self.moved)}", file=self._out, flush=True)
