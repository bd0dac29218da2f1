"""The sandbox lifecycle on a real host: placement, lineage, hardening and kernel ceilings.

Each test asserts what the kernel and Docker did (cgroup membership, memory.events, pids.current,
docker inspect), never only what slicebox asked for. Container starts are kept few: ~13.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import docker
import pytest

from slicebox.backends.docker import DockerBackend
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.config import Config, parse_config, read_host_memory
from slicebox.model.errors import SliceboxError
from slicebox.model.labels import selector
from slicebox.model.names import MANAGED_SLICE, slice_names
from slicebox.model.spec import Mount, SandboxSpec
from tests.fakes.threadside import created
from tests.host.helpers import TEST_IMAGE, unique, wait_for
from tests.host.sliceboxhost import (
    active,
    cleanup_slices,
    events,
    read,
    reap_empty_slices,
    slicebox_units,
)

pytestmark = pytest.mark.host
MiB = 1024 * 1024
# dd holds its 150 MB buffer while blocked writing into a pipe nobody reads.
HOG = ("sh", "-c", "dd if=/dev/zero bs=150M count=1 | sleep 600")
# ash exits when a fork fails, so the bomb runs in a subshell and its sleeps outlive it.
BOMB = "(for i in $(seq 80); do sleep 600 & done) ; exec sleep 600"


class Env:
    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client
        self.instance = unique("test-")
        self.user = unique("u-")  # a dash, so unit names need escaping
        self.config = parse_config(
            f'default_image = "{TEST_IMAGE}"\nbind_roots = ["/srv/sbx-roots"]\n'
            f'[projects."{self.user}/tight"]\nmemory = "400MB"\n'
            f'[projects."{self.user}/pids"]\npids = 40\n'
        )

    def manager(self, config: Config | None = None) -> SandboxManager:
        return SandboxManager(
            DockerBackend.from_env(),
            SliceManager(PystemdSystemd()),
            config=config or self.config,
            host_memory=read_host_memory(),
            instance_id=self.instance,
        )

    def leftovers(self, user: str) -> tuple[list[str], list[str]]:
        found = self.client.api.containers(all=True, filters={"label": f"slicebox.user={user}"})
        return [c["Id"] for c in found], slicebox_units(slice_names(user, "x").user[:-6] + "*")


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    client = docker.from_env()
    managed_was_active = active(MANAGED_SLICE)
    box = Env(client)
    yield box
    for found in client.api.containers(
        all=True, filters={"label": f"slicebox.instance_id={box.instance}"}
    ):
        client.api.remove_container(found["Id"], force=True)
    cleanup_slices(*slicebox_units("slicebox-*"))
    if not managed_was_active:
        cleanup_slices(MANAGED_SLICE)
    client.close()


def spec(env: Env, project: str, **fields: object) -> SandboxSpec:
    return SandboxSpec.model_validate({"user": env.user, "project": project, **fields})


def sandbox_pid(env: Env, sandbox: Sandbox) -> int:
    return int(env.client.api.inspect_container(sandbox.container_id)["State"]["Pid"])


def pid_cgroup(env: Env, sandbox: Sandbox) -> str:
    pid = sandbox_pid(env, sandbox)
    return Path(f"/proc/{pid}/cgroup").read_text().strip().removeprefix("0::")


def test_sandbox_in_its_scope_with_lineage_limits_and_hardening(env: Env) -> None:
    manager = env.manager()
    box = created(manager, spec(env, "demo-1.x", command=("sleep", "600"), task_id="task-1"))
    try:
        scope = box.scope_cgroup()
        cgroups = box.slice_cgroups()
        assert "/sys/fs/cgroup" + pid_cgroup(env, box) == str(scope)
        assert scope.parent == cgroups.project
        assert cgroups.project.parent == cgroups.user
        assert cgroups.user.parent == cgroups.managed
        assert cgroups.managed == PurePosixPath("/sys/fs/cgroup/slicebox.slice")
        assert Path(str(scope)).is_dir()
        labels = env.client.api.inspect_container(box.container_id)["Config"]["Labels"]
        assert labels["slicebox.managed"] == "true"
        assert labels["slicebox.user"] == env.user
        assert labels["slicebox.project"] == "demo-1.x"
        assert labels["slicebox.task_id"] == labels["slicebox.root_task_id"] == "task-1"
        assert labels["slicebox.parent_id"] == ""
        assert labels["slicebox.depth"] == "0"
        assert labels["slicebox.instance_id"] == env.instance
        assert labels["slicebox.provisioned.memory_bytes"] == str(256 * MiB)
        assert labels["slicebox.provisioned.cpu"] == "0.5"
        assert labels["slicebox.expires_at"] > labels["slicebox.created_at"]
        host = env.client.api.inspect_container(box.container_id)["HostConfig"]
        # What the kernel enforces, whichever engine says it how (Podman lists the dropped
        # capabilities where Docker says ALL): no capability at all, no new privileges.
        status = dict(
            line.split(":\t", 1)
            for line in Path(f"/proc/{sandbox_pid(env, box)}/status").read_text().splitlines()
        )
        assert {status[c] for c in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == {
            "0000000000000000"
        }
        assert status["NoNewPrivs"] == "1"
        assert not host["CapAdd"]
        assert host["NetworkMode"] == "none"
        assert host["Privileged"] is False
        assert host["PidsLimit"] == 100
        assert host["Memory"] == 256 * MiB
        assert host["NanoCpus"] == 500_000_000
        assert host["Init"] is True
        assert read(scope, "memory.max").strip() == str(256 * MiB)
        assert read(scope, "pids.max").strip() == "100"
        assert read(scope, "cpu.max").split()[0] == "50000"
        assert manager.get(box.id) == box
        assert [s.id for s in manager.find(user=env.user, task_id="task-1")] == [box.id]
    finally:
        gone = manager.destroy(box.id)
    assert gone is not None
    assert gone.id == box.id
    assert manager.destroy(box.id) is None, "destroy is idempotent"
    reap_empty_slices(manager, env.user)
    assert env.leftovers(env.user) == ([], [])
    assert not Path(str(cgroups.user)).exists()


def test_project_ceiling_oom_kills_inside_that_project_only(env: Env) -> None:
    manager = env.manager()
    other = created(manager, spec(env, "roomy", command=HOG, memory="200MB"))
    tight = [created(manager, spec(env, "tight", command=HOG, memory="200MB")) for _ in range(3)]
    try:
        project = tight[0].slice_cgroups().project
        assert read(project, "memory.max").strip() == str(400 * MiB)
        wait_for(lambda: events(project)["oom_kill"] >= 1, timeout=60)
        assert events(project)["oom"] >= 1, "the project's own limit was reached"
        assert all(events(box.scope_cgroup())["oom"] == 0 for box in tight), (
            "no sandbox hit its own 200 MB: the kill came from the project ceiling"
        )
        assert int(read(project, "memory.peak")) <= 400 * MiB
        print("project", events(project), "peak", read(project, "memory.peak").strip())
        other_scope = other.scope_cgroup()
        assert events(other_scope)["oom_kill"] == 0
        assert events(other.slice_cgroups().project)["oom"] == 0
        assert int(read(other_scope, "memory.current")) > 140 * MiB, "still holds its memory"
        assert env.client.api.inspect_container(other.container_id)["State"]["Running"]
    finally:
        for box in [*tight, other]:
            manager.destroy(box.id)
    reap_empty_slices(manager, env.user)
    assert env.leftovers(env.user) == ([], [])


def test_fork_bombs_main_and_exec_stay_under_project_tasksmax(env: Env) -> None:
    manager = env.manager()
    main = created(manager, spec(env, "pids", command=("sh", "-c", BOMB), pids=30))
    other = created(manager, spec(env, "pids", command=("sleep", "600"), pids=30))
    try:
        project = main.slice_cgroups().project
        assert read(project, "pids.max").strip() == "40"
        wait_for(lambda: int(read(main.scope_cgroup(), "pids.current")) >= 25, timeout=60)
        env.client.api.exec_start(
            env.client.api.exec_create(other.container_id, ["sh", "-c", BOMB]), detach=True
        )
        wait_for(lambda: int(read(project, "pids.current")) >= 38, timeout=60)
        time.sleep(2)
        assert int(read(project, "pids.current")) <= 40
        assert int(read(main.scope_cgroup(), "pids.current")) <= 30
        assert int(read(other.scope_cgroup(), "pids.current")) < 30, (
            "the exec'd bomb was stopped by the project's TasksMax, before its own 30"
        )
        assert events(project, "pids.events")["max"] >= 1
        print("pids", read(project, "pids.current"), read(other.scope_cgroup(), "pids.current"))
    finally:
        manager.destroy(main.id)
        manager.destroy(other.id)
    reap_empty_slices(manager, env.user)
    assert env.leftovers(env.user) == ([], [])


def test_user_ceiling_caps_the_sum_of_its_projects(env: Env) -> None:
    user = unique("capped-")
    config = env.config.model_copy(
        update={"users": {user: parse_config('[user]\nmemory = "250MB"').user}}
    )
    manager = env.manager(config)
    boxes = [
        created(manager, SandboxSpec(user=user, project=p, command=HOG, memory="200MB"))
        for p in ("one", "two")
    ]
    try:
        user_cgroup = boxes[0].slice_cgroups().user
        assert read(user_cgroup, "memory.max").strip() == str(250 * MiB)
        wait_for(lambda: events(user_cgroup)["oom_kill"] >= 1, timeout=60)
        assert events(user_cgroup)["oom"] >= 1
        print("user", events(user_cgroup), "peak", read(user_cgroup, "memory.peak").strip())
        for box in boxes:
            assert events(box.slice_cgroups().project)["oom"] == 0, "no project limit was hit"
    finally:
        for box in boxes:
            manager.destroy(box.id)
    reap_empty_slices(manager, user)
    assert env.leftovers(user) == ([], [])


REFUSED: list[tuple[dict[str, object], str]] = [
    ({"privileged": True}, "policy_privileged"),
    ({"network": "host"}, "policy_host_namespace"),
    ({"pid_mode": "host"}, "policy_host_namespace"),
    ({"ipc_mode": "host"}, "policy_host_namespace"),
    ({"cap_add": ["SYS_ADMIN"]}, "policy_capability"),
    ({"mounts": [Mount(source="/etc", target="/x")]}, "policy_mount"),
    ({"mounts": [Mount(source="/srv/sbx-roots/../../etc", target="/x")]}, "mount_escape"),
    ({"mounts": [Mount(source="/srv/sbx-roots/absent", target="/x")]}, "mount_source_missing"),
    ({"memory": 0}, "invalid_limit"),
    ({"memory": "lots"}, "invalid_limit"),
    ({"cpus": -1}, "invalid_limit"),
    ({"pids": 0}, "invalid_limit"),
    ({"memory": "3GB"}, "admission_refused"),  # the project default is 2GB
    ({"project": "../etc"}, "invalid_name"),
    ({"image": "slicebox-test/absent:1"}, "image_unavailable"),
    ({"run_as": "nosuchuser"}, "container_start_failed"),
    ({"run_as": "0:0"}, "policy_root"),
    ({"mounts": [Mount(kind="volume", source="absent", target="/x")]}, "mount_source_missing"),
]


# Who the socket says a caller is (its kernel-given uid and NSS primary gid): a host bind runs as
# exactly them (policy.check_host_run_as). The test users have no passwd entry, so the default
# non-root uid stands in.
NOBODY = (65534, 65534)


def create_error(manager: SandboxManager, fields: dict[str, object]) -> str:
    try:
        box = created(manager, SandboxSpec.model_validate(fields), owner=NOBODY)
    except SliceboxError as exc:
        return exc.code
    manager.destroy(box.id)
    return "accepted"


def test_every_refused_request_returns_its_error_and_leaves_nothing(env: Env) -> None:
    user = unique("refused-")
    manager = env.manager()
    outcomes = []
    # The bind root, as an operator makes it (root's, writable by nobody else): one that is
    # not there is refused bind_root_unsafe before any source under it is looked at.
    root = Path("/srv/sbx-roots")
    made = not root.exists()
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        for fields, _ in REFUSED:
            outcomes.append(create_error(manager, {"user": user, "project": "p", **fields}))
            assert env.leftovers(user) == ([], []), f"{fields} left something behind"
    finally:
        if made:
            root.rmdir()
    assert outcomes == [code for _, code in REFUSED]


def test_a_symlink_planted_through_a_writable_bind_cannot_reach_the_hosts_root(env: Env) -> None:
    """A sandbox with a writable bind plants ``esc -> /``; a create that mounts ``esc`` would
    get the host's root (uid 0 in the container, no user namespace). The kernel's walk beneath
    the root refuses it, and the other ways out: another user's root, another mount on the way,
    a source that is not there (which Docker must not create as root)."""
    base = Path("/srv/sbx-binds")
    mine, theirs = base / env.user, base / unique("other-")
    config = env.config.model_copy(update={"bind_roots": (PurePosixPath(base, "{user}"),)})
    manager = env.manager(config)
    (mine / "ws" / "sub").mkdir(parents=True)
    (theirs / "ws").mkdir(parents=True)
    os.chown(mine / "ws", 65534, 65534)  # the sandbox runs as the default non-root uid
    # The user's own directory of the root is theirs (a user no passwd knows: the default
    # uid's); the rest of the root's path root's (host.beneath.open_root).
    os.chown(mine, 65534, 65534)
    boxes: list[Sandbox] = []
    mounted = mine / "ws" / "mnt"

    def bind(source: Path, project: str = "binds") -> SandboxSpec:
        mount = Mount(source=str(source), target="/workspace")
        return spec(env, project, command=("sleep", "600"), mounts=[mount])

    def refusal(source: Path) -> tuple[str, str]:
        with pytest.raises(SliceboxError) as refused:
            boxes.append(created(manager, bind(source, "refused"), owner=NOBODY))
        return refused.value.code, refused.value.message

    try:
        boxes.append(created(manager, bind(mine / "ws"), owner=NOBODY))
        planted = env.client.containers.get(boxes[0].container_id).exec_run(
            ["ln", "-s", "/", "/workspace/esc"]
        )
        assert planted.exit_code == 0, planted.output
        assert (mine / "ws" / "esc").is_symlink(), "the sandbox really wrote on the host"
        escape = ("mount_escape", "goes through a symlink")
        assert _said(refusal(mine / "ws" / "esc")) == escape
        assert _said(refusal(mine / "ws" / "esc" / "etc")) == escape
        assert _said(refusal(theirs / "ws")) == ("policy_mount", "outside the allowed roots")
        mounted.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mounted)], check=True)
        assert _said(refusal(mounted)) == ("mount_escape", "goes through another mount")
        missing = _said(refusal(mine / "ws" / "absent"))
        assert missing == ("mount_source_missing", "does not exist")
        assert not (mine / "ws" / "absent").exists(), "nothing made the missing source"
        assert env.leftovers(env.user)[0] == [boxes[0].container_id]

        boxes.append(created(manager, bind(mine / "ws" / "sub"), owner=NOBODY))
        inside = env.client.api.inspect_container(boxes[1].container_id)["Mounts"]
        # Docker got the root-owned staging point (host.staging), gone once the sandbox ran;
        # what the sandbox has there is the directory that was pinned.
        assert [(m["Type"], m["Source"], m["Destination"]) for m in inside] == [
            ("bind", f"/run/slicebox/stage/{boxes[1].id}/0", "/workspace")
        ]
        wait_for(lambda: not Path("/run/slicebox/stage", boxes[1].id).exists(), timeout=60)
        pid = env.client.api.inspect_container(boxes[1].container_id)["State"]["Pid"]
        seen, sub = os.lstat(f"/proc/{pid}/root/workspace"), os.stat(mine / "ws" / "sub")
        assert (seen.st_dev, seen.st_ino) == (sub.st_dev, sub.st_ino)
    finally:
        for box in boxes:
            manager.destroy(box.id)
        subprocess.run(["umount", str(mounted)], check=False)
        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(theirs, ignore_errors=True)
    reap_empty_slices(manager, env.user)


def _said(refused: tuple[str, str]) -> tuple[str, str]:
    """The code, and which of the known reasons the message gives."""
    code, message = refused
    reasons = [
        "goes through a symlink",
        "goes through another mount",
        "outside the allowed roots",
        "does not exist",
    ]
    return code, next((r for r in reasons if r in message), message)


def test_cascade_destroys_a_root_task_deepest_first(env: Env) -> None:
    manager = env.manager()
    root = created(manager, spec(env, "tree", command=("sleep", "600"), task_id="root-t"))
    child = created(manager, spec(env, "tree", command=("sleep", "600"), parent_id=root.id))
    grandchild = created(manager, spec(env, "tree", command=("sleep", "600"), parent_id=child.id))
    assert [b.lineage.depth for b in (root, child, grandchild)] == [0, 1, 2]
    assert {b.lineage.root_task_id for b in (root, child, grandchild)} == {"root-t"}
    assert grandchild.lineage.parent_id == child.id
    gone = manager.destroy_tree("root-t")
    assert [b.id for b in gone] == [grandchild.id, child.id, root.id]
    assert (
        env.client.api.containers(
            all=True,
            filters={"label": [f"{k}={v}" for k, v in selector(root_task_id="root-t").items()]},
        )
        == []
    )
    reap_empty_slices(manager, env.user)
    assert env.leftovers(env.user) == ([], [])
