"""Attacks on who a sandbox runs as, on credentials and on the caller's identity, made through
the installed agent as hostile members of group slicebox would (issue 37, findings 1, 4, 5).

Each test here fails on main before that work: there a ``run_as`` with docker's gid was
admitted next to a writable host workspace, a uid without a passwd entry was served as
``uid100000``, a user removed from group slicebox kept their access, and ``nobody`` on the host
read every sandbox's git token (every sandbox ran as 65534 under a 0755 parent).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.host.agentunits import SOCKET, WORKSPACE_ROOTS, installed_agent, remove_sandboxes
from tests.host.helpers import sh, wait_for

pytestmark = pytest.mark.host

ALICE, BOB, CAROL = "sbxida", "sbxidb", "sbxidc"
CREDENTIALS = Path("/run/slicebox/sandboxes")
TOKEN = "s3cr3t-identity-token"
USER_CACHE_SECONDS = 10  # host.identity's: how long a removal may take to count


def ids(user: str) -> tuple[int, int]:
    return int(sh("id", "-u", user).stdout), int(sh("id", "-g", user).stdout)


def gid_of(group: str) -> int:
    return int(sh("getent", "group", group).stdout.split(":")[2])


def curl(method: str, path: str, body: object | None = None) -> list[str]:
    call = ["curl", "-s", "-m", "300", "--unix-socket", str(SOCKET), "-X", method]
    data = ["-H", "Content-Type: application/json", "-d", json.dumps(body)] if body else []
    return [*call, *data, f"http://localhost/v1{path}"]


def answer(
    prefix: list[str], method: str, path: str, body: object | None = None
) -> dict[str, object]:
    out = subprocess.run(
        [*prefix, *curl(method, path, body)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def as_user(user: str, method: str, path: str, body: object | None = None) -> dict[str, object]:
    return answer(["runuser", "-u", user, "--"], method, path, body)


def exec_in(user: str, sandbox_id: str, script: str) -> subprocess.CompletedProcess[str]:
    argv = ["runuser", "-u", user, "--", "slicebox", "exec", sandbox_id, "--", "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def leftovers(user: str) -> list[str]:
    """Containers, volumes and slices of ``user``'s (a refused create makes none; a destroy
    leaves the slices to the reaper, whose pass with the tests' grace of 0 takes them)."""
    sh("slicebox", "reap")
    label = f"label=slicebox.user={user}"
    found = sh("docker", "ps", "-aq", "--filter", label).stdout.split()
    found += sh("docker", "volume", "ls", "-q", "--filter", label).stdout.split()
    units = sh("systemctl", "list-units", "--all", "--plain", "--no-legend", f"slicebox-{user}*")
    return found + [line.split()[0] for line in units.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def agent() -> Iterator[Path]:
    """The agent, users alice and bob in group slicebox (carol too, for her removal), and
    alice's host workspace (hers, 0755, below her bind root)."""
    with installed_agent():
        for user in (ALICE, BOB, CAROL):
            sh("userdel", user, check=False)
            sh("useradd", "--no-create-home", "--shell", "/bin/sh", "-G", "slicebox", user)
        home = Path(WORKSPACE_ROOTS) / ALICE
        workspace = home / "ws"
        workspace.mkdir(parents=True, exist_ok=True)
        for path in (home, workspace):
            os.chown(path, *ids(ALICE))
        sh("systemctl", "start", "slicebox.socket")
        try:
            yield workspace
        finally:
            remove_sandboxes((ALICE, BOB))
            shutil.rmtree(home, ignore_errors=True)
            for user in (ALICE, BOB, CAROL):
                sh("userdel", user, check=False)


def host_workspace(path: Path, **fields: object) -> dict[str, object]:
    return {"project": "p", "workspace": {"kind": "host", "path": str(path)}, **fields}


def test_run_as_a_foreign_identity_with_a_host_workspace_is_refused(agent: Path) -> None:
    uid, _ = ids(ALICE)
    bob_uid, bob_gid = ids(BOB)
    for run_as in (f"{uid}:{gid_of('docker')}", f"{uid}:0", f"{bob_uid}:{bob_gid}"):
        got = as_user(ALICE, "POST", "/sandboxes", host_workspace(agent, run_as=run_as))
        assert got.get("code") == "policy_run_as", (run_as, got)
    read_only = {"kind": "host", "path": str(agent), "read_only": True}
    body = {"project": "p", "workspace": read_only, "run_as": f"{bob_uid}:{bob_gid}"}
    got = as_user(ALICE, "POST", "/sandboxes", body)
    assert got.get("code") == "policy_run_as", got
    assert leftovers(ALICE) == []


def test_a_set_id_file_made_in_a_host_workspace_is_the_callers_only(agent: Path) -> None:
    """What the sandbox makes in the workspace, even chmod 6755, is alice's uid and primary gid:
    on main a run_as with docker's gid was admitted, and the file was set-gid docker."""
    uid, gid = ids(ALICE)
    tried = as_user(
        ALICE, "POST", "/sandboxes", host_workspace(agent, run_as=f"{uid}:{gid_of('docker')}")
    )
    box = tried if "id" in tried else as_user(ALICE, "POST", "/sandboxes", host_workspace(agent))
    sandbox_id = str(box["id"])
    try:
        [inspected] = json.loads(sh("docker", "inspect", str(box["container_id"])).stdout)
        assert inspected["Config"]["User"] == f"{uid}:{gid}"
        assert not inspected["HostConfig"]["GroupAdd"], "no supplementary groups"
        made = exec_in(ALICE, sandbox_id, "cp /bin/busybox /workspace/x && chmod 6755 /workspace/x")
        assert made.returncode == 0, made.stderr
        info = (agent / "x").stat()
        assert (info.st_uid, info.st_gid) == (uid, gid), "alice's and nobody else's"
    finally:
        sh("slicebox", "rm", sandbox_id, check=False)
        (agent / "x").unlink(missing_ok=True)
    assert leftovers(ALICE) == []


def setpriv(uid: int, gid: int) -> list[str]:
    """A process as a login of (uid, gid) keeping group slicebox, whatever NSS says now: the
    kernel lets it connect; the agent must look the uid up itself."""
    groups = f"--groups={gid_of('slicebox')}"
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", groups, "--"]


def test_a_uid_without_a_passwd_entry_is_refused_unknown_user(agent: Path) -> None:
    assert sh("getent", "passwd", "100000", check=False).returncode != 0
    got = answer(setpriv(100000, 100000), "GET", "/health")
    assert got.get("code") == "unknown_user", got
    got = answer(setpriv(100000, 100000), "POST", "/sandboxes", {"project": "p"})
    assert got.get("code") == "unknown_user", got
    assert leftovers("uid100000") == []


def test_a_user_removed_from_group_slicebox_is_refused_within_the_cache_time(agent: Path) -> None:
    login = setpriv(*ids(CAROL))
    assert answer(login, "GET", "/health").get("user") == CAROL
    sh("gpasswd", "-d", CAROL, "slicebox")
    try:
        wait_for(
            lambda: answer(login, "GET", "/health").get("code") == "not_member",
            timeout=USER_CACHE_SECONDS + 10,
            step=1,
        )
    finally:
        sh("usermod", "-aG", "slicebox", CAROL)


def test_nobody_on_the_host_and_another_users_sandbox_cannot_read_a_token(agent: Path) -> None:
    credentials = {"git": {"token": TOKEN, "hosts": ["git.example"]}}
    box = as_user(ALICE, "POST", "/sandboxes", {"project": "p", "credentials": credentials})
    other = as_user(BOB, "POST", "/sandboxes", {"project": "p"})
    sandbox_id, other_id = str(box["id"]), str(other["id"])
    try:
        token = CREDENTIALS / sandbox_id / "token"
        assert token.read_text().strip() == TOKEN, "root reads it"
        own = exec_in(ALICE, sandbox_id, "cat /run/slicebox/credentials/token")
        assert own.stdout.strip() == TOKEN, "its own sandbox reads it"
        for user in ("nobody", BOB):
            peek = sh("runuser", "-u", user, "--", "cat", str(token), check=False)
            assert peek.returncode != 0, user
            assert TOKEN not in peek.stdout, user
        peek = exec_in(BOB, other_id, f"cat {token}; cat /run/slicebox/credentials/token")
        assert TOKEN not in peek.stdout
        many = {"git": {"token": TOKEN, "hosts": [f"h{n}.example" for n in range(65)]}}
        got = as_user(ALICE, "POST", "/sandboxes", {"project": "p", "credentials": many})
        assert got.get("code") == "invalid_field", got
        assert "hosts" in str(got.get("field")), got
    finally:
        sh("slicebox", "rm", sandbox_id, other_id, check=False)
    assert not (CREDENTIALS / sandbox_id).exists()
    assert leftovers(ALICE) == []
    assert leftovers(BOB) == []
