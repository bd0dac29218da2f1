"""Pause, snapshots and forks through the installed agent (issue 45), as users alice and bob of
group slicebox meet them: a busy loop frozen and thawed with the same process, a paused
sandbox's exec refused, a sandbox's root filesystem and tmpfs /workspace snapshotted and forked
three times (each fork its own copy, no env or set-id bit carried over), bob kept from alice's
snapshots, the quota, bad names, and the agent killed mid-snapshot. Every sandbox, snapshot
image and slice made here is removed after."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.model.snapshots import snapshot_image
from tests.host.agentunits import (
    SOCKET,
    TEST_CONFIG,
    admin,
    installed_agent,
    prop,
    remove_sandboxes,
)
from tests.host.helpers import sh, wait_for

pytestmark = pytest.mark.host

ALICE, BOB = "sbxsnapa", "sbxsnapb"
SECRET = "hunter2-not-in-any-snapshot"
MAX_COUNT = 3
CONFIG = TEST_CONFIG + f'[snapshots]\nmax_count = {MAX_COUNT}\nmax_bytes = "200MB"\n'


def curl(user: str, method: str, path: str, body: object | None = None) -> list[str]:
    call = ["runuser", "-u", user, "--", "curl", "-s", "-m", "600"]
    call += ["--unix-socket", str(SOCKET), "-X", method]
    data = ["-H", "Content-Type: application/json", "-d", json.dumps(body)] if body else []
    return [*call, *data, f"http://localhost/v1{path}"]


def ask(user: str, method: str, path: str, body: object | None = None) -> dict[str, object]:
    out = subprocess.run(
        curl(user, method, path, body), capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    return found if isinstance(found, dict) else {"list": found}


def create(user: str, **fields: object) -> str:
    made = ask(user, "POST", "/sandboxes", {"project": "snap", **fields})
    assert "id" in made, made
    return str(made["id"])


def run(user: str, box: str, script: str, query: str = "") -> dict[str, object]:
    return ask(user, "POST", f"/sandboxes/{box}/exec{query}", {"argv": ["sh", "-c", script]})


def out(user: str, box: str, script: str) -> str:
    done = run(user, box, script)
    assert done.get("exit_code") == 0, done
    return base64.b64decode(str(done["stdout"])).decode()


def cpu(box: str) -> float:
    return float(admin().usage(box).cpu_seconds or 0.0)


def container(box: str) -> dict[str, object]:
    found = json.loads(sh("docker", "inspect", admin().get(box).container_id).stdout)[0]
    return dict(found)


def snapshot_images() -> list[str]:
    found = sh("docker", "images", "-q", "--filter", "label=slicebox-snapshot=true").stdout
    return sorted(set(found.split()))


@pytest.fixture(scope="module")
def agent() -> Iterator[None]:
    with installed_agent(CONFIG):
        for user in (ALICE, BOB):
            sh("userdel", user, check=False)
            sh("useradd", "--no-create-home", "--shell", "/bin/sh", "-G", "slicebox", user)
        sh("systemctl", "start", "slicebox.socket")
        try:
            yield
        finally:
            remove_sandboxes((ALICE, BOB))
            for image in snapshot_images():
                sh("docker", "rmi", "-f", image, check=False)
            for user in (ALICE, BOB):
                sh("userdel", user, check=False)


@pytest.fixture(scope="module")
def origin(agent: None) -> str:
    """alice's sandbox with a file in its root filesystem, one in its tmpfs /workspace, a
    set-uid copy of busybox of its own, and a secret in its env; its main process is a busy
    loop (an exec's leftover processes are taken with it), which writes its pid first."""
    loop = "echo $$ > /tmp/loop.pid; while :; do :; done"
    box = create(ALICE, env={"SECRET_TOKEN": SECRET}, command=["sh", "-c", loop])
    out(
        ALICE,
        box,
        "echo rootfs > /tmp/rootfs.txt && echo workspace > /workspace/ws.txt && "
        "mkdir /workspace/sub && echo deep > /workspace/sub/deep.txt && "
        "cp /bin/busybox /tmp/suid && chmod 4755 /tmp/suid && stat -c %a /tmp/suid",
    )
    return box


def test_a_paused_sandbox_uses_no_cpu_refuses_execs_and_resumes_the_same_process(
    origin: str,
) -> None:
    pid = out(ALICE, origin, "cat /tmp/loop.pid").strip()
    before = cpu(origin)
    wait_for(lambda: cpu(origin) > before + 0.2, timeout=30)
    assert ask(ALICE, "POST", f"/sandboxes/{origin}/pause") == {"id": origin, "paused": True}
    assert container(origin)["State"]["Paused"] is True  # type: ignore[index]
    assert admin().usage(origin).paused is True
    frozen = [
        node
        for user in admin().level_tree().children
        for project in user.children
        for node in project.children
        if admin().get(origin).container_id in node.unit
    ]
    assert [node.frozen for node in frozen] == [True]
    still = cpu(origin)
    time.sleep(2)
    assert cpu(origin) - still < 0.05, "a paused sandbox's loop still ran"
    refused = run(ALICE, origin, "true")
    assert refused.get("code") == "sandbox_paused", refused
    stat = ask(ALICE, "GET", f"/sandboxes/{origin}/files/stat?path=/tmp")
    assert stat.get("code") == "sandbox_paused", stat
    assert ask(ALICE, "POST", f"/sandboxes/{origin}/resume") == {"id": origin, "paused": False}
    resumed = cpu(origin)
    wait_for(lambda: cpu(origin) > resumed + 0.2, timeout=30)
    assert out(ALICE, origin, f"kill -0 {pid} && echo same") == "same\n"
    ask(ALICE, "POST", f"/sandboxes/{origin}/pause")
    woken = run(ALICE, origin, f"kill -0 {pid}", query="?resume=1")
    assert woken.get("exit_code") == 0, woken
    assert admin().usage(origin).paused is False


def test_a_snapshot_forked_three_times_gives_each_fork_its_own_copy(origin: str) -> None:
    taken = ask(ALICE, "POST", f"/sandboxes/{origin}/snapshots", {"name": "base"})
    assert taken.get("name") == "base", taken
    assert taken.get("origin") == origin, taken
    config = json.loads(sh("docker", "image", "inspect", snapshot_image(ALICE, "base")).stdout)
    assert SECRET not in json.dumps(config), "the create's env went into the snapshot"
    assert admin().usage(origin).paused is False, "the snapshot left its sandbox frozen"
    admin().destroy(origin)
    forking = ["create", "--project", "snap", "--from", "base", "--count", "3"]
    made = subprocess.run(
        ["runuser", "-u", ALICE, "--", "slicebox", *forking],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    forks = made.stdout.split()
    assert len(forks) == 3
    for fork in forks:
        seen = out(ALICE, fork, "cat /tmp/rootfs.txt /workspace/ws.txt /workspace/sub/deep.txt")
        assert seen == "rootfs\nworkspace\ndeep\n"
        assert out(ALICE, fork, "stat -c %a /tmp/suid") == "755\n", "a set-uid bit came back"
        assert SECRET not in out(ALICE, fork, "env")
        labels = container(fork)["Config"]["Labels"]  # type: ignore[index]
        assert labels["slicebox.from_snapshot"] == "base"
    # No copy was made: a fork's /workspace is its image's (copy-on-write), not a mount.
    assert out(ALICE, forks[0], "awk '$2 == \"/workspace\"' /proc/mounts") == ""
    out(ALICE, forks[0], "echo mine > /workspace/only0 && echo mine > /tmp/only0")
    out(ALICE, forks[0], "echo changed > /workspace/ws.txt")
    for fork in forks[1:]:
        assert out(ALICE, fork, "ls /workspace /tmp").count("only0") == 0
        assert out(ALICE, fork, "cat /workspace/ws.txt") == "workspace\n"
    hidden = ask(
        ALICE,
        "POST",
        "/sandboxes",
        {"project": "snap", "from_snapshot": "base", "workspace": {"kind": "volume"}},
    )
    assert hidden.get("code") == "snapshot_workspace", hidden
    native = ask(
        ALICE,
        "POST",
        "/sandboxes",
        {"project": "snap", "from_snapshot": "base", "backend": "native"},
    )
    assert native.get("code") == "backend_unsupported", native


def test_a_snapshot_of_a_fork_holds_what_the_fork_wrote(agent: None) -> None:
    """A fork's /workspace is in its root filesystem, which the engine's export holds too:
    a snapshot of it has the fork's /workspace once, as the fork saw it."""
    fork = next(v.id for v in admin().list_sandboxes() if v.user == ALICE)
    out(ALICE, fork, "echo again > /workspace/second.txt && rm /workspace/sub/deep.txt")
    taken = ask(ALICE, "POST", f"/sandboxes/{fork}/snapshots", {"name": "second"})
    assert taken.get("name") == "second", taken
    try:
        again = create(ALICE, from_snapshot="second")
        seen = out(ALICE, again, "cat /workspace/ws.txt /workspace/second.txt; ls /workspace/sub")
        assert seen == out(
            ALICE, fork, "cat /workspace/ws.txt /workspace/second.txt; ls /workspace/sub"
        )
        assert "again" in seen
        admin().destroy(again)
    finally:
        assert ask(ALICE, "DELETE", "/snapshots/second") == {"name": "second", "deleted": True}


def test_bob_cannot_list_fork_take_or_delete_alices_snapshots(agent: None) -> None:
    assert ask(BOB, "GET", "/snapshots") == {"list": []}
    names = [s["name"] for s in ask(ALICE, "GET", "/snapshots")["list"]]  # type: ignore[attr-defined]
    assert "base" in names
    forked = ask(BOB, "POST", "/sandboxes", {"project": "snap", "from_snapshot": "base"})
    assert forked.get("code") == "not_found", forked
    image = snapshot_image(ALICE, "base")
    image_id = sh("docker", "image", "inspect", "-f", "{{.Id}}", image).stdout.strip()
    for named in (image, image_id, image_id.removeprefix("sha256:")[:2]):
        direct = ask(BOB, "POST", "/sandboxes", {"project": "snap", "image": named})
        assert direct.get("code") == "invalid_field", (named, direct)
    assert ask(BOB, "DELETE", "/snapshots/base").get("code") == "not_found"
    alices = next(v for v in admin().list_sandboxes() if v.user == ALICE)
    took = ask(BOB, "POST", f"/sandboxes/{alices.id}/snapshots", {"name": "mine"})
    assert took.get("code") == "not_found", took
    assert ask(BOB, "POST", f"/sandboxes/{alices.id}/pause").get("code") == "not_found"
    assert image in sh("docker", "images", "--format", "{{.Repository}}:{{.Tag}}").stdout


BAD_NAMES = {
    "dotdot": "../x",
    "slash": "a/b",
    "dash-first": "-x",
    "65-chars": "a" * 65,
    "5000-chars": "x" * 5000,
    "space": "a b",
    "empty": "",
}


@pytest.mark.parametrize("name", list(BAD_NAMES.values()), ids=list(BAD_NAMES))
def test_a_bad_snapshot_name_is_invalid_name(agent: None, name: str) -> None:
    alices = next(v for v in admin().list_sandboxes() if v.user == ALICE)
    took = ask(ALICE, "POST", f"/sandboxes/{alices.id}/snapshots", {"name": name})
    assert took.get("code") == "invalid_name", took
    forked = ask(ALICE, "POST", "/sandboxes", {"project": "snap", "from_snapshot": name})
    assert forked.get("code") == "invalid_name", forked


def test_the_agent_killed_mid_snapshot_leaves_a_whole_snapshot_or_none_and_no_freeze(
    agent: None,
) -> None:
    box = create(ALICE, memory="512MB")
    out(ALICE, box, "dd if=/dev/urandom of=/workspace/big bs=1M count=96 2>/dev/null")
    taking = subprocess.Popen(
        curl(ALICE, "POST", f"/sandboxes/{box}/snapshots", {"name": "killed"}),
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: container(box)["State"]["Paused"] is True, timeout=60, step=0.05)  # type: ignore[index]
        sh("systemctl", "kill", "-s", "KILL", "slicebox.service")
    finally:
        taking.wait(timeout=120)
    wait_for(lambda: prop("slicebox.service", "ActiveState") == "active", timeout=120)
    wait_for(lambda: container(box)["State"]["Paused"] is False, timeout=60)  # type: ignore[index]
    assert admin().usage(box).paused is False
    assert out(ALICE, box, "echo alive") == "alive\n"
    mine = [s for s in admin().request("GET", "/snapshots?user=" + ALICE) if s["name"] == "killed"]
    if mine:  # whole: it forks and holds the workspace
        assert mine[0]["size_bytes"] > 90 * 1024 * 1024
        assert ask(ALICE, "DELETE", "/snapshots/killed") == {"name": "killed", "deleted": True}


def test_the_quota_refuses_with_its_code_and_says_what_is_held(agent: None) -> None:
    alices = next(v for v in admin().list_sandboxes() if v.user == ALICE)
    again = ask(ALICE, "POST", f"/sandboxes/{alices.id}/snapshots", {"name": "base"})
    assert again.get("code") == "snapshot_exists", again
    held = len(ask(ALICE, "GET", "/snapshots")["list"])  # type: ignore[arg-type]
    for n in range(MAX_COUNT - held):
        took = ask(ALICE, "POST", f"/sandboxes/{alices.id}/snapshots", {"name": f"q{n}"})
        assert took.get("name") == f"q{n}", took
    over = ask(ALICE, "POST", f"/sandboxes/{alices.id}/snapshots", {"name": "over"})
    assert over.get("code") == "snapshot_quota", over
    assert f"{MAX_COUNT} snapshots" in str(over.get("message")), over
    assert ask(ALICE, "DELETE", "/snapshots/q0") == {"name": "q0", "deleted": True}
    assert ask(BOB, "GET", "/snapshots") == {"list": []}


def test_a_sparse_file_counts_whole_and_is_refused_as_the_snapshot_grows(agent: None) -> None:
    """tmpfs takes a sparse file of any apparent size; a snapshot writes it whole, so the
    quota is held as the stream is made, not once it is (the host's disk would fill first)."""
    before = snapshot_images()
    box = create(ALICE)
    out(ALICE, box, "dd if=/dev/zero of=/workspace/sparse bs=1 count=0 seek=50G 2>/dev/null")
    over = ask(ALICE, "POST", f"/sandboxes/{box}/snapshots", {"name": "sparse"})
    assert over.get("code") == "snapshot_quota", over
    assert "sparse file" in str(over.get("message")), over
    assert snapshot_images() == before
    assert admin().usage(box).paused is False
    admin().destroy(box)


def test_a_native_sandbox_s_pause_freezes_its_slice_and_outlives_a_restart(agent: None) -> None:
    box = create(ALICE, backend="native")
    assert ask(ALICE, "POST", f"/sandboxes/{box}/pause") == {"id": box, "paused": True}
    assert run(ALICE, box, "true").get("code") == "sandbox_paused"
    sh("systemctl", "restart", "slicebox.service")
    assert admin().usage(box).paused is True, "a restarted agent reads the pause back"
    assert run(ALICE, box, "true").get("code") == "sandbox_paused"
    assert ask(ALICE, "POST", f"/sandboxes/{box}/resume") == {"id": box, "paused": False}
    assert out(ALICE, box, "echo thawed") == "thawed\n"
    admin().destroy(box)


def test_a_host_workspace_sandbox_is_refused_and_leaves_nothing(agent: None) -> None:
    before = snapshot_images()
    home = Path("/srv/sbx-ws") / ALICE
    home.mkdir(parents=True, exist_ok=True)
    sh("chown", ALICE, str(home))
    try:
        box = create(ALICE, workspace={"kind": "host", "path": str(home)})
        took = ask(ALICE, "POST", f"/sandboxes/{box}/snapshots", {"name": "host"})
        assert took.get("code") == "snapshot_workspace", took
        assert admin().usage(box).paused is False
        admin().destroy(box)
    finally:
        sh("rm", "-rf", str(home))
    assert snapshot_images() == before
