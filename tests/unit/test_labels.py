from __future__ import annotations

from datetime import UTC, datetime

import pytest

from slicebox.model.errors import InvalidRequest
from slicebox.model.labels import Lineage, decode, selector

LINEAGE = Lineage(
    sandbox_id="sbx-1",
    instance_id="run-1",
    root_task_id="t",
    task_id="t2",
    parent_id="sbx-0",
    depth=1,
    user="al-ice",
    project="p",
    created_at=datetime(2026, 1, 1, tzinfo=UTC),
    provisioned_cpu=0.5,
    provisioned_memory_bytes=256,
    provisioned_pids=100,
)


def test_labels_round_trip_under_the_prefix() -> None:
    labels = LINEAGE.to_labels()
    assert all(key.startswith("slicebox.") for key in labels)
    assert labels["slicebox.managed"] == "true"
    assert labels["slicebox.expires_at"] == ""
    assert labels["slicebox.provisioned.memory_bytes"] == "256"
    assert labels["slicebox.created_at"] == "2026-01-01T00:00:00+00:00"
    assert decode(labels | {"other": "x"}) == LINEAGE


def test_foreign_or_broken_labels_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="not managed"):
        decode({"slicebox.user": "x"})
    with pytest.raises(InvalidRequest, match="malformed"):
        decode(LINEAGE.to_labels() | {"slicebox.depth": "deep"})


def test_selector() -> None:
    assert selector(user="a", provisioned__cpu="1") == {
        "slicebox.managed": "true",
        "slicebox.user": "a",
        "slicebox.provisioned.cpu": "1",
    }
