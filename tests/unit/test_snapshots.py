"""Pause, snapshots and forks over fakes (core.pausing, core.snapshots, core.snaptar): who may
do what, what a snapshot holds and what it never holds, the quota, a freeze a killed agent
left, and the spec's rules for a snapshot's image."""

from __future__ import annotations

import io
import os
import tarfile
from datetime import timedelta
from pathlib import Path, PurePosixPath

import pytest

from slicebox.core.blocking import Blocking, from_thread
from slicebox.core.pausing import Pausing, docker_only
from slicebox.core.reaping import plan
from slicebox.core.refusals import check_backend
from slicebox.core.sandbox import Sandbox
from slicebox.core.snapshots import Lifecycle, Snapshots, changes_of
from slicebox.core.snaptar import Pipe, add_tree, clean, write_snapshot
from slicebox.host.freezer import CgroupFreezer
from slicebox.host.identity import Identity
from slicebox.model.api import CreateSandbox, RunRequest, SandboxView
from slicebox.model.config import parse_config
from slicebox.model.errors import InvalidRequest, NotFound, SandboxNotRunning, SliceboxError
from slicebox.model.snapshots import SnapshotView, snapshot_image
from slicebox.model.spec import Backend, parse_spec
from tests.fakes.cgroupdir import CgroupDir
from tests.fakes.snapshots import (
    FakeSnapshotEngine,
    contents,
    member,
    members_of,
    tar_of,
)
from tests.unit.test_reaper import NOW as REAPER_NOW
from tests.unit.test_reaper import POLICY, box, observed
from tests.unit.test_service import ALICE, BOB, NOW, World

SECRET = "hunter2-from-the-create"


class Snapping:
    """A Service over fakes with pause and snapshots attached, and alice's sandbox."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.world = World(tmp)
        self.engine = FakeSnapshotEngine()
        self.marks = (tmp / "freezes", tmp / "held")
        self.pausing = Pausing(
            self.engine,
            self.world.service.files,
            CgroupDir(tmp),
            marks=self.marks,
            clock=lambda: NOW,
        )
        self.workspace = tmp / "workspace"
        self.workspace.mkdir()
        self.snapshots = Snapshots(
            self.pausing,
            self.world.service.files,
            clock=lambda: NOW,
            workspace_of=lambda pid: str(self.workspace),
        )
        self.box = self.world.create(ALICE)
        self.sandbox = self.world.sandboxes.get(self.box)
        rootfs = tar_of(
            [
                member("etc/", kind=tarfile.DIRTYPE, mode=0o755),
                member("etc/hello", b"rootfs\n"),
                member("tmp/suid", b"\x7fELF", mode=0o4755),
                member("tmp/sgid", b"\x7fELF", mode=0o2755),
                member("dev/evil", kind=tarfile.CHRTYPE, mode=0o666),
                member("workspace/stale", b"the image's, below the sandbox's tmpfs"),
            ]
        )
        self.engine.add(self.sandbox.container_id, rootfs, [f"SECRET_TOKEN={SECRET}"])

    def freeze_file(self, value: str) -> None:
        scope = self.tmp / str(self.sandbox.scope_cgroup(PurePosixPath("/"))).lstrip("/")
        scope.mkdir(parents=True, exist_ok=True)
        (scope / "cgroup.freeze").write_text(value)

    def take(self, name: str, who: Identity = ALICE) -> SnapshotView:
        return from_thread(lambda b: self.snapshots.take(who, self.box, name, b))


@pytest.fixture
def snap(tmp_path: Path) -> Snapping:
    return Snapping(tmp_path)


# --- pause and resume ---


def test_pause_and_resume_are_the_engine_s_and_audited(snap: Snapping) -> None:
    state = from_thread(lambda b: snap.pausing.pause(ALICE, snap.box, b))
    assert state.paused
    assert snap.engine.paused(snap.sandbox.container_id)
    from_thread(lambda b: snap.pausing.pause(ALICE, snap.box, b))  # twice: one engine pause
    assert snap.engine.calls == [f"pause {snap.sandbox.container_id}"]
    assert not from_thread(lambda b: snap.pausing.resume(ALICE, snap.box, b)).paused
    events = [e["SLICEBOX_EVENT"] for e in snap.world.journal.entries]
    assert events[-3:] == ["sandbox_paused", "sandbox_paused", "sandbox_resumed"]


def test_another_user_cannot_pause_or_resume(snap: Snapping) -> None:
    for act in (snap.pausing.pause, snap.pausing.resume):
        with pytest.raises(NotFound):
            from_thread(lambda b, act=act: act(BOB, snap.box, b))  # type: ignore[misc]
    assert not snap.engine.paused(snap.sandbox.container_id)


def test_a_paused_sandbox_refuses_execs_unless_asked_to_resume(snap: Snapping) -> None:
    snap.engine.pause(snap.sandbox.container_id)
    snap.freeze_file("1")
    with pytest.raises(SandboxNotRunning) as refused:
        from_thread(lambda b: snap.pausing.ensure_running(ALICE, snap.box, False, b))
    assert refused.value.code == "sandbox_paused"
    assert "?resume=1" in refused.value.message
    from_thread(lambda b: snap.pausing.ensure_running(ALICE, snap.box, True, b))
    assert not snap.engine.paused(snap.sandbox.container_id)


def test_a_kill_s_moment_of_freeze_is_no_pause(snap: Snapping) -> None:
    snap.freeze_file("1")  # the exec engine's kill, the engine knows of no pause
    from_thread(lambda b: snap.pausing.ensure_running(ALICE, snap.box, False, b))
    snap.freeze_file("0")
    from_thread(lambda b: snap.pausing.ensure_running(ALICE, snap.box, False, b))
    assert snap.engine.calls == []


def test_a_freeze_for_a_snapshot_is_marked_and_a_restarted_agent_undoes_it(snap: Snapping) -> None:
    container = snap.sandbox.container_id
    with snap.pausing.frozen_for(snap.sandbox) as froze:
        assert froze
        assert (snap.marks[0] / container).exists()
        assert snap.engine.paused(container)
    assert not snap.engine.paused(container)
    assert not (snap.marks[0] / container).exists()
    # An agent killed inside the block: its mark and its freeze stay, the next start thaws.
    snap.marks[0].mkdir(exist_ok=True)
    (snap.marks[0] / container).write_text(snap.box)
    snap.engine.pause(container)
    assert snap.pausing.thaw_leftovers() == [container]
    assert not snap.engine.paused(container)
    assert list(snap.marks[0].iterdir()) == []


def test_a_user_s_pause_outlives_a_snapshot_and_a_restart(snap: Snapping) -> None:
    container = snap.sandbox.container_id
    from_thread(lambda b: snap.pausing.pause(ALICE, snap.box, b))
    with snap.pausing.frozen_for(snap.sandbox) as froze:
        assert not froze
    assert snap.pausing.thaw_leftovers() == []
    assert snap.engine.paused(container)


def test_paused_time_counts_unless_the_config_says_not(snap: Snapping) -> None:
    deadline = snap.world.sandboxes.with_deadline(snap.sandbox).expires_at
    from_thread(lambda b: snap.pausing.pause(ALICE, snap.box, b))
    assert snap.world.sandboxes.with_deadline(snap.sandbox).expires_at == deadline
    from_thread(lambda b: snap.pausing.resume(ALICE, snap.box, b))
    snap.world.sandboxes.reconfigure(parse_config("[snapshots]\npaused_time_counts = false\n"))
    from_thread(lambda b: snap.pausing.pause(ALICE, snap.box, b))
    held = snap.world.sandboxes.with_deadline(snap.sandbox).expires_at
    assert held is not None
    assert deadline is not None
    assert held - NOW == timedelta(hours=24), "paused: the deadline is out of the way"
    from_thread(lambda b: snap.pausing.resume(ALICE, snap.box, b))
    back = snap.world.sandboxes.with_deadline(snap.sandbox).expires_at
    assert back == deadline, "resumed: the time it had left, again"


def test_only_docker_sandboxes_pause_or_snapshot(snap: Snapping) -> None:
    native = snap.sandbox.model_copy(update={"backend": "native"})
    with pytest.raises(InvalidRequest) as refused:
        docker_only(native, "snapshotted")
    assert refused.value.code == "backend_unsupported"


@pytest.mark.parametrize("backend", [Backend.NATIVE, Backend.WASM, Backend.DAYTONA])
def test_only_docker_forks(backend: Backend) -> None:
    """Any other backend would start without the snapshot's files: refused, never made."""
    fork = parse_spec({"user": "alice", "project": "web", "from_snapshot": "base"})
    with pytest.raises(InvalidRequest) as refused:
        check_backend(fork, backend)
    assert (refused.value.code, refused.value.field) == ("backend_unsupported", "from_snapshot")


def test_the_reaper_leaves_a_paused_sandbox_alone() -> None:
    found = observed(
        box("a", status="paused"), box("b", status="paused", oneshot=True), busy=frozenset({"b"})
    )
    assert plan(found, REAPER_NOW, POLICY) == []


# --- snapshots ---


def test_a_snapshot_holds_the_root_filesystem_and_workspace_and_no_secret(snap: Snapping) -> None:
    (snap.workspace / "ws.txt").write_text("workspace\n")
    (snap.workspace / "sub").mkdir()
    (snap.workspace / "sub" / "suid").write_bytes(b"x")
    os.chmod(snap.workspace / "sub" / "suid", 0o4755)
    os.symlink("/etc/shadow", snap.workspace / "link")
    view = snap.take("base")
    image = snap.engine.images_made[snapshot_image("alice", "base")]
    found = members_of(image["tar"])
    assert contents(image["tar"], "etc/hello") == b"rootfs\n"
    assert contents(image["tar"], "workspace/ws.txt") == b"workspace\n"
    assert found["workspace/link"].issym()  # a link, never what it points at
    for name in ("tmp/suid", "tmp/sgid", "workspace/sub/suid"):
        assert found[name].mode & 0o6000 == 0, name
    assert "dev/evil" not in found
    assert "workspace/stale" not in found, "what the sandbox saw at /workspace, not the image's"
    assert [m for m in found if m.rstrip("/") == "workspace"] == ["workspace"], "one, its own"
    assert found["workspace"].mode & 0o7777 == os.stat(snap.workspace).st_mode & 0o7777
    assert SECRET not in str(image["Config"])
    assert image["Config"]["Env"] == ["PATH=/usr/bin:/bin"]
    assert view.name == "base"
    assert view.origin == snap.box
    assert not snap.engine.paused(snap.sandbox.container_id), "resumed after"
    assert snap.engine.calls[-2:] == [
        f"pause {snap.sandbox.container_id}",
        f"unpause {snap.sandbox.container_id}",
    ]


def test_snapshots_are_their_owner_s_only(snap: Snapping) -> None:
    snap.take("base")
    mine = from_thread(lambda b: snap.snapshots.listed(ALICE, None, b))
    assert [v.name for v in mine] == ["base"]
    assert from_thread(lambda b: snap.snapshots.listed(BOB, None, b)) == []
    with pytest.raises(NotFound):
        from_thread(lambda b: snap.snapshots.delete(BOB, "base", None, b))
    with pytest.raises(NotFound):
        snap.take("bobs", who=BOB)
    assert from_thread(lambda b: snap.snapshots.delete(ALICE, "base", None, b)).deleted
    assert snap.engine.images_made == {}


def test_the_quota_and_a_taken_name_are_refused_with_their_codes(snap: Snapping) -> None:
    snap.world.sandboxes.reconfigure(parse_config("[snapshots]\nmax_count = 2\n"))
    snap.take("one")
    with pytest.raises(SliceboxError) as taken:
        snap.take("one")
    assert taken.value.code == "snapshot_exists"
    snap.take("two")
    with pytest.raises(SliceboxError) as full:
        snap.take("three")
    assert full.value.code == "snapshot_quota"
    assert "2 snapshots" in full.value.message
    snap.world.sandboxes.reconfigure(parse_config('[snapshots]\nmax_bytes = "1KB"\n'))
    from_thread(lambda b: snap.snapshots.delete(ALICE, "one", None, b))
    from_thread(lambda b: snap.snapshots.delete(ALICE, "two", None, b))
    with pytest.raises(SliceboxError) as large:
        snap.take("big")
    assert large.value.code == "snapshot_quota"
    assert snap.engine.images_made == {}, "the one over the bytes is deleted again"


def test_a_host_workspace_is_refused_and_nothing_is_frozen(snap: Snapping) -> None:
    mounts = [{"Destination": "/workspace", "Type": "bind"}]
    snap.engine.mounts[snap.sandbox.container_id] = mounts
    with pytest.raises(InvalidRequest) as refused:
        snap.take("host")
    assert refused.value.code == "snapshot_workspace"
    assert snap.engine.calls == []


def test_a_failed_import_leaves_no_snapshot_and_the_sandbox_running(snap: Snapping) -> None:
    snap.engine.fail_import = True
    with pytest.raises(SliceboxError):
        snap.take("cut")
    assert snap.engine.images_made == {}
    assert not snap.engine.paused(snap.sandbox.container_id)
    assert not list(snap.marks[0].iterdir())


def test_the_image_s_configuration_is_the_base_image_s_and_the_labels() -> None:
    changes = changes_of(
        {"Env": ["PATH=/bin"], "Cmd": ["sh"], "WorkingDir": "/w"}, {"slicebox-snapshot": "true"}
    )
    assert changes == [
        'ENV "PATH"="/bin"',
        'CMD ["sh"]',
        "WORKDIR /w",
        'LABEL "slicebox-snapshot"="true"',
    ]


# --- the streams ---


def _drained(pipe: Pipe) -> bytes:
    return b"".join(pipe)


def test_clean_keeps_no_xattr_and_no_device() -> None:
    info, _ = member("bin/ping", mode=0o4755)
    info.pax_headers = {"SCHILY.xattr.security.capability": "x", "comment": "kept"}
    kept = clean(info)
    assert kept is not None
    assert kept.pax_headers == {"comment": "kept"}
    assert kept.mode == 0o755
    assert clean(member("dev/sda", kind=tarfile.BLKTYPE)[0]) is None


def test_a_workspace_is_walked_without_following_links(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "outside").write_text("never")
    os.symlink(tmp_path / "outside", tmp_path / "dir" / "link")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        add_tree(tar, str(tmp_path / "dir"), "w")
    found = members_of(buffer.getvalue())
    assert list(found) == ["w/link"]
    assert found["w/link"].issym()


def test_a_snapshot_stream_writes_through_a_pipe_a_reader_can_abandon(tmp_path: Path) -> None:
    pipe = Pipe()
    pipe.abandon()
    with pytest.raises(BrokenPipeError):
        write_snapshot(io.BytesIO(tar_of([member("big", b"x" * (8 << 20))])), str(tmp_path), pipe)


# --- the spec ---


@pytest.mark.parametrize("image", ["ad", "ad0fd94f", "sha256:ad0f", "sha256:" + "a" * 64])
def test_an_image_is_never_named_by_its_id_which_could_be_another_user_s_snapshot(
    image: str,
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_spec({"user": "bob", "project": "p", "image": image})
    assert "repository[:tag]" in refused.value.message
    assert parse_spec({"user": "bob", "project": "p", "image": "cafe:1"}).image == "cafe:1"


def test_only_a_fork_runs_a_snapshot_s_image_and_only_its_owner_s() -> None:
    with pytest.raises(InvalidRequest):
        parse_spec({"user": "bob", "project": "p", "image": snapshot_image("alice", "base")})
    spec = parse_spec({"user": "alice", "project": "p", "from_snapshot": "base"})
    assert spec.image == snapshot_image("alice", "base")
    assert snapshot_image("bob", "base") != spec.image
    with pytest.raises(InvalidRequest):
        parse_spec({"user": "alice", "project": "p", "from_snapshot": "base", "image": "x:1"})
    with pytest.raises(InvalidRequest) as bad:
        parse_spec({"user": "alice", "project": "p", "from_snapshot": "../etc"})
    assert bad.value.code == "invalid_name"


def test_a_sandbox_value_of_a_fork_says_its_snapshot(snap: Snapping) -> None:
    labels = snap.sandbox.lineage.model_copy(update={"from_snapshot": "base"}).to_labels()
    assert labels["slicebox.from_snapshot"] == "base"
    assert "slicebox.from_snapshot" not in snap.sandbox.lineage.to_labels()
    assert isinstance(snap.sandbox, Sandbox)


def test_a_native_sandbox_is_paused_by_its_slice_s_freezer(snap: Snapping) -> None:
    native = snap.sandbox.model_copy(update={"backend": "native", "container_id": "p-n.slice"})
    pausing = Pausing(
        snap.engine,
        snap.world.service.files,
        CgroupDir(snap.tmp),
        marks=snap.marks,
        freezer=CgroupFreezer(snap.tmp),
    )
    cgroup = snap.tmp / str(native.scope_cgroup(PurePosixPath("/"))).lstrip("/")
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.freeze").write_text("0")
    pausing._pause(native)
    assert (cgroup / "cgroup.freeze").read_text() == "1"
    assert pausing.frozen(native)
    pausing._resume(native)
    assert (cgroup / "cgroup.freeze").read_text() == "0"
    assert snap.engine.calls == [], "the engine knows nothing of a native sandbox"


class _Forks:
    """The Service's create as a fork uses it, recorded."""

    def __init__(self) -> None:
        self.done: list[str] = []

    async def create(
        self, who: Identity, request: CreateSandbox, blocking: Blocking
    ) -> SandboxView:
        self.done.append(f"create {request.from_snapshot}")
        return SandboxView.model_validate(_VIEW)


_VIEW = {
    "id": "sbx-fork",
    "container_id": "c-fork",
    "user": "alice",
    "project": "web",
    "backend": "docker",
    "created_at": NOW,
    "expires_at": None,
    "root_task_id": "t",
    "task_id": "t",
    "parent_id": "",
    "depth": 0,
    "limits": {"memory_bytes": 1, "cpus": 0.5, "pids": 1},
}


def _fork(snap: Snapping, who: Identity, forks: Lifecycle, **fields: object) -> SandboxView:
    request = CreateSandbox.model_validate({"project": "web", "from_snapshot": "base", **fields})
    return from_thread(lambda b: snap.snapshots.fork(who, request, b, forks))


def test_a_fork_is_a_create_and_copies_nothing(snap: Snapping) -> None:
    (snap.workspace / "ws.txt").write_text("workspace\n")
    snap.take("base")
    forks = _Forks()
    assert _fork(snap, ALICE, forks).id == "sbx-fork"
    assert forks.done == ["create base"], "no exec: the image's /workspace is the fork's"


@pytest.mark.parametrize(
    "fields",
    [
        {"workspace": {"kind": "host", "path": "/srv/x"}},
        {"workspace": {"kind": "volume"}},
        {"mounts": [{"source": "/srv/x", "target": "/workspace/"}]},
    ],
    ids=["host", "volume", "mount"],
)
def test_only_the_owner_forks_and_nothing_hides_the_snapshot_s_workspace(
    snap: Snapping, fields: dict[str, object]
) -> None:
    snap.take("base")
    forks = _Forks()
    with pytest.raises(NotFound):
        _fork(snap, BOB, forks)
    with pytest.raises(InvalidRequest) as hidden:
        _fork(snap, ALICE, forks, **fields)
    assert hidden.value.code == "snapshot_workspace"
    assert forks.done == [], "refused before anything is made"


def test_a_fork_through_the_service_keeps_its_image_s_workspace(snap: Snapping) -> None:
    """The Service's create of a fork asks the backend for no tmpfs over /workspace and runs
    the snapshot's image; an ordinary create's request has the tmpfs."""
    snap.take("base")
    snap.world.docker.images.add(snapshot_image("alice", "base"))  # the import's, to Docker
    made = _fork(snap, ALICE, snap.world.service)
    forked = snap.world.docker.requests[made.container_id]
    assert forked.workspace_in_image
    assert forked.image == snapshot_image("alice", "base")
    assert not snap.world.docker.requests[snap.sandbox.container_id].workspace_in_image


def test_a_snapshot_larger_than_the_room_left_is_refused_as_it_is_made(snap: Snapping) -> None:
    """A sparse file's apparent size is what a snapshot writes: bounded as it streams."""
    snap.world.sandboxes.reconfigure(parse_config('[snapshots]\nmax_bytes = "1MB"\n'))
    with (snap.workspace / "sparse").open("wb") as sparse:
        sparse.truncate(64 << 20)
    with pytest.raises(SliceboxError) as refused:
        snap.take("sparse")
    assert refused.value.code == "snapshot_quota"
    assert "sparse file" in refused.value.message
    assert snap.engine.images_made == {}
    assert not snap.engine.paused(snap.sandbox.container_id)


def test_the_paused_check_of_an_exec_asks_docker_nothing_for_a_known_sandbox(
    snap: Snapping,
) -> None:
    before = snap.world.calls.copy()
    snap.freeze_file("0")
    from_thread(lambda b: snap.pausing.ensure_running(ALICE, snap.box, False, b))
    from_thread(lambda b: snap.pausing.ensure_running(BOB, snap.box, False, b))
    assert snap.world.calls == before


def test_a_one_shot_run_does_not_start_from_a_snapshot() -> None:
    with pytest.raises(ValueError, match="does not start from a snapshot"):
        RunRequest.model_validate(
            {"sandbox": {"project": "p", "from_snapshot": "base"}, "exec": {"argv": ["true"]}}
        )
