"""Snapshots between tenants over fakes (issue 59, symptoms 2-4): an image is a user's snapshot
only through the agent's own reference, never through labels a pull can bring; what a user's
deleted snapshots still occupy counts against their quota until the engine has freed it, and
the reaper frees it once nothing runs it (after a restart too: all of it is read back from the
engine); a nested sandbox forks only snapshots of its own subtree, and learns nothing of a
paused sandbox it does not reach. The guest shows the same through the installed agent
(tests/host/test_attacks_snapshots.py, tests/host/test_nested.py)."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import pytest

from slicebox.core.blocking import from_thread
from slicebox.core.pausing import Pausing
from slicebox.core.reaper import Reaper
from slicebox.core.reaping import plan
from slicebox.core.slices import SliceManager
from slicebox.core.snapshots import Snapshots
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.model.api import CreateSandbox
from slicebox.model.config import ReaperConfig, parse_config
from slicebox.model.errors import NotFound, SliceboxError
from slicebox.model.exec import ExecRequest
from slicebox.model.reaper import Kind, Rule
from slicebox.model.snapshots import LABEL, LABEL_NAME, LABEL_USER, Released, snapshot_image
from tests.fakes.cgroupdir import CgroupDir
from tests.fakes.snapshots import FakeSnapshotEngine, member, tar_of
from tests.fakes.threadside import ThreadSide
from tests.unit.test_nesting import CONFIG as NESTED_CONFIG
from tests.unit.test_nesting import Nest
from tests.unit.test_reaper import NOW as REAPER_NOW
from tests.unit.test_reaper import POLICY, observed
from tests.unit.test_reaper import box as listed_box
from tests.unit.test_service import ALICE, BOB, NOW, ORCH

ROOTFS = tar_of([member("etc/", kind=tarfile.DIRTYPE, mode=0o755), member("etc/os", b"x\n")])


class Tenants:
    """Nested-capable sandboxes over fakes with snapshots attached: every sandbox made here is
    known to the snapshot engine, its workspace an empty directory."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, config: str = "") -> None:
        self.nest = Nest(tmp, monkeypatch)
        self.world = self.nest.world
        self.configure(config)
        self.engine = FakeSnapshotEngine()
        (tmp / "ws").mkdir()
        self.cgroups = CgroupDir(tmp)
        self.pausing = Pausing(
            self.engine, self.world.service.files, self.cgroups, marks=(tmp / "f", tmp / "h")
        )
        self.snapshots = Snapshots(
            self.pausing,
            self.world.service.files,
            clock=lambda: NOW,
            workspace_of=lambda pid: str(tmp / "ws"),
        )
        self.world.service.snapshots = self.snapshots
        self.tmp = tmp

    def configure(self, snapshots: str) -> None:
        """``[snapshots]`` (and the nested bounds of tests.unit.test_nesting)."""
        self.world.sandboxes.reconfigure(parse_config(f"[snapshots]\n{snapshots}\n{NESTED_CONFIG}"))

    def known(self, sandbox_id: str) -> str:
        self.engine.add(self.world.sandboxes.get(sandbox_id).container_id, ROOTFS)
        return sandbox_id

    def box(self, who: Identity = ALICE, user: str | None = None) -> str:
        return self.known(self.world.create(who, user=user))

    def take(self, who: Identity, sandbox_id: str, name: str) -> Any:
        return from_thread(lambda b: self.snapshots.take(who, sandbox_id, name, b))

    def listed(self, who: Identity, user: str | None = None) -> list[str]:
        views = from_thread(lambda b: self.snapshots.listed(who, user, b))
        return [f"{v.user}/{v.name}" for v in views]

    def delete(self, who: Identity, name: str) -> bool:
        return from_thread(lambda b: self.snapshots.delete(who, name, None, b)).deleted

    def fork(self, who: Identity, name: str, **fields: Any) -> str:
        request = CreateSandbox.model_validate({"project": "web", "from_snapshot": name, **fields})
        self.world.docker.images.add(snapshot_image(who.user_name, name))  # the import's
        made = from_thread(lambda b: self.snapshots.fork(who, request, b, self.world.service))
        return self.known(made.id)

    def reaper(self) -> Reaper:
        """A reaper as the agent's, on the same fakes (a restarted agent's would be the same:
        it remembers nothing of snapshots)."""
        return Reaper(
            self.world.sandboxes,
            SliceManager(self.world.systemd),
            self.world.docker,
            auditor=Auditor(self.world.journal),
            config=lambda: ReaperConfig(state_dir=self.tmp / "state"),
            clock=lambda: NOW,
            images=self.engine,
        )

    def paused(self, sandbox_id: str) -> None:
        """Paused as the engine and the kernel say (its scope's freezer)."""
        sandbox = self.world.sandboxes.get(sandbox_id)
        self.engine.pause(sandbox.container_id)
        scope = self.tmp / str(self.pausing._cgroup(sandbox))
        scope.mkdir(parents=True, exist_ok=True)
        (scope / "cgroup.freeze").write_text("1")


@pytest.fixture
def tenants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tenants:
    return Tenants(tmp_path, monkeypatch, "max_count = 2")


def code_of(call: Any) -> str:
    with pytest.raises(SliceboxError) as refused:
        call()
    return refused.value.code


# --- symptom 2: attributed by the agent's own reference, never by labels ---


def forged(engine: FakeSnapshotEngine, *, named: bool = True, size: int = 1 << 30) -> str:
    """An image a pull brought, labelled as bob's snapshot (``named``: with a name)."""
    labels = {LABEL: "true", LABEL_USER: "bob"} | ({LABEL_NAME: "forged"} if named else {})
    return engine.add_image([f"evil/forged:{len(engine.store)}"], labels, size)


def test_an_image_labelled_as_bob_s_snapshot_is_not_his(tenants: Tenants) -> None:
    forged(tenants.engine)
    forged(tenants.engine)
    forged(tenants.engine, named=False)
    assert tenants.listed(BOB) == [], "not in bob's list, and no error for one without a name"
    assert tenants.listed(ORCH) == [], "nor in an admin's"
    bobs = tenants.box(ORCH, user="bob")
    taken = tenants.take(BOB, bobs, "mine")
    assert taken.name == "mine", "two forged images fill no one's max_count of 2"
    assert tenants.listed(BOB) == ["bob/mine"]
    assert code_of(lambda: tenants.delete(BOB, "forged")) == "not_found"
    assert code_of(lambda: tenants.fork(BOB, "forged")) == "not_found"
    assert len(tenants.engine.store) == 4, "nothing of the forged images was touched"


def test_a_snapshot_whose_labels_make_no_view_is_left_out_not_an_error(
    tenants: Tenants,
) -> None:
    box = tenants.box()
    tenants.take(ALICE, box, "good")
    tenants.take(ALICE, box, "bad")
    image = tenants.engine.images_made[snapshot_image("alice", "bad")]
    image["Labels"]["slicebox-snapshot.created_at"] = "not a time"
    assert tenants.listed(ALICE) == ["alice/good"]
    assert tenants.listed(ORCH) == ["alice/good"]


# --- symptom 3: the quota holds until the bytes are freed ---


def test_a_deleted_snapshot_a_fork_runs_counts_until_the_reaper_frees_it(
    tenants: Tenants,
) -> None:
    box = tenants.box()
    size = tenants.take(ALICE, box, "base").size_bytes
    tenants.configure(f"max_bytes = {int(size * 1.5)}")
    fork = tenants.fork(ALICE, "base")
    image_id = tenants.engine.run(snapshot_image("alice", "base"))  # the fork runs it
    assert tenants.delete(ALICE, "base") is True
    assert tenants.listed(ALICE) == [], "deleted: gone from the list, its name free"
    assert image_id in tenants.engine.store, "the engine keeps what a fork runs"
    with pytest.raises(SliceboxError) as refused:
        tenants.take(ALICE, box, "again")
    assert refused.value.code == "snapshot_quota", "the fork's image still takes the bytes"
    assert "deleted snapshots' images that forks still run" in refused.value.message
    reaper = tenants.reaper()
    assert [a.kind for a in reaper.run().plan if a.rule is Rule.SNAPSHOT_RELEASED] == []
    ThreadSide(tenants.world.service).destroy(ALICE, fork)
    tenants.engine.running.discard(image_id)
    report = tenants.reaper().run()  # a reaper of an agent started anew: all of it is labels
    released = [(a.kind, o.result) for a, o in zip(report.plan, report.outcomes, strict=True)]
    assert (Kind.REMOVE_IMAGE, "ok") in released
    assert image_id not in tenants.engine.store, "freed once nothing runs it"
    assert tenants.take(ALICE, box, "again").name == "again"


def test_the_reaper_leaves_a_released_image_a_fork_of_its_name_runs(tenants: Tenants) -> None:
    """And an untagged one an agent before retired references left is released too."""
    box = tenants.box()
    tenants.take(ALICE, box, "base")
    fork = tenants.fork(ALICE, "base")
    image_id = tenants.engine.run(snapshot_image("alice", "base"))
    tenants.delete(ALICE, "base")
    labels = {LABEL: "true", LABEL_USER: "carol", LABEL_NAME: "old"}
    left = tenants.engine.add_image([], labels)
    plan = tenants.reaper().run(dry_run=True).plan
    assert [(a.kind, a.target) for a in plan if a.rule is Rule.SNAPSHOT_RELEASED] == [
        (Kind.REMOVE_IMAGE, left)
    ], "alice's fork of base still runs: its image is not asked for"
    ThreadSide(tenants.world.service).destroy(ALICE, fork)
    tenants.engine.running.discard(image_id)
    tenants.reaper().run()
    assert tenants.engine.store == {}, "both released, once nothing ran them"


def test_a_released_image_goes_once_no_listed_container_runs_it_whatever_its_name() -> None:
    """Where the engine says which image each container runs, that decides: a fork of a
    newer snapshot of the same name keeps nothing."""
    old = Released(
        target="slicebox-snapshot:d-1", image_id="sha256:1", user="alice", name="b", size_bytes=1
    )
    kept = Released(
        target="slicebox-snapshot:d-2", image_id="sha256:2", user="alice", name="b", size_bytes=1
    )
    fork = listed_box("f").model_copy(update={"image_id": "sha256:2"})
    found = observed(fork, released=[old, kept])
    actions = plan(found, REAPER_NOW, POLICY)
    assert [
        (a.kind, a.rule, a.target, a.reason) for a in actions if a.kind is Kind.REMOVE_IMAGE
    ] == [
        (
            Kind.REMOVE_IMAGE,
            Rule.SNAPSHOT_RELEASED,
            "slicebox-snapshot:d-1",
            "it was snapshot b of alice, deleted while a fork ran it, and no sandbox runs it "
            "any more",
        )
    ]


def test_a_deleted_snapshot_no_fork_runs_is_removed_at_once(tenants: Tenants) -> None:
    box = tenants.box()
    tenants.take(ALICE, box, "base")
    assert tenants.delete(ALICE, "base") is True
    assert tenants.engine.store == {}
    assert code_of(lambda: tenants.delete(ALICE, "base")) == "not_found"


# --- symptom 4: a nested sandbox's snapshots and paused neighbours ---


def test_a_nested_sandbox_forks_only_snapshots_of_its_own_subtree(tenants: Tenants) -> None:
    tenants.configure("max_count = 5")
    parent = tenants.known(tenants.nest.parent(nested={"max_children": 4, "max_depth": 2}))
    child = tenants.known(tenants.nest.child(parent))
    sibling = tenants.box()
    for sandbox, name in ((sibling, "sibling"), (parent, "parent"), (child, "child")):
        tenants.take(ALICE, sandbox, name)
    at_parent, at_child = tenants.nest.inner(parent), tenants.nest.inner(child)
    for within, name in ((at_parent, "sibling"), (at_child, "parent"), (at_child, "sibling")):
        before = {s.id for s in tenants.world.sandboxes.find()}
        with pytest.raises(NotFound) as refused:
            tenants.fork(within, name)
        missing = f"no snapshot {name}; list snapshots to see the names"
        assert refused.value.message == missing, "as a snapshot that is not there"
        assert {s.id for s in tenants.world.sandboxes.find()} == before, "nothing made"
    for name in ("child", "parent"):
        made = tenants.world.sandboxes.get(tenants.fork(at_parent, name))
        assert (made.lineage.parent_id, made.lineage.from_snapshot) == (parent, name)
    assert tenants.fork(ALICE, "sibling"), "its user on the host forks any of theirs"


def nested_exec(tenants: Tenants, who: Identity, target: str) -> None:
    """An exec as the route runs it: the paused check first, then the exec."""
    from_thread(lambda b: tenants.pausing.ensure_running(who, target, False, b))
    ThreadSide(tenants.world.service).exec(who, target, ExecRequest(argv=("true",)))


def test_a_nested_exec_on_a_paused_neighbour_answers_as_one_that_does_not_exist(
    tenants: Tenants,
) -> None:
    parent = tenants.known(tenants.nest.parent())
    child = tenants.known(tenants.nest.child(parent))
    sibling = tenants.box()
    for paused in (sibling, parent):
        tenants.paused(paused)
    at_child = tenants.nest.inner(child)
    for target in (sibling, parent, "sbx-000000000fff"):
        with pytest.raises(NotFound) as refused:
            nested_exec(tenants, at_child, target)
        assert refused.value.message == f"no sandbox {target}; list sandboxes to see the ids"
        assert refused.value.code == "not_found"
    assert code_of(lambda: nested_exec(tenants, ALICE, sibling)) == "sandbox_paused", (
        "its own user on the host is told"
    )
