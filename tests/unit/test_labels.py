from __future__ import annotations

from datetime import UTC, datetime

import pytest

from slicebox.model.errors import HostError
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


def test_foreign_or_broken_labels_are_refused_in_sentences() -> None:
    with pytest.raises(HostError) as caught:
        decode({"slicebox.user": "x"})
    assert caught.value.code == "broken_labels"
    assert caught.value.message == "it has no slicebox.managed=true label; slicebox did not make it"
    with pytest.raises(HostError) as caught:
        decode(LINEAGE.to_labels() | {"slicebox.depth": "deep"})
    assert caught.value.message == (
        "its labels are malformed (slicebox.depth: Input should be a valid integer, unable to "
        "parse string as an integer); slicebox did not write them"
    )


def test_incomplete_labels_name_every_missing_label() -> None:
    labels = LINEAGE.to_labels()
    del labels["slicebox.user"], labels["slicebox.provisioned.cpu"]
    with pytest.raises(HostError) as caught:
        decode(labels)
    assert caught.value.message == (
        "its labels are incomplete (missing slicebox.user, slicebox.provisioned.cpu); "
        "it was not made by a complete create"
    )


def test_selector() -> None:
    assert selector(user="a", provisioned__cpu="1") == {
        "slicebox.managed": "true",
        "slicebox.user": "a",
        "slicebox.provisioned.cpu": "1",
    }
