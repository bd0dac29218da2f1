"""git's progress counts, read off its stderr as a clone writes them, reported as progress.

git writes ``Receiving objects:  45% (450/1000), 1.20 MiB | 2.00 MiB/s`` and rewrites it in
place with a carriage return; each step (counting, compressing, receiving, resolving deltas)
ends with a newline. Only the steps' names and counts are taken, never the rest of the line
(git may name the remote, with whatever a URL held).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from slicebox.core.progress import report
from slicebox.model.progress import Phase, ProgressEvent

_COUNT = re.compile(
    rb"(Enumerating|Counting|Compressing|Receiving|Resolving|Updating)"
    rb" (objects|deltas|files):\s+\d+% \((\d+)/(\d+)\)"
)
REPORT_EVERY = 0.25  # seconds between two reports of one step
_KEPT = 256  # bytes of a line cut between two chunks


class GitCounts:
    """The counts of one clone's stderr, reported (at most every ``REPORT_EVERY`` s a step)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._url = url
        self._clock = clock
        self._tail = b""
        self._last: tuple[bytes, float] = (b"", float("-inf"))

    def feed(self, data: bytes) -> None:
        text = self._tail + data
        cut = max(text.rfind(b"\r"), text.rfind(b"\n"))
        whole, self._tail = text[: cut + 1], text[cut + 1 :][-_KEPT:]
        found = list(_COUNT.finditer(whole))
        if found:
            self._report(found[-1])

    def _report(self, match: re.Match[bytes]) -> None:
        step = match.group(1) + b" " + match.group(2)
        done, total = int(match.group(3)), int(match.group(4))
        now = self._clock()
        if step == self._last[0] and done != total and now - self._last[1] < REPORT_EVERY:
            return
        self._last = (step, now)
        event = ProgressEvent(
            phase=Phase.CLONING,
            subject=self._url,
            step=step.decode(),
            done=done,
            total=total,
        )
        report(event)
