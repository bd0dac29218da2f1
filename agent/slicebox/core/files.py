"""Files in and out of a sandbox: a tar stream or one file's bytes, through an exec inside it.

Why an exec and not Docker's archive API: every sandbox's ``/workspace`` is a tmpfs (see
:mod:`slicebox.backends.dockerbody`), and ``PUT/GET /containers/{id}/archive`` works on the
container's root filesystem layer, beneath its mounts: a file put there would never appear in
the tmpfs. ``tar`` or ``cat`` run inside the sandbox see what its programs see, whatever is
mounted where. They run as the sandbox's own user, in its own mount namespace, so the path is
confined to the container and the files belong to who the sandbox runs as, both by the kernel,
with no path checks of ours to get wrong. The path reaches the sandbox's ``sh`` as an argument,
never inside a command string.

Nothing is buffered whole. An upload's body is the exec's stdin, read one chunk at a time as
the socket to Docker takes it (:class:`~slicebox.backends.base.StdinSource`); a download's
stdout is written to the caller as it comes, the next read waiting for the caller's socket
(:class:`Relay`). What the agent holds of a transfer is a chunk and stderr's first few KiB.

The cap (``files_max_bytes``) counts the upload's body or the download's stream; at the cap the
transfer stops, the exec's processes are killed and the answer is ``file_too_large`` (a
download whose head was sent already is cut off instead: its caller sees a short stream).

Transfers in flight are bound for all callers and per user (``[shares] transfers_in_flight``,
:mod:`slicebox.core.shares`): over either, a transfer is refused before it starts
(``transfer_share_full`` 429, ``transfers_busy`` 503).

Each transfer is audited once (``file_transfer``: direction, format, path, bytes, duration and
how it ended; never contents), a refused one as ``request_refused``, like an exec.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from enum import StrEnum

from slicebox.backends.base import StdinSource
from slicebox.core.blocking import Blocking, settle
from slicebox.core.execaudit import DETAIL_MAX, refused, subject
from slicebox.core.execoutput import OutputCapture
from slicebox.core.execution import ExecEngine, result_of
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.shares import TRANSFERS, Slots
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.audit import AuditEvent, AuditRecord
from slicebox.model.errors import InvalidRequest, NotFound, SliceboxError, TooLarge
from slicebox.model.exec import ExecRequest, ExecResult, OutputStream, StreamChunk
from slicebox.model.files import FileFormat, FileKind, FilesQuery, FileStat, Transferred
from slicebox.model.limits import human_bytes

# A transfer is no command with a deadline of its own; an hour bounds one whose caller stalls.
TRANSFER_TIMEOUT = 3600.0
STDERR_KEPT = 4096  # what an error message quotes of tar's complaint
PATH_IN_DETAIL = 300

# Exit codes of the scripts below, chosen apart from tar's and cat's own (1, 2).
NO_SUCH_PATH = 71
NO_TAR = 72
WRONG_KIND = 73
NO_PROGRAM = 127  # what the engine answers when Docker finds no `sh` in the image

_NEED_TAR = "command -v tar >/dev/null || exit 72; "
_UNTAR = _NEED_TAR + '[ -d "$1" ] || mkdir -p "$1" || exit 73; exec tar -x -o -f - -C "$1"'
_WRITE = '[ -d "${1%/*}/" ] || exit 71; [ ! -d "$1" ] || exit 73; exec cat > "$1"'
_TAR = '[ -e "$1" ] || [ -L "$1" ] || exit 71; ' + _NEED_TAR + 'exec tar -c -f - -C "$2" "$3"'
_CAT = '[ -e "$1" ] || exit 71; [ -f "$1" ] || exit 73; exec cat "$1"'
_STAT = (
    'if [ -d "$1" ]; then echo directory; elif [ -f "$1" ]; then echo file; '
    'elif [ -e "$1" ] || [ -L "$1" ]; then echo other; else exit 71; fi'
)


class Direction(StrEnum):
    UPLOAD = "upload"
    DOWNLOAD = "download"


def upload_argv(query: FilesQuery) -> tuple[str, ...]:
    """tar: extract into the directory ``path`` (made when missing); file: write ``path``."""
    script = _UNTAR if query.format is FileFormat.TAR else _WRITE
    return ("sh", "-c", script, "sh", query.path)


def download_argv(query: FilesQuery) -> tuple[str, ...]:
    """tar: ``path`` (its last component and what is below it); file: its bytes."""
    if query.format is FileFormat.TAR:
        return ("sh", "-c", _TAR, "sh", query.path, query.parent, query.name)
    return ("sh", "-c", _CAT, "sh", query.path)


def stat_argv(query: FilesQuery) -> tuple[str, ...]:
    return ("sh", "-c", _STAT, "sh", query.path)


def _request(argv: tuple[str, ...], output_cap: int = STDERR_KEPT) -> ExecRequest:
    return ExecRequest(argv=argv, cwd="/", timeout=TRANSFER_TIMEOUT, output_cap=output_cap)


def too_large(cap: int) -> TooLarge:
    return TooLarge(
        f"the transfer is larger than this agent's files_max_bytes ({human_bytes(cap)}) and "
        "was stopped there; send less at a time (an upload leaves what it had written), or "
        "ask an operator to raise files_max_bytes"
    )


class CappedSource:
    """An upload's body as the exec's stdin, counted, and stopped at the cap."""

    def __init__(self, body: StdinSource, cap: int) -> None:
        self._body = body
        self._cap = cap
        self.received = 0

    async def read(self) -> bytes:
        chunk = await self._body.read()
        self.received += len(chunk)
        if self.received > self._cap:
            raise too_large(self._cap)
        return chunk


class Relay:
    """A download's output (a :class:`~slicebox.core.execution.Capture`): stdout is streamed
    whole up to the cap, kept nowhere; only stderr's head is kept, for the error message.
    Past the cap, what is streamed stops exactly at it and ``over`` says so: a caller that got
    ``files_max_bytes`` bytes of a stream cut off knows why."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._stderr = OutputCapture(STDERR_KEPT)
        self.relayed = 0
        self.over = False

    def add(self, chunk: StreamChunk) -> StreamChunk | None:
        if chunk.stream is OutputStream.STDERR:
            self._stderr.add(chunk)
            return None
        if self.over:
            raise too_large(self.cap)
        head = chunk.data[: self.cap - self.relayed]
        self.relayed += len(head)
        self.over = len(head) < len(chunk.data)
        return StreamChunk(stream=chunk.stream, data=head) if head else None

    def result(
        self, *, exit_code: int, timed_out: bool, oom_killed: bool, duration: float
    ) -> ExecResult:
        return self._stderr.result(
            exit_code=exit_code, timed_out=timed_out, oom_killed=oom_killed, duration=duration
        )


def check(result: ExecResult, query: FilesQuery, direction: Direction | None) -> None:
    """Nothing when the transfer's exec succeeded; else the error its exit code stands for."""
    if result.exit_code == 0:
        return
    said = result.stderr.decode(errors="replace").strip()[-STDERR_KEPT // 4 :]
    if result.exit_code == NO_SUCH_PATH:
        raise _not_found(query, direction)
    if result.exit_code == NO_TAR or (
        result.exit_code == NO_PROGRAM and "executable file not found" in said
    ):
        raise InvalidRequest(
            "the sandbox's image has no `sh`, or no `tar`, which file transfers run inside "
            "it; use an image with both (busybox, alpine, debian), or format=file when only "
            "tar is missing",
            code="file_tools_missing",
        )
    if result.exit_code == WRONG_KIND:
        raise InvalidRequest(_wrong_kind(query, direction, said), code="file_wrong_kind")
    took = f"did not finish within {TRANSFER_TIMEOUT:.0f}s" if result.timed_out else "failed"
    raise InvalidRequest(
        f"the {direction or 'stat'} of {query.path} {took} in the sandbox (exit code "
        f"{result.exit_code}): {said or 'no message'}; fix what it says and send again",
        code="file_transfer_failed",
    )


def _not_found(query: FilesQuery, direction: Direction | None) -> NotFound:
    if direction is Direction.UPLOAD:
        return NotFound(
            f"the directory of {query.path} does not exist in the sandbox; create it first, or "
            "send a tar (format=tar), whose destination is created",
            code="file_not_found",
        )
    return NotFound(f"no {query.path} in the sandbox; check the path", code="file_not_found")


def _wrong_kind(query: FilesQuery, direction: Direction | None, said: str) -> str:
    if direction is Direction.DOWNLOAD:
        return f"{query.path} is not a regular file; fetch it as a tar (format=tar)"
    if query.format is FileFormat.FILE:
        return f"{query.path} is a directory; name the file to write, or send a tar"
    return (
        f"{query.path} is not a directory and could not be made one ({said or 'no message'}); "
        "name a directory to extract the tar into"
    )


class TransferTally:
    """What the service saw of one transfer, enough to write its one record."""

    def __init__(self, sandbox_id: str, direction: Direction, query: FilesQuery) -> None:
        self.subject: dict[str, object] = {"sandbox_id": sandbox_id}
        self.started: float | None = None
        self.moved = 0
        self._what = f"{direction} {query.format} {query.path[:PATH_IN_DETAIL]}"

    def found(self, sandbox: Sandbox) -> Sandbox:
        self.subject = subject(sandbox)
        self.started = time.monotonic()
        return sandbox

    def ending(self, who: Identity, error: BaseException | None) -> AuditRecord | None:
        """The record by how the transfer ended; None for an interpreter exit."""
        if isinstance(error, SliceboxError) and self.started is None:
            return refused(who, "files", error, str(self.subject["sandbox_id"]))
        if error is None:
            return self._record(who, "ok")
        if isinstance(error, GeneratorExit | asyncio.CancelledError | ConnectionError):
            return self._record(who, "abandoned")  # the caller went away mid-transfer
        if isinstance(error, SliceboxError):
            return self._record(who, error.code)
        return self._record(who, "internal") if isinstance(error, Exception) else None

    def _record(self, who: Identity, result: str) -> AuditRecord:
        took = time.monotonic() - (self.started or time.monotonic())
        detail = f"{self._what}: {self.moved} bytes, {took:.3f}s"
        return AuditRecord.model_validate(
            {
                "event": AuditEvent.FILE_TRANSFER,
                "caller": who.caller,
                **self.subject,
                "result": result,
                "detail": detail[:DETAIL_MAX],
            }
        )


class Files:
    """Transfers for :class:`~slicebox.core.service.Service`: the same look-up (a caller reaches
    only its own sandboxes), the same operation mark (the reaper leaves the sandbox alone
    meanwhile) and the same engine as an exec, on the event loop."""

    def __init__(
        self,
        engine: ExecEngine,
        auditor: Auditor,
        sandboxes: SandboxManager,
        looked_up: Callable[[Identity, str, Blocking], Awaitable[Sandbox]],
    ) -> None:
        """``looked_up``: the sandbox if the caller may see it, looked up on the event loop
        (an exec's look-up: a pool member's lease is read through the ``Blocking``)."""
        self._engine = engine
        self._auditor = auditor
        self._sandboxes = sandboxes
        self._looked_up = looked_up
        # What a pause's and a snapshot's checks share with a transfer (core/snapshots.py).
        self.auditor, self.sandboxes, self.looked_up = auditor, sandboxes, looked_up
        # Transfers in flight, bound for all and per user (core/shares.py).
        self.slots = Slots(TRANSFERS, lambda: sandboxes.config.shares)

    def cap(self) -> int:
        """``files_max_bytes`` as the config in force (reloads included) says."""
        return self._sandboxes.config.files_max_bytes_value()

    async def upload(
        self,
        who: Identity,
        sandbox_id: str,
        query: FilesQuery,
        *,
        body: StdinSource,
        blocking: Blocking,
        length: int | None = None,
    ) -> Transferred:
        """``body`` into the sandbox; ``length``: what the caller said it sends (its
        Content-Length), refused at once when over the cap."""
        source = CappedSource(body, self.cap())
        request = _request(upload_argv(query))
        async with self._transfer(who, sandbox_id, Direction.UPLOAD, query, blocking) as run:
            tally, sandbox = run
            if length is not None and length > self.cap():
                raise too_large(self.cap())
            events = self._engine.stream(
                sandbox.container_id, request, blocking, sandbox.running_scope(), stdin=source
            )
            try:
                result = await result_of(events)
            finally:
                tally.moved = source.received
            check(result, query, Direction.UPLOAD)
        return Transferred(path=query.path, format=query.format, bytes=source.received)

    def download(
        self, who: Identity, sandbox_id: str, query: FilesQuery, blocking: Blocking
    ) -> AsyncGenerator[bytes, None]:
        """The bytes as the sandbox's tar or cat writes them. Closing it early kills them."""
        return self._download(who, sandbox_id, query, blocking)

    async def _download(
        self, who: Identity, sandbox_id: str, query: FilesQuery, blocking: Blocking
    ) -> AsyncGenerator[bytes, None]:
        relay = Relay(self.cap())
        request = _request(download_argv(query))
        async with self._transfer(who, sandbox_id, Direction.DOWNLOAD, query, blocking) as run:
            tally, sandbox = run
            events = self._engine.stream(
                sandbox.container_id, request, blocking, sandbox.running_scope(), capture=relay
            )
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, ExecResult):
                        check(event, query, Direction.DOWNLOAD)
                    else:
                        tally.moved += len(event.data)
                        yield event.data
                    if relay.over:  # closing the stream kills the exec
                        raise too_large(relay.cap)

    async def stat(
        self, who: Identity, sandbox_id: str, query: FilesQuery, blocking: Blocking
    ) -> FileStat:
        """What is at ``path``: a look like ``get``, not audited."""
        sandbox = await self._looked_up(who, sandbox_id, blocking)
        with self._sandboxes.operation(sandbox.id):
            events = self._engine.stream(
                sandbox.container_id,
                _request(stat_argv(query)),
                blocking,
                sandbox.running_scope(),
            )
            result = await result_of(events)
        check(result, query, None)
        said = result.stdout.decode(errors="replace").strip()
        kind = FileKind(said) if said in set(FileKind) else FileKind.OTHER
        return FileStat(path=query.path, kind=kind)

    @contextlib.asynccontextmanager
    async def _transfer(
        self,
        who: Identity,
        sandbox_id: str,
        direction: Direction,
        query: FilesQuery,
        blocking: Blocking,
    ) -> AsyncIterator[tuple[TransferTally, Sandbox]]:
        """The sandbox, looked up and marked busy for the block, which holds one of the
        transfers in flight (the caller's share first); the one audit record after."""
        tally = TransferTally(sandbox_id, direction, query)
        try:
            with self.slots.take(who):
                found = await self._looked_up(who, sandbox_id, blocking)
                sandbox = tally.found(found)
                with self._sandboxes.operation(sandbox.id):
                    yield tally, sandbox
        except BaseException as exc:
            if (record := tally.ending(who, exc)) is not None:
                await settle(blocking, functools.partial(self._auditor.record, record))
            raise
        record = tally.ending(who, None)
        assert record is not None
        await settle(blocking, functools.partial(self._auditor.record, record))
