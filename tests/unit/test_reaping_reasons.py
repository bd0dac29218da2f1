"""The reaper's reasons are sentences an operator reads in ``slicebox reap --dry-run`` and in
the audit: pinned here, word for word, for each rule."""

from __future__ import annotations

from datetime import timedelta

from slicebox.backends.base import SandboxInfo, SandboxState
from slicebox.core.deadlines import Timer
from slicebox.core.reaping import plan
from slicebox.model.config import OrphanPolicy, ReaperConfig
from slicebox.model.labels import MANAGED
from slicebox.model.reaper import Rule
from tests.unit.test_reaper import NOW, POLICY, box, observed


def reasons(
    *containers: SandboxInfo, policy: ReaperConfig = POLICY, **seen: object
) -> dict[tuple[Rule, str], str]:
    return {(a.rule, a.target): a.reason for a in plan(observed(*containers, **seen), NOW, policy)}


def test_a_container_with_missing_labels_says_which_and_why() -> None:
    labels = {k: v for k, v in box("b").labels.items() if k != "slicebox.user"}
    found = reasons(SandboxInfo(id="c-b", name="web-1", labels=labels, state=SandboxState.RUNNING))
    assert found[Rule.MISSING_LINEAGE, "c-b"] == (
        "container web-1: its labels are incomplete (missing slicebox.user); "
        "it was not made by a complete create"
    )


def test_a_container_with_only_the_managed_label_lists_every_missing_one() -> None:
    bare = SandboxInfo(id="c-bare", name="", labels={MANAGED: "true"}, state=SandboxState.RUNNING)
    reason = reasons(bare)[Rule.MISSING_LINEAGE, "c-bare"]
    assert reason.startswith("container c-bare: its labels are incomplete (missing ")
    assert "slicebox.sandbox_id, slicebox.instance_id" in reason
    assert "slicebox.provisioned.memory_bytes" in reason
    assert "{" not in reason


def test_a_container_with_a_malformed_label_names_it() -> None:
    broken = box("b").labels | {"slicebox.depth": "deep"}
    found = reasons(SandboxInfo(id="c-b", name="b", labels=broken, state=SandboxState.RUNNING))
    assert found[Rule.MISSING_LINEAGE, "c-b"] == (
        "container b: its labels are malformed (slicebox.depth: Input should be a valid integer, "
        "unable to parse string as an integer); slicebox did not write them"
    )


def test_every_other_rule_reads_as_a_sentence() -> None:
    reap = POLICY.model_copy(update={"orphans": OrphanPolicy.REAP, "pool_size": 0})
    found = reasons(
        box("gone", status="exited"),
        box("new", status="created"),
        box("old", ttl=1),
        box("kid", parent="nobody", depth=1),
        box("theirs", run="run-before"),
        box("idle", pool=True),
        box("ran", oneshot=True),
        policy=reap,
        timers=[Timer(unit="t.timer", sandbox_id="sbx-9", at=NOW)],
        state_dirs=["sbx-9"],
        slices=["slicebox-bob.slice", "slicebox-bob-q.slice"],
    )
    assert found == {
        (Rule.EXITED, "gone"): "its container is exited; nothing runs in it",
        (Rule.NEVER_STARTED, "new"): (
            "its container was created but never started, and no create is in progress"
        ),
        (Rule.EXPIRED, "old"): "its deadline 2026-01-02T03:03:06+00:00 has passed",
        (Rule.PARENT_GONE, "kid"): "its parent nobody is gone",
        (Rule.ORPHAN, "theirs"): (
            "it was made by agent run run-before, not this one, and the orphan policy is reap"
        ),
        (Rule.POOL_SURPLUS, "idle"): "it is an idle pool member beyond the 0 its pool keeps",
        (Rule.RUN_ENDED, "ran"): (
            "it was made for a one-shot run that no longer holds it (the run's removal failed, "
            "or its agent stopped before removing it)"
        ),
        (Rule.STALE_DEADLINE, "t.timer"): "its sandbox sbx-9 is gone",
        (Rule.LEFTOVER_FILES, "sbx-9"): "its sandbox sbx-9 is gone; nothing needs these files",
        (Rule.EMPTY_SLICE, "slicebox-bob-q.slice"): "no sandbox of bob/q is left",
        (Rule.EMPTY_SLICE, "slicebox-bob.slice"): "no sandbox of user bob is left",
    }


def test_adoption_and_a_missing_timer_say_what_happens() -> None:
    found = reasons(box("theirs", run="run-before"), box("mine"))
    deadline = (NOW - timedelta(seconds=60) + timedelta(seconds=3600)).isoformat()
    assert found[Rule.ADOPT, "theirs"] == (
        "it was made by agent run run-before; this run adopts it and keeps its deadline"
    )
    assert found[Rule.DEADLINE_MISSING, "mine"] == f"its deadline {deadline} has no timer armed"
