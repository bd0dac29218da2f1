"""Git workspaces with credentials, as an ordinary user meets them on a real host: the CLI clones
from an authenticated HTTP git server in the guest (basic auth, ``git http-backend``) into a
fresh workspace volume; the sandbox commits and pushes through the agent's askpass helper; the
token is in no journal entry, no ``docker inspect``, no process's command line or environment
and no ``.git/config``; the credential directory goes with a destroy and with a deadline that
passes while the agent is stopped; a wrong token fails the create and leaves nothing behind.
All network stays in the guest: sandboxes reach the server at the docker0 gateway."""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from slicebox.model.api import Extend
from tests.host.agentunits import admin, agent_config, installed_agent, remove_sandboxes
from tests.host.gitserver import README, bridge_gateway, git_server, head_of, repo_path
from tests.host.helpers import ordinary_user, sh, wait_for

pytestmark = pytest.mark.host

USER = "sbxgit"  # an ordinary user in group slicebox
GIT_IMAGE = "slicebox-test/git:latest"
GIT_USERNAME = "sbx-agent"
CREDENTIALS = Path("/run/slicebox/sandboxes")  # <sandbox id>/ on the host
ASKPASS = "/run/slicebox/credentials/askpass"  # in the sandbox
# The deadline test's sandbox is made with a TTL that leaves an emulated guest time to clone
# and create however slow the day, then its deadline is moved to SOON seconds away, time to
# stop the agent: the wait is for the deadline, not for the margin a clone needs.
TTL, SOON = 600, 15


@dataclass(frozen=True)
class Rig:
    base: str  # the git server's base URL
    server_root: Path
    token: str
    token_file: Path  # the user's own, mode 0600
    wrong_token_file: Path
    started: float  # epoch seconds: the journal is searched from here on

    @property
    def url(self) -> str:
        return f"{self.base}/demo.git"

    @property
    def host(self) -> str:
        return urlsplit(self.base).netloc

    @property
    def secrets(self) -> list[str]:
        """The token and the basic-auth header value it would travel in."""
        header = base64.b64encode(f"{GIT_USERNAME}:{self.token}".encode()).decode()
        return [self.token, header]


def as_user(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", USER, "--", "slicebox", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def in_box(sandbox_id: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return as_user("exec", sandbox_id, "--", *argv)


def refused_code(result: subprocess.CompletedProcess[str]) -> str:
    """The code of the CLI's ``slicebox: <code>: <message>``."""
    assert result.returncode != 0, result.stdout
    return result.stderr.split(": ")[1] if result.stderr.startswith("slicebox: ") else result.stderr


def create_git_box(rig: Rig, token_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return as_user(
        "--json", "create", "--project", "gitws", "--image", GIT_IMAGE, "--network", "bridge",
        "--workspace", f"git:{rig.url}#main", "--git-username", GIT_USERNAME,
        "--git-token-file", str(token_file), *extra,
    )  # fmt: skip


def user_containers() -> list[str]:
    out = sh("docker", "ps", "-aq", "--filter", f"label=slicebox.user={USER}").stdout
    return out.split()


def user_volumes() -> list[str]:
    out = sh("docker", "volume", "ls", "-q", "--filter", f"label=slicebox.user={USER}").stdout
    return out.split()


def credential_dirs() -> set[str]:
    return {p.name for p in CREDENTIALS.iterdir()} if CREDENTIALS.is_dir() else set()


def processes_text() -> dict[str, bytes]:
    """Every process's command line and environment in the guest, by ``/proc`` path."""
    found: dict[str, bytes] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            for name in ("cmdline", "environ"):
                with suppress(OSError):  # gone meanwhile
                    found[f"{proc}/{name}"] = (proc / name).read_bytes()
    return found


def assert_token_in_no_journal_entry_or_process(rig: Rig, *also: str) -> None:
    journal = sh(
        "journalctl", "--no-pager", "-o", "json", "--since", f"@{int(rig.started) - 1}"
    ).stdout
    assert journal.strip(), "the journal since the test started is not empty"
    processes = processes_text()
    for secret in (*rig.secrets, *also):
        assert secret not in journal, "the token is in the journal"
        leaks = [path for path, text in processes.items() if secret.encode() in text]
        assert leaks == [], f"the token is in {leaks}"


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    started = time.time()
    # The clone reaches the host's git server over a bridge network, off by default.
    bridge = 'allowed_networks = ["none", "bridge"]\n' + agent_config()
    with installed_agent(bridge), ordinary_user(USER):
        sh("systemctl", "start", "slicebox.socket")
        server_root = Path(tempfile.mkdtemp(prefix="slicebox-git-", dir="/var/tmp"))
        user_dir = Path(tempfile.mkdtemp(prefix="slicebox-git-user-", dir="/var/tmp"))
        token = "sbxtok" + secrets.token_hex(16)
        try:
            token_file, wrong_token_file = user_dir / "token", user_dir / "wrong-token"
            token_file.write_text(token + "\n")
            wrong_token_file.write_text("sbxwrong" + secrets.token_hex(16) + "\n")
            for path in (user_dir, token_file, wrong_token_file):
                shutil.chown(path, USER)
                path.chmod(0o700 if path.is_dir() else 0o600)
            with git_server(server_root, GIT_USERNAME, token, bridge_gateway()) as base:
                yield Rig(base, server_root, token, token_file, wrong_token_file, started)
        finally:
            remove_sandboxes()
            for container in user_containers():
                sh("docker", "rm", "-f", container, check=False)
            for volume in user_volumes():
                sh("docker", "volume", "rm", "-f", volume, check=False)
            sh("docker", "network", "rm", "slicebox-bridge", check=False)
            shutil.rmtree(server_root, ignore_errors=True)
            shutil.rmtree(user_dir, ignore_errors=True)


def test_clone_push_through_askpass_and_the_token_is_nowhere(rig: Rig) -> None:
    bare = repo_path(rig.server_root)
    seed = head_of(bare)
    created = create_git_box(rig, rig.token_file)
    assert created.returncode == 0, created.stderr
    box = json.loads(created.stdout)
    sandbox_id, container, volume = box["id"], box["container_id"], box["workspace_volume"]
    try:
        assert rig.token not in created.stdout + created.stderr
        read = in_box(sandbox_id, "cat", "/workspace/README")
        assert read.returncode == 0, read.stderr
        assert read.stdout == README
        cloned = in_box(sandbox_id, "git", "-C", "/workspace", "rev-parse", "HEAD")
        assert cloned.stdout.strip() == seed, cloned.stderr

        env = in_box(sandbox_id, "sh", "-c", 'echo "$GIT_ASKPASS $GIT_TERMINAL_PROMPT"; id -u')
        assert env.stdout.splitlines()[0] == f"{ASKPASS} 0", env.stderr
        uid = int(env.stdout.splitlines()[1])
        assert uid != 0
        home = CREDENTIALS / sandbox_id
        info = home.stat()
        assert (info.st_mode & 0o7777, info.st_uid) == (0o700, uid), "the sandbox's uid's only"
        mounts = in_box(sandbox_id, "cat", "/proc/mounts").stdout.splitlines()
        [mount] = [m.split() for m in mounts if m.split()[1] == "/run/slicebox/credentials"]
        assert "ro" in mount[3].split(","), mount

        ident = ("-c", "user.name=t", "-c", "user.email=t@t")
        commit = in_box(
            sandbox_id, "git", "-C", "/workspace", *ident, "commit", "--allow-empty", "-m", "x"
        )
        assert commit.returncode == 0, commit.stderr
        mine = in_box(sandbox_id, "git", "-C", "/workspace", "rev-parse", "HEAD").stdout.strip()
        assert mine != seed
        # Without the helper nothing answers the server's 401: the push needs askpass.
        bare_push = in_box(
            sandbox_id, "env", "-u", "GIT_ASKPASS", "-u", "SSH_ASKPASS",
            "git", "-C", "/workspace", "push", "origin", "HEAD:main",
        )  # fmt: skip
        assert bare_push.returncode != 0, bare_push.stderr
        assert head_of(bare) == seed
        pushed = in_box(sandbox_id, "git", "-C", "/workspace", "push", "origin", "HEAD:main")
        assert pushed.returncode == 0, pushed.stderr
        assert head_of(bare) == mine, "the server has the sandbox's commit"

        config = in_box(sandbox_id, "cat", "/workspace/.git/config")
        assert config.returncode == 0, config.stderr
        assert f"url = {rig.url}" in config.stdout, "origin is the plain URL"
        # The whole of .git as a tar, searched here: a grep in the sandbox would put the token
        # in its own argv, and so in /proc and runuser's journal entry.
        tar = ("tar", "-c", "-f", "-", "-C", "/workspace", ".git")
        dot_git = subprocess.run(
            ["runuser", "-u", USER, "--", "slicebox", "exec", sandbox_id, "--", *tar],
            capture_output=True,
            check=True,
        ).stdout
        assert b"config" in dot_git
        for secret in rig.secrets:
            assert secret not in config.stdout, ".git/config holds the token"
            assert secret.encode() not in dot_git, "the token is somewhere in .git"
        inspected = sh("docker", "inspect", container).stdout
        [details] = json.loads(inspected)
        assert details["Config"]["Labels"], "labels are there to be searched"
        inspected += sh("docker", "volume", "inspect", volume).stdout
        for secret in rig.secrets:
            assert secret not in inspected, "docker inspect shows the token"
        assert_token_in_no_journal_entry_or_process(rig)
    finally:
        removed = as_user("rm", sandbox_id)
    assert removed.returncode == 0, removed.stderr
    assert not (CREDENTIALS / sandbox_id).exists(), "the credential directory went with it"
    assert sh("docker", "inspect", container, check=False).returncode != 0


def test_a_deadline_passing_with_the_agent_stopped_takes_the_credentials(rig: Rig) -> None:
    created = create_git_box(rig, rig.token_file, "--ttl", str(TTL))
    assert created.returncode == 0, created.stderr
    box = json.loads(created.stdout)
    sandbox_id, container = box["id"], box["container_id"]
    assert (CREDENTIALS / sandbox_id).is_dir()
    expires = admin().extend(sandbox_id, Extend(ttl_seconds=SOON)).expires_at
    assert expires is not None
    sh("systemctl", "stop", "slicebox.service", "slicebox.socket")
    try:
        assert datetime.now(UTC) < expires, "the agent must be stopped before the deadline"
        wait_for(
            lambda: sh("docker", "inspect", container, check=False).returncode != 0,
            timeout=SOON + 180,
            step=1,
        )
        wait_for(lambda: not (CREDENTIALS / sandbox_id).exists(), timeout=30, step=1)
        assert sh("systemctl", "is-active", "slicebox.service", check=False).stdout.strip() != (
            "active"
        ), "the deadline timer did it, not the agent"
    finally:
        sh("systemctl", "start", "slicebox.socket")
    assert_token_in_no_journal_entry_or_process(rig)


def test_a_wrong_token_fails_the_create_and_leaves_nothing(rig: Rig) -> None:
    wrong = rig.wrong_token_file.read_text().strip()
    containers, volumes, dirs = user_containers(), user_volumes(), credential_dirs()
    failed = as_user(
        "create", "--project", "gitws", "--image", GIT_IMAGE, "--network", "bridge",
        "--workspace", f"git:{rig.url}#main", "--git-username", GIT_USERNAME,
        "--git-token-file", str(rig.wrong_token_file),
    )  # fmt: skip
    assert refused_code(failed) == "git_clone_failed", failed.stderr
    assert wrong not in failed.stderr
    assert user_containers() == containers, "no container is left"
    assert user_volumes() == volumes, "no workspace volume is left"
    assert credential_dirs() == dirs, "no credential directory is left"
    assert_token_in_no_journal_entry_or_process(rig, wrong)
