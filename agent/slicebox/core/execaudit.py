"""One audit record per exec, whatever became of it.

An exec asked for is recorded exactly once, when it ends:

- refused before it ran (no such sandbox, or not the caller's; ``busy``; an output cap over the
  whole budget): ``request_refused`` with the code, and ``<action> refused: <message>`` as
  detail (``exec``, or ``run`` for a one-shot run refused before its sandbox was created);
- ran to its end: ``exec`` with result ``ok``, or ``timed_out`` when it was killed at its
  timeout, and its exit code;
- abandoned by its caller mid-stream (a closed connection), or cancelled while it ran on the
  event loop (the agent stopping): ``exec`` with result ``abandoned`` and the exit code if the
  result was already made (the exec's processes are killed);
- failed while running (the container went away, Docker failed): ``exec`` with the code.

Each is also counted once in ``slicebox_execs_total`` (:mod:`slicebox.core.instruments`) by its
owner and how it ended: ``refused``, ``ok``, ``timed_out``, ``oom_killed``, ``abandoned`` or
``failed``; a run or exec the output budget refused (``refused`` below) is counted ``refused``.

The detail counts output bytes (kept, or streamed before the caller went away, and dropped) and
the duration; never argv, environment or output, which may hold secrets.

Every other action (a create, a destroy, a deadline's change) is recorded once it has ended,
with its outcome (:func:`audited`); a create refused by policy or admission is
``request_refused``.

A request body that does not parse (bad JSON, an invalid field, too large) is answered with its
code at the HTTP edge and not audited: it named no command, and no sandbox was looked up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

from slicebox.core import instruments as counted
from slicebox.core.blocking import Blocking, settle
from slicebox.core.instruments import NOWHERE, Instruments
from slicebox.core.sandbox import Sandbox
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.audit import AuditEvent, AuditRecord
from slicebox.model.errors import AdmissionRefused, Forbidden, InvalidRequest, SliceboxError
from slicebox.model.exec import ExecEvent, ExecResult, OutputStream

# What a create refused before anything was made is: ``request_refused``, not a failed create.
REFUSALS = (InvalidRequest, AdmissionRefused, Forbidden)
OK = "ok"
TIMED_OUT = "timed_out"
ABANDONED = "abandoned"
INTERNAL = "internal"
DETAIL_MAX = 500


class ExecTally:
    """What the service saw of one exec, enough to write its record."""

    def __init__(self, sandbox_id: str) -> None:
        self.subject: dict[str, object] = {"sandbox_id": sandbox_id}
        self.started = False
        self.result: ExecResult | None = None
        self.streamed = dict.fromkeys(OutputStream, 0)

    def found(self, sandbox: Sandbox) -> Sandbox:
        """The sandbox is the caller's: from here on the exec runs (it is no longer refused)."""
        self.subject = subject(sandbox)
        self.started = True
        return sandbox

    def saw(self, event: ExecEvent) -> ExecEvent:
        if isinstance(event, ExecResult):
            self.result = event
        else:
            self.streamed[event.stream] += len(event.data)
        return event

    def ran(self, result: ExecResult) -> ExecResult:
        self.result = result
        return result

    def record(self, who: Identity, result: str, message: str = "") -> AuditRecord:
        fields = {"caller": who.caller, **self.subject, "result": result}
        if not self.started:
            detail = f"exec refused: {message}"
            return _record(AuditEvent.REQUEST_REFUSED, detail=detail, **fields)
        exit_code = self.result.exit_code if self.result else None
        return _record(AuditEvent.EXEC, exit_code=exit_code, detail=self.counters(), **fields)

    def outcome(self) -> str:
        return TIMED_OUT if self.result is not None and self.result.timed_out else OK

    def counted(self, who: Identity, error: BaseException | None, into: Instruments) -> None:
        """Count how it ended (``error`` as in ``ending``), under its sandbox's user (the
        caller's while no sandbox was found)."""
        if not self.started:
            result = counted.REFUSED
        elif error is None:
            timed_out = self.result is not None and self.result.timed_out
            oom = self.result is not None and self.result.oom_killed
            result = counted.TIMED_OUT if timed_out else counted.OOM_KILLED if oom else counted.OK
        elif isinstance(error, GeneratorExit | asyncio.CancelledError):
            result = counted.ABANDONED
        elif isinstance(error, Exception):
            result = counted.FAILED
        else:
            return
        into.exec_ended(str(self.subject.get("user") or who.user_name), result)

    def counters(self) -> str:
        result = self.result
        if result is None:
            out, err = self.streamed[OutputStream.STDOUT], self.streamed[OutputStream.STDERR]
            return f"streamed stdout={out} stderr={err} bytes"
        dropped = result.stdout_dropped_bytes + result.stderr_dropped_bytes
        oom = ", oom_killed" if result.oom_killed else ""
        return (
            f"kept stdout={len(result.stdout)} stderr={len(result.stderr)} bytes, "
            f"dropped={dropped} bytes, {result.duration:.3f}s{oom}"
        )

    def ending(self, who: Identity, error: BaseException | None) -> AuditRecord | None:
        """The record of the exec, by how its block ended (``error`` None: it ran to its end);
        None for an interpreter exit, which is no outcome of the exec."""
        if error is None:
            return self.record(who, self.outcome())
        if isinstance(error, GeneratorExit | asyncio.CancelledError):
            return self.record(who, ABANDONED)  # the stream was closed before its end
        if isinstance(error, SliceboxError):
            return self.record(who, error.code, error.message)
        if isinstance(error, Exception):
            return self.record(who, INTERNAL, "the agent failed")
        return None


@contextlib.asynccontextmanager
async def audited_exec(
    auditor: Auditor,
    who: Identity,
    sandbox_id: str,
    blocking: Blocking,
    instruments: Instruments = NOWHERE,
) -> AsyncIterator[ExecTally]:
    """Write the exec's one record when the block ends, however it ends (see above): through
    ``blocking`` (a journal write may block), and even when the writer is cancelled
    meanwhile; and count it in ``instruments``."""
    tally = ExecTally(sandbox_id)
    try:
        yield tally
    except BaseException as exc:
        tally.counted(who, exc, instruments)
        if (record := tally.ending(who, exc)) is not None:
            await settle(blocking, functools.partial(auditor.record, record))
        raise
    tally.counted(who, None, instruments)
    await settle(blocking, functools.partial(auditor.record, tally.record(who, tally.outcome())))


def refused(
    who: Identity,
    action: str,
    exc: SliceboxError,
    sandbox_id: str = "",
    instruments: Instruments = NOWHERE,
) -> AuditRecord:
    """The record of a request refused before any sandbox was looked up (the budget's); an
    exec or a run is counted ``refused`` in ``instruments``."""
    if action in ("exec", "run"):
        instruments.exec_ended(who.user_name, counted.REFUSED)
    return _record(
        AuditEvent.REQUEST_REFUSED,
        caller=who.caller,
        sandbox_id=sandbox_id,
        result=exc.code,
        detail=f"{action} refused: {exc.message}",
    )


def subject(sandbox: Sandbox) -> dict[str, object]:
    return {
        "sandbox_id": sandbox.id,
        "root_task_id": sandbox.lineage.root_task_id,
        "task_id": sandbox.lineage.task_id,
        "user": sandbox.user,
        "project": sandbox.project,
    }


def _record(event: AuditEvent, *, detail: str, **fields: object) -> AuditRecord:
    return AuditRecord.model_validate({"event": event, **fields, "detail": detail[:DETAIL_MAX]})


@contextlib.asynccontextmanager
async def audited(
    auditor: Auditor, event: AuditEvent, who: Identity, blocking: Blocking, **fields: object
) -> AsyncIterator[dict[str, object]]:
    """The block's audit record, written (through ``blocking``: a journal write) once it has
    ended, with its outcome: the block fills in its fields."""
    record: dict[str, object] = {"event": event, "caller": who.caller, **fields}
    try:
        yield record
    except SliceboxError as exc:
        refusal = isinstance(exc, REFUSALS) and event == AuditEvent.SANDBOX_CREATED
        record["event"] = AuditEvent.REQUEST_REFUSED if refusal else event
        await _write(auditor, AuditRecord.model_validate({**record, "result": exc.code}), blocking)
        raise
    except Exception:
        await _write(auditor, AuditRecord.model_validate({**record, "result": INTERNAL}), blocking)
        raise
    await _write(auditor, AuditRecord.model_validate(record), blocking)


async def _write(auditor: Auditor, record: AuditRecord, blocking: Blocking) -> None:
    await settle(blocking, functools.partial(auditor.record, record))
