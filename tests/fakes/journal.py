"""An in-memory journal sink: the audit records a test caused, as journal fields."""

from __future__ import annotations

from collections.abc import Mapping


class ListJournal:
    def __init__(self) -> None:
        self.entries: list[Mapping[str, str]] = []

    def send(self, fields: Mapping[str, str]) -> None:
        self.entries.append(dict(fields))

    def events(self) -> list[tuple[str, str]]:
        return [(e["SLICEBOX_EVENT"], e["SLICEBOX_RESULT"]) for e in self.entries]
