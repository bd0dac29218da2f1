"""An exec run by a native sandbox's init, on the event loop: its output pipes and its
connection to the init, on which the init reports how the command ended.

The exec ends when its command (the process the init forked for it) has exited and its output
has ended. A process the command left running in the background may hold stdout and stderr
open for as long as it runs; as ``docker exec`` does, the exec waits for that at most
``STREAM_GRACE`` (2 s, Docker's own wait for an exec's streams after its process exits: in
the guest ``docker exec c sh -c 'sleep 30 &'`` answers 2 s after ``docker exec c true``) and
ends with what was written by then. Then, where Docker closes the pipes (and the background
process dies of SIGPIPE at its next write), the pipes are handed to the init, which reads and
drops what the background process still writes: a server left running keeps writing its log.
"""

from __future__ import annotations

import asyncio
import socket

from slicebox.backends.native.initwire import MAX_REPORT, Report, hand_back, lost, report_of
from slicebox.backends.native.pipes import AsyncPipes

STREAM_GRACE = 2.0


class InitExec(AsyncPipes):
    """:class:`AsyncPipes` that end with the command: ``report`` once the init has said how
    it ended (None while it runs)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        out_fd: int,
        err_fd: int,
        conn: socket.socket,
        grace: float = STREAM_GRACE,
    ) -> None:
        super().__init__(loop, out_fd, err_fd)
        self.report: Report | None = None
        self._conn = conn
        self._grace = grace
        self._said = b""
        self._listening = True
        self._closed = False
        conn.setblocking(False)
        loop.add_reader(conn.fileno(), self._heard)

    def _heard(self) -> None:
        try:
            data = self._conn.recv(MAX_REPORT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self._said += data
        if data and b"\n" not in self._said and len(self._said) < MAX_REPORT:
            return
        line = self._said.split(b"\n", 1)[0]
        self._stop_listening()
        self.report = report_of(line) if line else lost()
        self.finish(self._grace, self._hand_back)
        if self._closed:
            self.hang_up()

    def _hand_back(self, fds: list[int]) -> None:
        hand_back(self._conn, fds)

    def _stop_listening(self) -> None:
        if self._listening:
            self._listening = False
            self._loop.remove_reader(self._conn.fileno())

    def close(self) -> None:
        """The output is done with; the connection stays until the report has come (the
        engine asks for the exit code after it closes the output), or the exec's end."""
        super().close()
        self._closed = True
        if self.report is not None:
            self.hang_up()

    def hang_up(self) -> None:
        """Done with the exec (its end, or its kill): the init hears the connection close."""
        self._stop_listening()
        self._conn.close()

    def hang_up_soon(self) -> None:
        """``hang_up`` from any thread: on the loop, where the connection is watched."""
        try:
            self._loop.call_soon_threadsafe(self.hang_up)
        except RuntimeError:  # the loop is closed: nothing watches the connection any more
            self._conn.close()
