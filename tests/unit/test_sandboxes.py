from __future__ import annotations

import itertools
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import PurePosixPath

import pytest

from slicebox.backends.base import SandboxInfo, SandboxState
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.beneath import BindGuard, Pinned
from slicebox.model.config import parse_config
from slicebox.model.errors import (
    HostError,
    ImageUnavailable,
    InvalidRequest,
    NotFound,
    PolicyViolation,
)
from slicebox.model.labels import decode
from slicebox.model.limits import Limits
from slicebox.model.names import MANAGED_SLICE
from slicebox.model.spec import Mount, MountKind, SandboxSpec
from tests.fakes.counting import counting
from tests.fakes.docker import FakeDocker
from tests.fakes.systemd import FakeSystemd

MiB = 1024 * 1024
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


class World:
    def __init__(
        self,
        config: str = '[projects."al-ice/p"]\nmemory = "400MB"\n',
        binds: BindGuard | None = None,
    ) -> None:
        self.systemd = FakeSystemd()
        self.docker = FakeDocker(self.systemd)
        ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        self.manager = SandboxManager(
            self.docker,
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
    box = world.manager.create(spec(memory="200MB", ttl_seconds=60, env={"TOKEN": "s3cret"}))
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
    first = world.manager.create(spec())
    second = world.manager.create(spec(project="q"))
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
        world.manager.destroy(world.manager.create(spec()).id)
    slice_calls = [(call, unit) for call, unit in world.systemd.calls if unit.endswith(".slice")]
    made = [unit for call, unit in slice_calls if call == "start_transient"]
    assert made == [MANAGED_SLICE, "slicebox-al\\x2dice.slice", "slicebox-al\\x2dice-p.slice"]
    assert [unit for call, unit in slice_calls if call in ("stop", "start")] == []


def test_a_create_into_a_kept_slice_gives_it_the_ceiling_in_force(world: World) -> None:
    world.manager.destroy(world.manager.create(spec()).id)
    assert world.systemd.properties["slicebox-al\\x2dice-p.slice"]["MemoryMax"] == 400 * MiB
    world.manager.reconfigure(parse_config('[projects."al-ice/p"]\nmemory = "300MB"\n'))
    world.manager.create(spec())
    assert world.systemd.properties["slicebox-al\\x2dice-p.slice"]["MemoryMax"] == 300 * MiB


def test_destroy_while_another_removal_runs_is_idempotent(world: World) -> None:
    box = world.manager.create(spec())
    world.docker.begin_removal(box.container_id)  # say, the reaper's destroy of it
    assert world.manager.destroy(box.id) == box, "no error: the sandbox is on its way out"
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
    world.manager.create(spec(project="one"))
    with pytest.raises(HostError) as taken:
        world.manager.create(spec(project="two"))
    assert taken.value.code == "sandbox_name_conflict"
    assert "slicebox-al\\x2dice-two.slice" not in world.systemd.running


def test_cascade_destroys_deepest_first(world: World) -> None:
    root = world.manager.create(spec(task_id="t"))
    child = world.manager.create(spec(parent_id=root.id))
    grandchild = world.manager.create(spec(parent_id=child.id))
    other = world.manager.create(spec())
    assert (child.lineage.depth, grandchild.lineage.depth) == (1, 2)
    assert grandchild.lineage.root_task_id == "t"
    gone = world.manager.destroy_tree("t")
    assert [b.id for b in gone] == [grandchild.id, child.id, root.id]
    assert world.docker.removed == [b.container_id for b in gone]
    assert [b.id for b in world.manager.find(user="al-ice")] == [other.id]


def test_child_of_another_users_sandbox_is_not_found(world: World) -> None:
    parent = world.manager.create(spec(user="bob"))
    with pytest.raises(NotFound):
        world.manager.create(spec(parent_id=parent.id))
    with pytest.raises(InvalidRequest, match="root_task_id"):
        world.manager.create(spec(user="bob", parent_id=parent.id, root_task_id="other"))


def test_missing_image_is_pulled_or_refused_before_anything_exists(world: World) -> None:
    world.docker.registry.add("busybox:1")
    assert world.manager.create(spec(image="busybox:1")).id
    with pytest.raises(ImageUnavailable):
        world.manager.create(spec(user="z", image="nope:1"))
    assert not any("slicebox-z" in u for u in world.systemd.running)


def test_an_image_a_create_found_is_not_checked_again_unless_a_create_misses_it(
    world: World,
) -> None:
    """One backend call fewer per create: the create itself tells a missing image."""
    calls: Counter[str] = Counter()
    world.manager._backend = counting(world.docker, calls, "docker")
    world.manager.create(spec())
    world.manager.create(spec())
    assert (calls["docker.prepare"], calls["docker.create"]) == (1, 2)
    world.docker.images.discard("alpine:3.19")  # removed by hand meanwhile; pullable
    world.docker.registry.add("alpine:3.19")
    assert world.manager.create(spec()).id
    assert (calls["docker.prepare"], calls["docker.create"]) == (2, 4), "pulled, tried again"
    world.docker.images.discard("alpine:3.19")
    world.docker.registry.discard("alpine:3.19")
    with pytest.raises(ImageUnavailable):
        world.manager.create(spec(project="new"))
    assert len(world.docker.containers) == 3
    assert "slicebox-al\\x2dice-new.slice" not in world.user_slices(), "its new slice is undone"
    with pytest.raises(ImageUnavailable):  # now unknown: refused before anything exists
        world.manager.create(spec(project="other"))
    assert calls["docker.create"] == 5


def test_failed_start_removes_container_and_new_slices(world: World) -> None:
    kept = world.manager.create(spec(project="keep"))
    world.docker.fail_start = True
    with pytest.raises(InvalidRequest):
        world.manager.create(spec(project="new"))
    assert [c.id for c in world.docker.containers.values()] == [kept.container_id]
    assert world.user_slices() == {"slicebox-al\\x2dice.slice", "slicebox-al\\x2dice-keep.slice"}


def test_failed_slice_start_undoes_the_user_slice(world: World) -> None:
    world.systemd.fail_start.add("slicebox-al\\x2dice-p.slice")
    with pytest.raises(HostError):
        world.manager.create(spec())
    assert world.user_slices() == set()
    assert world.docker.containers == {}


def test_get_unknown_is_not_found(world: World) -> None:
    with pytest.raises(NotFound):
        world.manager.get("sbx-nope")


def test_get_looks_up_the_name_and_believes_only_the_labels(world: World) -> None:
    box = world.manager.create(spec())
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

    def pin(self, source: str, target: str, roots: tuple[PurePosixPath, ...]) -> Pinned:
        assert roots == (PurePosixPath("/srv/ws/al-ice"),), "the caller's own root"
        return Pinned(source=source.replace("/alias/", "/real/"), target=target, device=1, inode=2)

    def verify(self, pid: int, pinned: Pinned) -> None:
        self.verified.append((pid, pinned))
        if self.swapped:
            raise PolicyViolation("changed while the sandbox was created", code="policy_mount")


def bind_world(binds: FakeBinds) -> World:
    return World('bind_roots = ["/srv/ws/{user}"]\n', binds)


BINDS = [
    Mount(source="/srv/ws/al-ice/alias/src", target="/workspace"),
    Mount(kind=MountKind.VOLUME, source="cache", target="/cache"),
]


def test_docker_gets_the_pinned_source_and_the_mount_is_checked_once_running() -> None:
    binds = FakeBinds()
    world = bind_world(binds)
    box = world.manager.create(spec(mounts=BINDS))
    request = world.docker.requests[box.container_id]
    assert [m.source for m in request.mounts] == ["/srv/ws/al-ice/real/src", "cache"]
    pid = world.docker.sandbox_pid(box.container_id)
    assert [(p, pinned.target) for p, pinned in binds.verified] == [(pid, "/workspace")]


def test_a_source_swapped_before_the_mount_undoes_the_create() -> None:
    world = bind_world(FakeBinds(swapped=True))
    with pytest.raises(PolicyViolation, match="changed while"):
        world.manager.create(spec(mounts=BINDS))
    assert world.docker.containers == {}
    assert world.user_slices() == set()


def test_another_users_root_is_refused_before_anything_is_pinned() -> None:
    binds = FakeBinds()
    world = bind_world(binds)
    with pytest.raises(PolicyViolation, match="outside the allowed roots /srv/ws/al-ice"):
        world.manager.create(spec(mounts=[Mount(source="/srv/ws/bob/src", target="/w")]))
    assert binds.verified == []
    assert world.docker.containers == {}
