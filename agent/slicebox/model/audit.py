"""Audit: one structured journal entry per action.

Audit records are not log lines. Each action (a sandbox created, a command run, files copied
in or out, a sandbox destroyed, a reaper decision, a refused request) becomes one journal entry
with a fixed MESSAGE_ID per kind of event, explained by the catalog `units/slicebox.catalog`,
and with `SLICEBOX_*` fields so that `journalctl SLICEBOX_ROOT_TASK_ID=<id>` tells a task's
whole story.

Secrets never reach the journal because the record has no place for them: it carries ids,
names, the caller's kernel identity, a result and counters — never environment, argv,
credentials, output or file contents. Free text (`detail`) is limited and scrubbed of anything
that looks like a token before it is written.
"""

import logging
import re
from collections.abc import Mapping
from enum import StrEnum

from pydantic import ConfigDict, Field

from slicebox.model.base import Model

log = logging.getLogger(__name__)


class AuditEvent(StrEnum):
    SANDBOX_CREATED = "sandbox_created"
    EXEC = "exec"
    SANDBOX_DESTROYED = "sandbox_destroyed"
    REQUEST_REFUSED = "request_refused"
    REAPER_ACTION = "reaper_action"
    DEADLINE_CHANGED = "deadline_changed"
    CEILINGS_APPLIED = "ceilings_applied"
    AGENT_STARTED = "agent_started"
    AGENT_STOPPING = "agent_stopping"
    FILE_TRANSFER = "file_transfer"
    EGRESS_SUMMARY = "egress_summary"
    SANDBOX_PAUSED = "sandbox_paused"
    SANDBOX_RESUMED = "sandbox_resumed"
    SNAPSHOT_TAKEN = "snapshot_taken"
    SNAPSHOT_DELETED = "snapshot_deleted"


# Fixed forever: operators filter on these and the catalog explains them.
MESSAGE_IDS: Mapping[AuditEvent, str] = {
    AuditEvent.SANDBOX_CREATED: "f4a55027d9174866bea7d75fcb6f4a0e",
    AuditEvent.EXEC: "1763cc03939a460c9b0ee77bf1a3a14e",
    AuditEvent.SANDBOX_DESTROYED: "7ad5412052e042909876b4fad556683f",
    AuditEvent.REQUEST_REFUSED: "aaad076bec5b4ca2a06183f3fab73532",
    AuditEvent.REAPER_ACTION: "8b8555972dc1498397030867d2be155e",
    AuditEvent.DEADLINE_CHANGED: "e892b14f12b540bc996463a05befb8b0",
    AuditEvent.CEILINGS_APPLIED: "583afb0f8d04451881fb2a3fbbd0fc85",
    AuditEvent.AGENT_STARTED: "07de345e13394bee8ab28ae075040761",
    AuditEvent.AGENT_STOPPING: "3138cc1c969e4a12ad76ba475b45cb42",
    AuditEvent.FILE_TRANSFER: "fd40cf5c650449bda6c87efcb89088db",
    AuditEvent.EGRESS_SUMMARY: "021c672547444614b82e360a2cdf6120",
    AuditEvent.SANDBOX_PAUSED: "0942edcbced6466ba6a2f459d5bac02f",
    AuditEvent.SANDBOX_RESUMED: "8cdcda68c55b4e0bbbaff51de576411a",
    AuditEvent.SNAPSHOT_TAKEN: "c33d513bda6a4d0ba9b0db21d98aaa5f",
    AuditEvent.SNAPSHOT_DELETED: "5cee43edd22d4d77b433d49ce61c2f5f",
}

# syslog priorities: notice for successful actions, warning for refusals and failures.
PRIORITY_NOTICE = 5
PRIORITY_WARNING = 4

_TOKENISH = re.compile(
    r"(gh[pousr]_[A-Za-z0-9]{20,}|glpat-[A-Za-z0-9_-]{20,}|[A-Za-z0-9+/=_-]{32,}"
    r"|(?i:(?:token|password|secret|passwd|authorization)\s*[=:]\s*\S+))"
)


def scrub(text: str) -> str:
    """Replace anything that looks like a credential; keep the rest readable."""
    return _TOKENISH.sub("[redacted]", text)


class Caller(Model):
    """Who asked, as the kernel says (SO_PEERCRED), not as the request claims."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uid: int
    gid: int
    pid: int
    comm: str = ""
    # A nested sandbox's request (core.nesting): the sandbox whose own socket it came in on;
    # the uid, gid and user are that sandbox's user's, the pid and comm its process's.
    sandbox: str = ""


class AuditRecord(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    event: AuditEvent
    result: str = "ok"  # "ok", the stable error code, or an exec's "timed_out"/"abandoned"
    sandbox_id: str = ""
    root_task_id: str = ""
    task_id: str = ""
    user: str = ""
    project: str = ""
    caller: Caller | None = None
    exit_code: int | None = None
    usage: Mapping[str, object] | None = None
    rule: str = ""  # the reaper's rule, for reaper_action
    detail: str = Field(default="", max_length=500)


def journal_fields(record: AuditRecord) -> dict[str, str]:
    """The record as journal fields: pure, so what reaches the journal is table-testable."""
    fields = {
        "MESSAGE_ID": MESSAGE_IDS[record.event],
        "MESSAGE": _message(record),
        "PRIORITY": str(PRIORITY_NOTICE if record.result == "ok" else PRIORITY_WARNING),
        "SYSLOG_IDENTIFIER": "sliceboxd",
        "SLICEBOX_EVENT": record.event.value,
        "SLICEBOX_RESULT": record.result,
    }
    optional = {
        "SLICEBOX_SANDBOX_ID": record.sandbox_id,
        "SLICEBOX_ROOT_TASK_ID": record.root_task_id,
        "SLICEBOX_TASK_ID": record.task_id,
        "SLICEBOX_USER": record.user,
        "SLICEBOX_PROJECT": record.project,
        "SLICEBOX_REAPER_RULE": record.rule,
        "SLICEBOX_DETAIL": scrub(record.detail),
    }
    fields.update({key: value for key, value in optional.items() if value})
    fields.update(_caller_fields(record.caller))
    if record.exit_code is not None:
        fields["SLICEBOX_EXIT_CODE"] = str(record.exit_code)
    fields.update(_usage_fields(record.usage))
    return fields


def _message(record: AuditRecord) -> str:
    subject = record.sandbox_id or record.root_task_id or "-"
    owner = f" ({record.user}/{record.project})" if record.user else ""
    return f"slicebox {record.event.value} {subject}{owner}: {record.result}"


def _caller_fields(caller: Caller | None) -> dict[str, str]:
    if caller is None:
        return {}
    fields = {
        "SLICEBOX_CALLER_UID": str(caller.uid),
        "SLICEBOX_CALLER_GID": str(caller.gid),
        "SLICEBOX_CALLER_PID": str(caller.pid),
    }
    if caller.comm:
        fields["SLICEBOX_CALLER_COMM"] = caller.comm
    if caller.sandbox:
        fields["SLICEBOX_CALLER_SANDBOX"] = caller.sandbox
    return fields


def _usage_fields(
    usage: Mapping[str, object] | None, prefix: str = "SLICEBOX_USAGE"
) -> dict[str, str]:
    """Flatten usage: {"memory_bytes": {"project": 1}} -> SLICEBOX_USAGE_MEMORY_BYTES_PROJECT=1."""
    if not usage:
        return {}
    fields: dict[str, str] = {}
    for key, value in usage.items():
        name = f"{prefix}_{re.sub(r'[^A-Za-z0-9]', '_', key).upper()}"
        if isinstance(value, Mapping):
            fields.update(_usage_fields(value, name))
        elif value is not None:
            fields[name] = str(value)
    return fields
