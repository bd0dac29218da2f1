"""An exec's stdio on the event loop: its output pipes read, its stdin fed or read whole.

A native exec's process is handed the far ends of fresh pipes; :class:`AsyncPipes` is the
attachment on the near ends, each watched by the loop, so no thread waits while the command
runs. Its output ends at the pipes' end, or, once told the command has exited (``finish``),
a grace later: what the command left running may hold the pipes open for as long as it runs,
and is handed them then. A wasm call takes its input whole instead (:func:`read_whole`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from slicebox.backends.base import StdinSource
from slicebox.model.errors import InvalidRequest
from slicebox.model.exec import OutputStream, StreamChunk

READ_SIZE = 65536
LAST_READS = 16  # at the hand-over, what each pipe holds is read, up to this many reads


async def read_whole(source: StdinSource, cap: int) -> bytes:
    """A streamed stdin read whole (a plugin takes its input whole), at most ``cap`` bytes."""
    chunks, size = [], 0
    while chunk := await source.read():
        size += len(chunk)
        if size > cap:
            raise InvalidRequest(
                f"a wasm call's input is at most {cap // 2**20} MiB", code="wasm_invalid"
            )
        chunks.append(chunk)
    return b"".join(chunks)


class AsyncPipes:
    """An exec's output pipes read on the event loop (``AsyncExecAttachment``): each read end
    is watched by the loop, so no thread waits while the command runs."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out_fd: int, err_fd: int) -> None:
        self._loop = loop
        self._open = {out_fd: OutputStream.STDOUT, err_fd: OutputStream.STDERR}
        self._chunks: list[StreamChunk] = []
        self._ready = asyncio.Event()
        self._error: BaseException | None = None
        self._feeder: asyncio.Task[None] | None = None
        self._ends_at: float | None = None  # the loop's time the output ends (``finish``)
        self._hand_over: Callable[[list[int]], None] = lambda fds: None
        for fd in self._open:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, fd)

    def _readable(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        if data:
            self._chunks.append(StreamChunk(stream=self._open[fd], data=data))
        else:
            self._drop(fd)
        self._ready.set()

    def _drop(self, fd: int) -> None:
        self._loop.remove_reader(fd)
        os.close(fd)
        del self._open[fd]

    def finish(self, grace: float, hand_over: Callable[[list[int]], None]) -> None:
        """The command has exited: its output ends at the pipes' end, or ``grace`` seconds
        from now, when the pipes still open (held by what it left running) are read of what
        they hold and given to ``hand_over`` (then closed here)."""
        self._ends_at = self._loop.time() + grace
        self._hand_over = hand_over
        self._ready.set()

    async def read(self, timeout: float) -> list[StreamChunk] | None:
        if not self._chunks and self._open and self._error is None:
            if self._ends_at is not None:
                timeout = min(timeout, max(0.0, self._ends_at - self._loop.time()))
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        ending = self._ends_at is not None and self._loop.time() >= self._ends_at
        if not self._chunks and self._open and ending:
            self._give_up()
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            return chunks
        return [] if self._open else None

    def _give_up(self) -> None:
        """Read what the open pipes hold now, then hand them over."""
        fds = list(self._open)
        for fd in fds:
            for _ in range(LAST_READS):
                try:
                    data = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    break
                if not data:
                    break
                self._chunks.append(StreamChunk(stream=self._open[fd], data=data))
        self._hand_over(fds)
        for fd in fds:
            self._drop(fd)

    def feed(self, fd: int, stdin: bytes | StdinSource) -> None:
        self._feeder = self._loop.create_task(self._feed(fd, stdin))

    async def _feed(self, fd: int, stdin: bytes | StdinSource) -> None:
        os.set_blocking(fd, False)
        try:
            if isinstance(stdin, bytes):
                await self._write(fd, stdin)
                return
            while chunk := await stdin.read():
                await self._write(fd, chunk)
        except BrokenPipeError:
            return  # the command closed its stdin: what it did not read is not wanted
        except Exception as exc:  # the source failed: the next read says so
            self._error = exc
            self._ready.set()
        finally:
            os.close(fd)

    async def _write(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                writable = self._loop.create_future()
                self._loop.add_writer(fd, writable.set_result, None)
                try:
                    await writable
                finally:
                    self._loop.remove_writer(fd)

    def close(self) -> None:
        for fd in list(self._open):
            self._drop(fd)
        if self._feeder is not None and not self._feeder.done():
            self._feeder.cancel()
