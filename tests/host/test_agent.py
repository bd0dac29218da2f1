"""The agent end to end on a real host, as its users meet it: the CLI over the socket, kernel
identity, sandboxes in the slice tree, exec, one-shot runs, streaming, reload, journal audit."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.model.audit import MESSAGE_IDS, AuditEvent
from tests.host.agentunits import (
    CONFIG,
    SOCKET,
    TEST_CONFIG,
    WORKSPACE_ROOTS,
    installed_agent,
    remove_sandboxes,
)
from tests.host.helpers import CGROUP_ROOT, sh, unique, wait_for

pytestmark = pytest.mark.host

USERS = {"sbxalice": True, "sbxbob": True, "sbxcarol": False}  # name: in group slicebox


def as_user(user: str, *argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", user, "--", "slicebox", *argv],
        capture_output=True,
        text=True,
        input=stdin,
        check=False,
    )


@pytest.fixture(scope="module")
def agent() -> Iterator[None]:
    with installed_agent():
        for user, member in USERS.items():
            sh("useradd", "--no-create-home", "--shell", "/bin/sh", user)
            if member:
                sh("usermod", "-aG", "slicebox", user)
        sh("systemctl", "start", "slicebox.socket")
        try:
            yield
        finally:
            remove_sandboxes()
            for user in USERS:
                sh("userdel", user, check=False)


def test_users_see_only_their_own_and_outsiders_cannot_connect(agent: None) -> None:
    root = unique("task-")
    created = as_user("sbxalice", "--json", "create", "--project", "web", "--root-task", root)
    assert created.returncode == 0, created.stderr
    box = json.loads(created.stdout)
    assert box["user"] == "sbxalice"
    container = sh("docker", "inspect", box["container_id"]).stdout
    parent = json.loads(container)[0]["HostConfig"]["CgroupParent"]
    assert parent == "slicebox-sbxalice-web.slice"
    assert (
        CGROUP_ROOT
        / "slicebox.slice/slicebox-sbxalice.slice/slicebox-sbxalice-web.slice"
        / f"docker-{box['container_id']}.scope"
    ).is_dir()

    assert json.loads(as_user("sbxbob", "--json", "ps").stdout) == []
    peek = as_user("sbxbob", "exec", box["id"], "--", "id")
    assert peek.returncode == 2
    assert "not_found" in peek.stderr
    outsider = as_user("sbxcarol", "ps")
    assert outsider.returncode == 2
    assert "agent_unreachable" in outsider.stderr
    forged = as_user("sbxbob", "create", "--user", "sbxalice")
    assert "forbidden" in forged.stderr

    ran = as_user(
        "sbxalice", "exec", box["id"], "--", "sh", "-c", "echo to-out; echo to-err >&2; exit 7"
    )
    assert (ran.returncode, ran.stdout, ran.stderr) == (7, "to-out\n", "to-err\n")
    removed = as_user("sbxalice", "--json", "rm", box["id"])
    gone = json.loads(removed.stdout)
    assert gone["destroyed"] is True
    assert gone["usage"]["sandbox"]["deleted_at"]

    story = sh("journalctl", "--no-pager", "-o", "json", f"SLICEBOX_ROOT_TASK_ID={root}").stdout
    entries = [json.loads(line) for line in story.splitlines()]
    # A reaper pass that ran while the destroy was removing the container finds the destroy
    # in flight and records only that it deferred (CI saw it once, when a destroy disarmed
    # the timer first): the reaper did nothing to the sandbox.
    reaper = [e for e in entries if e["SLICEBOX_EVENT"] == "reaper_action"]
    assert {e["SLICEBOX_RESULT"] for e in reaper} <= {"deferred"}
    entries = [e for e in entries if e not in reaper]
    assert [e["SLICEBOX_EVENT"] for e in entries] == [
        "sandbox_created",
        "exec",
        "sandbox_destroyed",
    ]
    alice_uid = sh("id", "-u", "sbxalice").stdout.strip()
    assert {e["SLICEBOX_CALLER_UID"] for e in entries} == {alice_uid}
    assert entries[1]["SLICEBOX_EXIT_CODE"] == "7"
    assert "SLICEBOX_USAGE_CPU_SECONDS" in entries[2]
    assert entries[2]["MESSAGE_ID"] == MESSAGE_IDS[AuditEvent.SANDBOX_DESTROYED]
    assert "to-out" not in story  # output never reaches the journal


def test_one_shot_run_and_streaming(agent: None) -> None:
    ran = as_user("sbxbob", "run", "--project", "oneshot", "--", "sh", "-c", "echo hi; exit 3")
    assert (ran.returncode, ran.stdout) == (3, "hi\n")
    # The streamed one-shot answers first and the agent removes its sandbox after.
    wait_for(lambda: json.loads(as_user("sbxbob", "--json", "ps").stdout) == [], timeout=60)

    box = json.loads(as_user("sbxbob", "--json", "create", "--project", "stream").stdout)
    body = json.dumps({"argv": ["sh", "-c", "echo one; echo two >&2; echo three"]})
    streamed = subprocess.run(
        [
            "runuser",
            "-u",
            "sbxbob",
            "--",
            "curl",
            "-sN",
            "--unix-socket",
            str(SOCKET),
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
            f"http://localhost/v1/sandboxes/{box['id']}/exec/stream",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [json.loads(line) for line in streamed.splitlines()]
    assert lines[-1]["result"]["exit_code"] == 0
    assert {line["stream"] for line in lines[:-1]} == {"stdout", "stderr"}
    as_user("sbxbob", "rm", box["id"])


def test_a_one_shot_run_goes_to_its_sandbox_s_waiter_not_a_docker_exec(agent: None) -> None:
    """Words with newlines, quotes and backslashes, an env, a stdin and an exit code reach
    the command through the busybox waiter's one line; Docker saw an attach and no exec; the
    final usage is read before the removal (the sandbox still runs after the command); a fork
    bomb past its timeout answers 124 and its sandbox goes."""
    since = f"{time.time() - 1:.3f}"  # Docker's events are read back from here at the end
    script = 'printf "%s|" "$@"; echo "$GREETING"; cat; echo err >&2; exit 5'
    words = ["a b", "it's", "x\ny", "back\\slash \\n %b", "$HOME"]
    run = {
        "sandbox": {"project": "launch"},
        "exec": {
            "argv": ["sh", "-c", script, "sh", *words],
            "env": {"GREETING": "hello 'you'"},
            "stdin": base64.b64encode(b"from stdin").decode(),
        },
    }
    ran = as_curl("sbxbob", "POST", "/v1/run", run)
    result = dict(ran["result"])  # type: ignore[call-overload]
    printed = "a b|it's|x\ny|back\\slash \\n %b|$HOME|hello 'you'\nfrom stdin"
    assert base64.b64decode(result["stdout"]).decode() == printed
    assert (base64.b64decode(result["stderr"]), result["exit_code"]) == (b"err\n", 5)
    usage = dict(ran["usage"])  # type: ignore[call-overload]
    assert float(usage["cpu_seconds"]) > 0, usage

    bomb = {
        "sandbox": {"project": "launch"},
        "exec": {"argv": ["sh", "-c", "f() { f | f & }; f; sleep 60"], "timeout": 3},
    }
    timed = dict(as_curl("sbxbob", "POST", "/v1/run", bomb)["result"])  # type: ignore[call-overload]
    assert (timed["exit_code"], timed["timed_out"]) == (124, True)
    wait_for(lambda: json.loads(as_user("sbxbob", "--json", "ps").stdout) == [], timeout=60)
    until = f"{time.time() + 1:.3f}"
    format_ = "{{.Action}} {{.Actor.ID}}"
    seen = sh("docker", "events", "--since", since, "--until", until, "--format", format_).stdout
    container = next(line.split()[1] for line in seen.splitlines() if line.startswith("attach"))
    mine = [line.split()[0] for line in seen.splitlines() if line.endswith(container)]
    assert "exec_create" not in " ".join(mine), mine
    assert mine[:3] == ["create", "start", "attach"], mine


def test_reload_applies_a_changed_ceiling_live(agent: None) -> None:
    box = json.loads(as_user("sbxalice", "--json", "create", "--project", "ceil").stdout)
    unit = "slicebox-sbxalice-ceil.slice"
    before = sh("systemctl", "show", "-P", "MemoryMax", unit).stdout.strip()
    CONFIG.write_text(TEST_CONFIG + '\n[projects."sbxalice/ceil"]\nmemory = "300MB"\n')
    try:
        sh("systemctl", "reload", "slicebox.service")
        wait_for(
            lambda: (
                sh("systemctl", "show", "-P", "MemoryMax", unit).stdout.strip()
                == str(300 * 1024 * 1024)
            ),
            timeout=60,
        )
        assert before != str(300 * 1024 * 1024)
    finally:
        CONFIG.write_text(TEST_CONFIG)
        as_user("sbxalice", "rm", box["id"])


def as_curl(user: str, method: str, path: str, body: object) -> dict[str, object]:
    """A raw API call as ``user`` (for fields the CLI has no option for)."""
    call = ["curl", "-s", "--unix-socket", str(SOCKET), "-X", method, f"http://localhost{path}"]
    data = ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    out = subprocess.run(
        ["runuser", "-u", user, "--", *call, *data],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out))


def refused_code(result: subprocess.CompletedProcess[str]) -> str:
    """The code of the CLI's ``slicebox: <code>: <message>``."""
    assert result.returncode != 0, result.stdout
    return result.stderr.split(": ")[1] if result.stderr.startswith("slicebox: ") else result.stderr


def test_workspaces_are_the_callers_own_through_the_socket(agent: None) -> None:
    """Host workspaces run as the caller (their files are theirs, no setuid-root can be made
    there) and cannot be turned into the host's root; volumes carry lineage, are mountable by
    their owner only, stay when kept and go with their root task otherwise."""
    home = Path(WORKSPACE_ROOTS) / "sbxalice"
    code = home / "code"
    code.mkdir(parents=True)
    uid, gid = (int(sh("id", flag, "sbxalice").stdout) for flag in ("-u", "-g"))
    os.chown(home, uid, gid)
    os.chown(code, uid, gid)
    made: list[str] = []
    plain = unique("plain-")
    sh("docker", "volume", "create", plain)
    try:
        created = as_user("sbxalice", "--json", "create", "--workspace", f"host:{code}")
        assert created.returncode == 0, created.stderr
        box = json.loads(created.stdout)
        made.append(box["id"])
        wrote = as_user(
            "sbxalice", "exec", box["id"], "--", "sh", "-c",
            "id -u; echo hi > f; cp /bin/busybox s; chmod u+s s; chown 0 s; ln -s / esc",
        )  # fmt: skip
        assert wrote.stdout.splitlines()[0] == str(uid), "the sandbox runs as the caller"
        assert "Operation not permitted" in wrote.stderr, "chown to root is refused"
        assert ((code / "f").stat().st_uid, (code / "f").stat().st_gid) == (uid, gid)
        assert all(p.lstat().st_uid == uid for p in code.iterdir()), "nothing of root's there"
        assert (code / "esc").is_symlink()

        escapes = {
            f"{code}/esc": "mount_escape",
            f"{code}/esc/etc": "mount_escape",
            f"{code}/../../../etc": "mount_escape",
            f"{WORKSPACE_ROOTS}/sbxbob": "policy_mount",
        }
        for path, code_word in escapes.items():
            tried = as_user("sbxalice", "create", "--workspace", f"host:{path}")
            assert refused_code(tried) == code_word, (path, tried.stderr)
        root = as_user("sbxalice", "create", "--run-as", "0", "--workspace", f"host:{code}")
        assert refused_code(root) == "policy_root"

        task = unique("ws-task-")
        kept = json.loads(
            as_user(
                "sbxalice", "--json", "create", "--root-task", task, "--workspace", "volume:data",
                "--keep",
            ).stdout
        )  # fmt: skip
        made.append(kept["id"])
        volume = kept["workspace_volume"]
        assert volume == "slicebox-sbxalice-data"
        labels = json.loads(sh("docker", "volume", "inspect", volume).stdout)[0]["Labels"]
        assert labels["slicebox.user"] == "sbxalice"
        assert labels["slicebox.root_task_id"] == task
        assert labels["slicebox.keep"] == "true"
        wrote = as_user("sbxalice", "exec", kept["id"], "--", "sh", "-c", "echo kept > k")
        assert wrote.returncode == 0, wrote.stderr  # the fresh volume is the sandbox's uid's
        for mount, code_word in ((volume, "volume_not_owned"), (plain, "volume_foreign")):
            body = {"project": "p", "mounts": [{"kind": "volume", "source": mount, "target": "/x"}]}
            answer = as_curl("sbxbob", "POST", "/v1/sandboxes", body)
            assert answer["code"] == code_word, answer
        as_user("sbxalice", "rm", kept["id"])
        assert sh("docker", "volume", "inspect", volume, check=False).returncode == 0, "kept"
        again = json.loads(
            as_user("sbxalice", "--json", "create", "--workspace", "volume:data").stdout
        )
        made.append(again["id"])
        read = as_user("sbxalice", "exec", again["id"], "--", "cat", "k")
        assert read.stdout == "kept\n"

        brief = json.loads(as_user("sbxalice", "--json", "create", "--workspace", "volume").stdout)
        made.append(brief["id"])
        sh("docker", "rm", "-f", brief["container_id"])  # its agent never saw it go
        sh("slicebox", "reap")
        gone = sh("docker", "volume", "inspect", brief["workspace_volume"], check=False)
        assert gone.returncode != 0, "the reaper took the volume of a root task that is gone"
        audit = sh(
            "journalctl", "--no-pager", "-o", "json", "SLICEBOX_REAPER_RULE=volume_orphaned",
            f"SLICEBOX_ROOT_TASK_ID={brief['root_task_id']}",
        ).stdout  # fmt: skip
        assert [json.loads(line)["SLICEBOX_RESULT"] for line in audit.splitlines()] == ["ok"]
        # The agent made it, so it knows it without a look-up; Docker's answer says it is gone.
        again_rm = as_user("sbxalice", "rm", brief["id"])
        assert again_rm.returncode == 0, again_rm.stderr
        assert f"{brief['id']} already gone" in again_rm.stdout
        destroyed = sh(
            "journalctl", "--no-pager", "-o", "json", "SLICEBOX_EVENT=sandbox_destroyed",
            f"SLICEBOX_SANDBOX_ID={brief['id']}",
        ).stdout  # fmt: skip
        assert "gone already" in json.loads(destroyed.splitlines()[-1])["SLICEBOX_DETAIL"]
    finally:
        for sandbox in made:
            as_user("sbxalice", "rm", sandbox)
        for name in ("slicebox-sbxalice-data", plain):
            sh("docker", "volume", "rm", "-f", name, check=False)
        shutil.rmtree(home)
    leftover = sh("docker", "volume", "ls", "-q", "--filter", "label=slicebox.user=sbxalice")
    assert leftover.stdout.split() == []
