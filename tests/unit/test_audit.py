from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from slicebox.host.journal import Auditor
from slicebox.model.audit import MESSAGE_IDS, AuditEvent, AuditRecord, Caller, journal_fields, scrub
from tests.fakes.journal import ListJournal

CATALOG = Path(__file__).resolve().parents[2] / "units" / "slicebox.catalog"


class BrokenJournal:
    def send(self, fields: Mapping[str, str]) -> None:
        raise OSError("journald is gone")


def test_destroy_record_carries_lineage_caller_and_final_usage() -> None:
    record = AuditRecord(
        event=AuditEvent.SANDBOX_DESTROYED,
        sandbox_id="sbx-1",
        root_task_id="root-9",
        user="alice",
        project="web",
        caller=Caller(uid=1000, gid=1000, pid=42, comm="agent"),
        usage={"cpu_seconds": 1.5, "memory_bytes": {"project": 10, "user": 20}},
    )
    fields = journal_fields(record)
    assert fields["MESSAGE_ID"] == MESSAGE_IDS[AuditEvent.SANDBOX_DESTROYED]
    assert fields["SLICEBOX_ROOT_TASK_ID"] == "root-9"
    assert fields["SLICEBOX_CALLER_UID"] == "1000"
    assert fields["SLICEBOX_CALLER_COMM"] == "agent"
    assert fields["SLICEBOX_USAGE_CPU_SECONDS"] == "1.5"
    assert fields["SLICEBOX_USAGE_MEMORY_BYTES_PROJECT"] == "10"
    assert fields["PRIORITY"] == "5"


def test_refusal_is_a_warning_with_its_code() -> None:
    fields = journal_fields(
        AuditRecord(event=AuditEvent.REQUEST_REFUSED, result="admission_refused")
    )
    assert fields["SLICEBOX_RESULT"] == "admission_refused"
    assert fields["PRIORITY"] == "4"
    assert "SLICEBOX_SANDBOX_ID" not in fields


@pytest.mark.parametrize(
    "text",
    [
        "token=abc123",
        "password: hunter2",
        "ghp_" + "a" * 36,
        "glpat-" + "b" * 20,
        "x" * 40,
    ],
)
def test_secrets_are_scrubbed_from_detail(text: str) -> None:
    fields = journal_fields(AuditRecord(event=AuditEvent.EXEC, detail=f"ran with {text}"))
    assert text not in fields["SLICEBOX_DETAIL"]
    assert "[redacted]" in scrub(text)


def test_record_has_no_room_for_secrets() -> None:
    with pytest.raises(ValueError, match="env"):
        AuditRecord.model_validate({"event": "exec", "env": {"TOKEN": "x"}})


def test_every_event_has_a_distinct_id_explained_by_the_catalog() -> None:
    assert set(MESSAGE_IDS) == set(AuditEvent)
    assert len(set(MESSAGE_IDS.values())) == len(MESSAGE_IDS)
    catalog_ids = set(re.findall(r"^-- ([0-9a-f]{32})$", CATALOG.read_text(), re.MULTILINE))
    assert catalog_ids == set(MESSAGE_IDS.values())


def test_journal_failure_does_not_break_the_action(caplog: pytest.LogCaptureFixture) -> None:
    Auditor(BrokenJournal()).record(AuditRecord(event=AuditEvent.AGENT_STARTED))
    assert "could not write audit record" in caplog.text


def test_auditor_sends_fields() -> None:
    journal = ListJournal()
    Auditor(journal).record(AuditRecord(event=AuditEvent.EXEC, exit_code=124))
    assert journal.entries[0]["SLICEBOX_EXIT_CODE"] == "124"
