"""The audit journal: records written to journald with their fixed MESSAGE_IDs.

What a record holds and how it becomes journal fields is :mod:`slicebox.model.audit` (pure);
this module only sends.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from slicebox.model.audit import AuditRecord, journal_fields

log = logging.getLogger(__name__)


class JournalSink(Protocol):
    def send(self, fields: Mapping[str, str]) -> None: ...


class SystemJournal:
    """journald through libsystemd's sd_journal_sendv (pystemd)."""

    def send(self, fields: Mapping[str, str]) -> None:
        from pystemd import journal

        journal.sendv(*(f"{key}={value}" for key, value in fields.items()))


class Auditor:
    """Writes audit records; a journal failure is logged, never raised into the action."""

    def __init__(self, sink: JournalSink) -> None:
        self._sink = sink

    def record(self, record: AuditRecord) -> None:
        try:
            self._sink.send(journal_fields(record))
        except Exception:
            log.exception("could not write audit record %s", record.event.value)
