"""Audit records really reach journald, are found by root task, and the catalog explains them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.host.journal import Auditor, SystemJournal
from slicebox.model.audit import MESSAGE_IDS, AuditEvent, AuditRecord, Caller
from tests.host.helpers import sh, unique, wait_for

pytestmark = pytest.mark.host

CATALOG = Path(__file__).resolve().parents[2] / "units" / "slicebox.catalog"
INSTALLED = Path("/usr/lib/systemd/catalog/slicebox-test.catalog")


def journal_entries(**match: str) -> list[dict[str, str]]:
    args = [f"{key}={value}" for key, value in match.items()]
    out = sh("journalctl", "--no-pager", "-o", "json", *args, check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.fixture
def catalog() -> Iterator[None]:
    shutil.copy(CATALOG, INSTALLED)
    sh("journalctl", "--update-catalog")
    yield
    INSTALLED.unlink()
    sh("journalctl", "--update-catalog")


def test_task_story_is_found_by_root_task_id(catalog: None) -> None:
    root = unique("root-")
    auditor = Auditor(SystemJournal())
    caller = Caller(uid=1000, gid=1000, pid=4242, comm="agent")
    for event in (AuditEvent.SANDBOX_CREATED, AuditEvent.EXEC, AuditEvent.SANDBOX_DESTROYED):
        auditor.record(
            AuditRecord(
                event=event,
                sandbox_id="sbx-a",
                root_task_id=root,
                user="alice",
                project="web",
                caller=caller,
                exit_code=0 if event == AuditEvent.EXEC else None,
                usage={"cpu_seconds": 0.25} if event == AuditEvent.SANDBOX_DESTROYED else None,
            )
        )
    wait_for(lambda: len(journal_entries(SLICEBOX_ROOT_TASK_ID=root)) == 3, timeout=10)
    entries = journal_entries(SLICEBOX_ROOT_TASK_ID=root)
    assert [e["SLICEBOX_EVENT"] for e in entries] == [
        "sandbox_created",
        "exec",
        "sandbox_destroyed",
    ]
    assert {e["MESSAGE_ID"] for e in entries} == {
        MESSAGE_IDS[AuditEvent.SANDBOX_CREATED],
        MESSAGE_IDS[AuditEvent.EXEC],
        MESSAGE_IDS[AuditEvent.SANDBOX_DESTROYED],
    }
    assert all(e["SLICEBOX_CALLER_PID"] == "4242" for e in entries)
    assert entries[2]["SLICEBOX_USAGE_CPU_SECONDS"] == "0.25"
    explained = sh("journalctl", "--no-pager", "-x", f"SLICEBOX_ROOT_TASK_ID={root}").stdout
    assert "was destroyed" in explained
    assert "final resource usage" in explained
