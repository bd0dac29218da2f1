from __future__ import annotations

import itertools
import subprocess
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import PurePosixPath

import pytest

from slicebox.backends.base import SandboxInfo, SandboxState
from slicebox.core import sandbox
from slicebox.core.launch import WAITER_COMMAND
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.beneath import BindGuard, BindRoot, Pinned
from slicebox.model.config import parse_config
from slicebox.model.errors import (
    Forbidden,
    HostError,
    ImageUnavailable,
    InvalidRequest,
    NotFound,
    PolicyViolation,
)
from slicebox.model.labels import decode, decode_volume
from slicebox.model.limits import Limits
from slicebox.model.names import MANAGED_SLICE
from slicebox.model.spec import Mount, MountKind, SandboxSpec, parse_spec
from tests.fakes.counting import counting
from tests.fakes.docker import FakeDocker, volume_labels
from tests.fakes.systemd import FakeSystemd
from tests.fakes.threadside import created

MiB = 1024 * 1024
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


class World:
    def __init__(
        self,
        config: str = '[projects."al-ice/p"]\nmemory = "400MB"\n',
        binds: BindGuard | None = None,
        calls: Counter[str] | None = None,
    ) -> None:
        self.systemd = FakeSystemd()
        self.docker = FakeDocker(self.systemd)
        ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        self.manager = SandboxManager(
            self.docker if calls is None else counting(self.docker, calls, "docker"),
            SliceManager(self.systemd),
            config=parse_config(config),
            host_memory=4096 * MiB,
            instance_id="run-1",
            clock=lambda: NOW,
            new_id=lambda: next(ids),
            binds=binds,
        )

    def user_slices(self) -> set[str]:
        return {u for u in self.systemd.running if u != MANAGED_SLICE}


@pytest.fixture
def world() -> World:
    return World()


def spec(**fields: object) -> SandboxSpec:
    return SandboxSpec.model_validate({"user": "al-ice", "project": "p", **fields})


def test_create_places_hardens_and_labels(world: World) -> None:
    box = created(world.manager, spec(memory="200MB", ttl_seconds=60, env={"TOKEN": "s3cret"}))
    request = world.docker.requests[box.container_id]
    assert request.slice == "slicebox-al\\x2dice-p.slice"
    assert (request.network, request.cap_add, request.mounts) == ("none", (), ())
    assert request.limits == Limits(cpus=0.5, memory_bytes=200 * MiB, pids=100)
    assert request.command == ("sleep", "infinity")
    assert "s3cret" not in str(request.labels), "secrets never reach labels"
    assert box.id == "sbx-000000000001" == request.name
    assert box.expires_at == NOW + timedelta(seconds=60)
    assert box.lineage == decode(request.labels)
    assert box.lineage.root_task_id == box.lineage.task_id == box.id
    assert world.systemd.properties["slicebox-al\\x2dice-p.slice"]["MemoryMax"] == 400 * MiB
    assert str(box.scope_cgroup()).endswith(
        f"slicebox-al\\x2dice-p.slice/docker-{box.container_id}.scope"
    )


def test_destroy_is_idempotent_and_leaves_the_slices_to_the_reaper(world: World) -> None:
    first = created(world.manager, spec())
    second = created(world.manager, spec(project="q"))
    assert world.manager.destroy(first.id) == first
    assert world.manager.destroy(first.id) is None
    world.manager.destroy(second.id)
    assert world.docker.containers == {}
    assert world.user_slices() == {
        "slicebox-al\\x2dice.slice",
        "slicebox-al\\x2dice-p.slice",
        "slicebox-al\\x2dice-q.slice",
    }
    assert set(world.manager.vacated()) == world.user_slices(), "for the reaper's grace"
    assert world.manager.stop_slice_if_idle("slicebox-al\\x2dice-p.slice")
    assert set(world.manager.vacated()) == world.user_slices()
    assert MANAGED_SLICE in world.systemd.running


def test_one_shot_runs_in_a_project_make_its_slices_once_and_never_stop_them(
    world: World,
) -> None:
    for _ in range(3):
        world.manager.destroy(created(world.manager, spec()).id)
    slice_calls = [(call, unit) for call, unit in world.systemd.calls if unit.endswith(".slice")]
    made = [unit for call, unit in slice_calls if call == "start_transient"]
    assert made == [MANAGED_SLICE, "slicebox-al\\x2dice.slice", "slicebox-al\\x2dice-p.slice"]
    assert [unit for call, unit in slice_calls if call in ("stop", "start")] == []


def test_a_create_into_a_kept_slice_gives_it_the_ceiling_in_force(world: World) -> None:
    world.manager.destroy(created(world.manager, spec()).id)
    assert world.systemd.properties["slicebox-al\\x2dice-p.slice"]["MemoryMax"] == 400 * MiB
    world.manager.reconfigure(parse_config('[projects."al-ice/p"]\nmemory = "300MB"\n'))
    created(world.manager, spec())
    assert world.systemd.properties["slicebox-al\\x2dice-p.slice"]["MemoryMax"] == 300 * MiB


def test_destroy_while_another_removal_runs_is_idempotent(world: World) -> None:
    box = created(world.manager, spec())
    world.docker.begin_removal(box.container_id)  # say, the reaper's destroy of it
    destroyed = world.manager.destroy(box.id)
    assert destroyed is not None, "no error: the sandbox is on its way out"
    assert destroyed.id == box.id
    assert destroyed.state == SandboxState.REMOVING
    world.docker.finish_removal(box.container_id)
    assert world.manager.destroy(box.id) is None
    assert world.manager.find(user="al-ice") == []


def test_a_name_taken_on_the_backend_is_refused_and_leaves_no_slice(world: World) -> None:
    ids = iter(["sbx-same", "sbx-same"])
    world.manager = SandboxManager(
        world.docker,
        SliceManager(world.systemd),
        config=parse_config(""),
        host_memory=4096 * MiB,
        instance_id="run-1",
        new_id=lambda: next(ids),
    )
    created(world.manager, spec(project="one"))
    with pytest.raises(HostError) as taken:
        created(world.manager, spec(project="two"))
    assert taken.value.code == "sandbox_name_conflict"
    assert "slicebox-al\\x2dice-two.slice" not in world.systemd.running


def test_cascade_destroys_deepest_first(world: World) -> None:
    root = created(world.manager, spec(task_id="t"))
    child = created(world.manager, spec(parent_id=root.id))
    grandchild = created(world.manager, spec(parent_id=child.id))
    other = created(world.manager, spec())
    assert (child.lineage.depth, grandchild.lineage.depth) == (1, 2)
    assert grandchild.lineage.root_task_id == "t"
    gone = world.manager.destroy_tree("t")
    assert [b.id for b in gone] == [grandchild.id, child.id, root.id]
    assert world.docker.removed == [b.container_id for b in gone]
    assert [b.id for b in world.manager.find(user="al-ice")] == [other.id]


def test_child_of_another_users_sandbox_is_not_found(world: World) -> None:
    parent = created(world.manager, spec(user="bob"))
    with pytest.raises(NotFound):
        created(world.manager, spec(parent_id=parent.id))
    with pytest.raises(InvalidRequest, match="root_task_id"):
        created(world.manager, spec(user="bob", parent_id=parent.id, root_task_id="other"))


def test_missing_image_is_pulled_or_refused_before_anything_exists(world: World) -> None:
    world.docker.registry.add("busybox:1")
    assert created(world.manager, spec(image="busybox:1")).id
    with pytest.raises(ImageUnavailable):
        created(world.manager, spec(user="z", image="nope:1"))
    assert not any("slicebox-z" in u for u in world.systemd.running)


def test_an_image_a_create_found_is_not_checked_again_unless_a_create_misses_it() -> None:
    """One backend call fewer per create: the create itself tells a missing image."""
    calls: Counter[str] = Counter()
    world = World(calls=calls)
    created(world.manager, spec())
    created(world.manager, spec())
    assert (calls["docker.pull"], calls["docker.create"]) == (1, 2)
    world.docker.images.discard("alpine:3.19")  # removed by hand meanwhile; pullable
    world.docker.registry.add("alpine:3.19")
    assert created(world.manager, spec()).id
    assert (calls["docker.pull"], calls["docker.create"]) == (2, 4), "pulled, tried again"
    world.docker.images.discard("alpine:3.19")
    world.docker.registry.discard("alpine:3.19")
    with pytest.raises(ImageUnavailable):
        created(world.manager, spec(project="new"))
    assert len(world.docker.containers) == 3
    assert "slicebox-al\\x2dice-new.slice" not in world.user_slices(), "its new slice is undone"
    with pytest.raises(ImageUnavailable):  # now unknown: refused before anything exists
        created(world.manager, spec(project="other"))
    assert calls["docker.create"] == 5


def test_failed_start_removes_container_and_new_slices(world: World) -> None:
    kept = created(world.manager, spec(project="keep"))
    world.docker.fail_start = True
    with pytest.raises(InvalidRequest):
        created(world.manager, spec(project="new"))
    assert [c.id for c in world.docker.containers.values()] == [kept.container_id]
    assert world.user_slices() == {"slicebox-al\\x2dice.slice", "slicebox-al\\x2dice-keep.slice"}


def test_failed_slice_start_undoes_the_user_slice(world: World) -> None:
    world.systemd.fail_start.add("slicebox-al\\x2dice-p.slice")
    with pytest.raises(HostError):
        created(world.manager, spec())
    assert world.user_slices() == set()
    assert world.docker.containers == {}


def test_get_unknown_is_not_found(world: World) -> None:
    with pytest.raises(NotFound):
        world.manager.get("sbx-nope")


def test_get_looks_up_the_name_and_believes_only_the_labels(world: World) -> None:
    box = created(world.manager, spec())
    assert world.manager.get(box.id) == box
    world.docker.containers["c-x"] = SandboxInfo(
        id="c-x",
        name="sbx-stranger",
        labels={"slicebox.managed": "true"},
        state=SandboxState.RUNNING,
    )
    for not_a_sandbox in ("sbx-stranger", box.container_id, box.container_id[:12]):
        with pytest.raises(NotFound):
            world.manager.get(not_a_sandbox)
    world.docker.down = "no Docker call for a name Docker would refuse"
    for hostile in ("../../images/json", "a/b", "", "-x", "sbx-1?all=1"):
        with pytest.raises(NotFound):
            world.manager.get(hostile)


class FakeBinds:
    """A bind guard whose pins and checks are scripted: the kernel's own are test_beneath's."""

    def __init__(self, swapped: bool = False) -> None:
        self.swapped = swapped
        self.verified: list[tuple[int, Pinned]] = []
        self.ids = (1000, 1000)  # what the sandbox's process runs as, per the kernel
        self.owned: list[tuple[str, int, int]] = []
        self.staging: dict[str, tuple[str, ...]] = {}  # sandbox id -> its staging points
        self.unstaged: list[str] = []
        self.waited: list[bool] = []

    def pin(self, source: str, target: str, roots: tuple[BindRoot, ...]) -> Pinned:
        assert [root.path for root in roots] == [PurePosixPath("/srv/ws/al-ice")], "their own"
        assert roots[0].user_part == 3, "al-ice's own directory is theirs, the rest root's"
        return Pinned(source=source.replace("/alias/", "/real/"), target=target, device=1, inode=2)

    def verify(self, pid: int, pinned: Pinned) -> None:
        self.verified.append((pid, pinned))
        if self.swapped:
            raise PolicyViolation("changed while the sandbox was created", code="policy_mount")

    def ids_of(self, pid: int) -> tuple[int, int]:
        return self.ids

    def own(self, pid: int, target: str, source: str, uid: int, gid: int) -> None:
        assert target == "/workspace"
        self.owned.append((source, uid, gid))

    def stage(self, sandbox_id: str, pinned: tuple[Pinned, ...]) -> tuple[str, ...]:
        assert sandbox_id not in self.staging
        self.staging[sandbox_id] = tuple(f"/stage/{sandbox_id}/{n}" for n in range(len(pinned)))
        return self.staging[sandbox_id]

    def unstage(self, sandbox_id: str, *, wait: bool = False) -> None:
        self.staging.pop(sandbox_id, None)
        self.unstaged.append(sandbox_id)
        self.waited.append(wait)

    def staged(self) -> list[str]:
        return sorted(self.staging)


def bind_world(binds: FakeBinds, extra: str = "") -> World:
    world = World('bind_roots = ["/srv/ws/{user}"]\n' + extra, binds)
    world.docker.volume_root = "/fake/volumes"
    world.docker.create_volume("cache", volume_labels("al-ice"))
    return world


BINDS = [
    Mount(source="/srv/ws/al-ice/alias/src", target="/workspace"),
    Mount(kind=MountKind.VOLUME, source="cache", target="/cache"),
]


def test_docker_gets_the_staged_source_and_the_mount_is_checked_once_running() -> None:
    # Docker used to get the pinned path itself: a name the caller could swap for a symlink
    # between the check and runc's mount.
    binds = FakeBinds()
    world = bind_world(binds)
    box = created(world.manager, spec(mounts=BINDS), owner=(1000, 1000))
    request = world.docker.requests[box.container_id]
    assert [m.source for m in request.mounts] == [f"/stage/{box.id}/0", "cache"]
    pid = world.docker.sandbox_pid(box.container_id)
    assert [(p, pinned.target) for p, pinned in binds.verified] == [(pid, "/workspace")]
    assert binds.verified[0][1].source == "/srv/ws/al-ice/real/src", "checked against the pin"
    assert (binds.staging, binds.unstaged) == ({}, [box.id]), "unstaged once running"


def test_a_source_swapped_before_the_mount_undoes_the_create() -> None:
    binds = FakeBinds(swapped=True)
    world = bind_world(binds)
    with pytest.raises(PolicyViolation, match="changed while"):
        created(world.manager, spec(mounts=BINDS, command=("evil",)), owner=(1000, 1000))
    assert world.docker.containers == {}
    assert world.user_slices() == set()
    assert world.docker.released == [], "the caller's command never ran"
    assert binds.staging == {}
    assert len(binds.unstaged) == 1


def test_a_sandboxs_own_command_waits_for_its_mounts_to_be_checked() -> None:
    # Its command used to be the container's main process: it ran before the check.
    binds = FakeBinds()
    world = bind_world(binds)
    command = ("sh", "-c", 'printf \'%s|\' "$0" "$1"', "a 'b'\\n", "two\nlines")
    box = created(world.manager, spec(mounts=BINDS, command=command), owner=(1000, 1000))
    request = world.docker.requests[box.container_id]
    assert (request.command, request.open_stdin) == (WAITER_COMMAND, True)
    assert not box.lineage.launcher, "no one-shot run may launch into it"
    [(released_in, line)] = world.docker.released
    assert released_in == box.container_id
    ran = subprocess.run(WAITER_COMMAND, input=line, capture_output=True, check=True)
    assert ran.stdout == b"a 'b'\\n|two\nlines|", "the waiter becomes the command, word for word"


def test_without_binds_nothing_is_staged_and_the_command_runs_as_before() -> None:
    binds = FakeBinds()
    world = bind_world(binds)
    box = created(world.manager, spec(command=("sleep", "9")))
    assert world.docker.requests[box.container_id].command == ("sleep", "9")
    assert (binds.unstaged, world.docker.released) == ([], [])


def test_the_reaper_sweep_removes_staging_points_no_create_holds() -> None:
    binds = FakeBinds()
    world = bind_world(binds)
    binds.staging = {"sb-killed": ("/stage/sb-killed/0",)}  # an agent killed mid-create
    assert world.manager.sweep_staging() == ["sb-killed"]
    assert binds.staging == {}
    assert binds.waited == [True], "removed before the pass ends: `slicebox reap` says done"


def test_another_users_root_is_refused_before_anything_is_pinned() -> None:
    binds = FakeBinds()
    world = bind_world(binds)
    with pytest.raises(PolicyViolation, match="outside the allowed roots /srv/ws/al-ice"):
        created(world.manager, spec(mounts=[Mount(source="/srv/ws/bob/src", target="/w")]))
    assert binds.verified == []
    assert world.docker.containers == {}


# --- workspaces and who a sandbox runs as ------------------------------------------------------


def test_a_sandbox_runs_as_the_configured_non_root_default(world: World) -> None:
    box = created(world.manager, spec())
    assert world.docker.requests[box.container_id].user == "65534:65534"


def test_a_host_workspace_is_bound_at_workspace_and_runs_as_its_owner() -> None:
    binds = FakeBinds()
    world = bind_world(binds)
    workspace = {"kind": "host", "path": "/srv/ws/al-ice/alias/code"}
    box = created(world.manager, spec(workspace=workspace), owner=(1234, 99))
    request = world.docker.requests[box.container_id]
    assert request.user == "1234:99", "what the sandbox writes there is the caller's"
    assert [(m.kind, m.source, m.target, m.read_only) for m in request.mounts] == [
        (MountKind.BIND, f"/stage/{box.id}/0", "/workspace", False)
    ]
    assert [(p.source, p.target) for _, p in binds.verified] == [
        ("/srv/ws/al-ice/real/code", "/workspace")
    ]


def test_a_host_workspace_outside_the_callers_root_is_refused_with_nothing_made() -> None:
    world = bind_world(FakeBinds())
    with pytest.raises(PolicyViolation, match="outside the allowed roots") as refused:
        created(world.manager, spec(workspace={"kind": "host", "path": "/srv/ws/bob/code"}))
    assert refused.value.code == "policy_mount"
    assert world.docker.containers == {}
    assert world.user_slices() == set()


@pytest.mark.parametrize(
    ("fields", "config", "why"),
    [
        ({"run_as": "0:0"}, "", "may not run as uid 0"),
        ({"run_as": "root"}, "", "may not run as uid 0"),
        (
            {"run_as": "0", "workspace": {"kind": "host", "path": "/srv/ws/al-ice/code"}},
            'root_users = ["al-ice"]\n',
            "writable host mount",
        ),
    ],
)
def test_uid_0_is_refused_unless_allowed_and_never_with_a_writable_host_mount(
    fields: dict[str, object], config: str, why: str
) -> None:
    world = bind_world(FakeBinds(), config)
    with pytest.raises(PolicyViolation, match=why) as refused:
        created(world.manager, spec(**fields))
    assert refused.value.code == "policy_root"
    assert world.docker.containers == {}


def test_uid_0_is_refused_for_a_root_user_with_a_read_only_host_workspace_too() -> None:
    world = bind_world(FakeBinds(), 'root_users = ["al-ice"]\n')
    workspace = {"kind": "host", "path": "/srv/ws/al-ice/code", "read_only": True}
    with pytest.raises(PolicyViolation) as refused:  # any host bind runs as its owner
        created(world.manager, spec(run_as="0:0", workspace=workspace), owner=(1234, 99))
    assert refused.value.code == "policy_run_as"
    assert world.docker.containers == {}


def test_a_user_name_that_is_uid_0_in_the_image_is_found_running_and_undone() -> None:
    binds = FakeBinds()
    binds.ids = (0, 0)  # the image's passwd maps "toor" to uid 0
    world = bind_world(binds)
    with pytest.raises(PolicyViolation, match="may not run as uid 0"):
        created(world.manager, spec(run_as="toor"))
    assert world.docker.containers == {}
    assert world.user_slices() == set()


def test_a_volume_workspace_is_made_with_lineage_given_to_the_sandbox_and_goes_with_it() -> None:
    binds = FakeBinds()
    world = bind_world(binds)
    box = created(world.manager, spec(workspace={"kind": "volume"}, root_task_id="t1"))
    name = f"slicebox-al-ice-{box.id.replace('-', '_')}"
    request = world.docker.requests[box.container_id]
    assert [(m.kind, m.source, m.target) for m in request.mounts] == [
        (MountKind.VOLUME, name, "/workspace")
    ]
    lineage = decode_volume(world.docker.volume_table[name].labels)
    assert lineage is not None
    assert (lineage.user, lineage.root_task_id, lineage.keep) == ("al-ice", "t1", False)
    assert binds.owned == [(f"/fake/volumes/{name}", 65534, 65534)]
    assert box.lineage.workspace_volume == name
    world.manager.destroy(box.id)
    assert name not in world.docker.volume_table


def test_a_volume_stays_while_its_root_task_has_a_sandbox_and_when_kept() -> None:
    world = bind_world(FakeBinds())
    shared = {"kind": "volume", "name": "src"}
    first = created(world.manager, spec(workspace=shared, root_task_id="t1"))
    second = created(world.manager, spec(workspace=shared, root_task_id="t1"))
    world.manager.destroy(first.id)
    assert "slicebox-al-ice-src" in world.docker.volume_table, "its root task goes on"
    world.manager.destroy(second.id)
    assert "slicebox-al-ice-src" not in world.docker.volume_table
    kept = created(world.manager, spec(workspace={"kind": "volume", "name": "k", "keep": True}))
    world.manager.destroy(kept.id)
    assert "slicebox-al-ice-k" in world.docker.volume_table


def test_a_kept_volume_is_mounted_again_by_name_and_not_given_away_twice() -> None:
    binds = FakeBinds()
    world = bind_world(binds)
    world.docker.create_volume("slicebox-al-ice-k", volume_labels("al-ice", keep=True))
    box = created(world.manager, spec(workspace={"kind": "volume", "name": "k"}))
    assert world.docker.requests[box.container_id].mounts[0].source == "slicebox-al-ice-k"
    assert binds.owned == [], "a volume in use keeps its owner"


@pytest.mark.parametrize(
    ("labels", "error", "code"),
    [
        ({"other": "label"}, PolicyViolation, "volume_foreign"),
        (volume_labels("bob"), Forbidden, "volume_not_owned"),
    ],
)
def test_a_foreign_or_another_users_volume_is_refused_with_nothing_made(
    labels: dict[str, str], error: type[Exception], code: str
) -> None:
    world = bind_world(FakeBinds())
    world.docker.create_volume("db", labels)
    world.docker.create_volume("slicebox-al-ice-db", labels)
    for fields in (
        {"mounts": [{"kind": "volume", "source": "db", "target": "/data"}]},
        {"workspace": {"kind": "volume", "name": "db"}},
    ):
        with pytest.raises(error) as refused:
            created(world.manager, spec(**fields))
        assert getattr(refused.value, "code", None) == code
    assert world.docker.containers == {}
    assert world.user_slices() == set()
    assert set(world.docker.volume_table) == {"cache", "db", "slicebox-al-ice-db"}


def test_a_missing_volume_in_mounts_is_refused_rather_than_made_by_docker() -> None:
    world = bind_world(FakeBinds())
    with pytest.raises(PolicyViolation) as refused:
        created(world.manager, spec(mounts=[{"kind": "volume", "source": "nope", "target": "/d"}]))
    assert refused.value.code == "mount_source_missing"
    assert "nope" not in world.docker.volume_table


def test_volume_names_of_two_users_never_meet() -> None:
    """al's ice-b would be slicebox-al-ice-b, al-ice's b: a name holds no '-'."""
    with pytest.raises(InvalidRequest) as refused:
        parse_spec({"user": "al", "project": "p", "workspace": {"kind": "volume", "name": "ice-b"}})
    assert refused.value.code == "invalid_workspace"


def test_a_failed_start_removes_the_volume_it_made() -> None:
    world = bind_world(FakeBinds())
    world.docker.fail_start = True
    with pytest.raises(InvalidRequest):
        created(world.manager, spec(workspace={"kind": "volume", "name": "w"}))
    assert "slicebox-al-ice-w" not in world.docker.volume_table


def test_a_container_s_labels_are_decoded_once_whatever_its_state_later(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reaper pass reads every container's labels; they never change, so each container's
    are validated once. Other labels under the same id (no Docker makes them) decode anew."""
    made = created(world.manager, spec())
    info = world.docker.containers[made.container_id]
    decodes = Counter[str]()

    def counted(labels: dict[str, str]) -> object:
        decodes[labels["slicebox.sandbox_id"]] += 1
        return decode(labels)

    monkeypatch.setattr(sandbox, "decode", counted)
    first = sandbox.Sandbox.from_info(info)
    exited = sandbox.Sandbox.from_info(info.model_copy(update={"state": SandboxState.EXITED}))
    assert (first.state, exited.state) == (SandboxState.RUNNING, SandboxState.EXITED)
    assert exited.lineage == first.lineage == made.lineage
    assert decodes == {}, "decoded once already, at its create"
    other = {**info.labels, "slicebox.sandbox_id": "sbx-other0000000"}
    assert sandbox.Sandbox.from_info(info.model_copy(update={"labels": other})).id == (
        "sbx-other0000000"
    )
    assert decodes == {"sbx-other0000000": 1}
