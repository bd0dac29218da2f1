"""Host paths as a hostile member of group ``slicebox`` attacks them (issue 37, findings 2 and
3), through the installed agent, as real users (runuser):

- a bind root whose user-owned component the user swaps for a link to ``/`` (the root is
  ``/srv/sbx-atk/{user}/sandboxes``: the user owns ``/srv/sbx-atk/<user>``);
- a loop swapping the user's workspace directory for a symlink to ``/etc`` while creates run;
- an image whose ``/workspace`` is an absolute symlink to the user's own host path;
- an agent killed between staging and its end (a staging point left behind).

Every sandbox's command records what it saw at ``/workspace`` in a second bind (``/log``): it
must only ever have seen the caller's own directory, and never run before the check. Nothing
is left behind: no container, no staging point (the module's agent reaps its slices after).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.host.agentunits import SOCKET, installed_agent, remove_sandboxes
from tests.host.helpers import ordinary_user, sh, wait_for

pytestmark = pytest.mark.host

USER, OTHER = "sbxatk", "sbxatkb"
BASE = Path("/srv/sbx-atk")
STAGE = Path("/run/slicebox/stage")
IMAGE = "slicebox-test/busybox:latest"
LINKED = "slicebox-test/linked-workspace:latest"
CONFIG = (
    f'default_image = "{IMAGE}"\n'
    f'bind_roots = ["{BASE}/{{user}}/sandboxes"]\n'
    "[reaper]\nempty_slice_grace_seconds = 0\n"
)
# What the sandbox saw at /workspace, written where the test reads it after the sandbox went.
RECORD = "stat -c %d:%i /workspace >> /log/seen; exec sleep 600"


def ids(path: Path) -> str:
    found = os.stat(path)
    return f"{found.st_dev}:{found.st_ino}"


def api(user: str, method: str, path: str, body: object | None = None) -> dict[str, object]:
    """A raw API call as ``user`` (the fields the CLI has no option for)."""
    call = ["curl", "-s", "-m", "300", "--unix-socket", str(SOCKET), "-X", method]
    data = ["-H", "Content-Type: application/json", "-d", json.dumps(body)] if body else []
    out = subprocess.run(
        ["runuser", "-u", user, "--", *call, *data, f"http://localhost{path}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out)) if out.strip() else {}


def as_user(*argv: str) -> subprocess.CompletedProcess[str]:
    argv = ("runuser", "-u", USER, "--", *argv)
    return subprocess.run(argv, check=True, capture_output=True, text=True)


class Home:
    """``<BASE>/<USER>`` (the user's), its ``sandboxes`` root, a ``code`` workspace and a
    ``log`` every sandbox writes what it saw into."""

    def __init__(self) -> None:
        self.mine = BASE / USER
        self.root = self.mine / "sandboxes"
        self.code = self.root / "code"
        self.log = self.root / "log"

    def spec(self, workspace: Path, image: str = IMAGE, *, log: bool = True) -> dict[str, object]:
        mounts = [{"kind": "bind", "source": str(self.log), "target": "/log"}] if log else []
        return {
            "project": "atk",
            "image": image,
            "workspace": {"kind": "host", "path": str(workspace)},
            "mounts": mounts,
            "command": ["sh", "-c", RECORD],
        }

    def seen(self) -> list[str]:
        found = self.log / "seen"
        return found.read_text().split() if found.exists() else []


@pytest.fixture(scope="module")
def home() -> Iterator[Home]:
    BASE.mkdir(mode=0o755, exist_ok=True)
    with installed_agent(CONFIG), ordinary_user(USER), ordinary_user(OTHER):
        sh("systemctl", "start", "slicebox.socket")
        made = Home()
        for directory in (made.mine, made.root, made.code, made.log):
            directory.mkdir(exist_ok=True)
            sh("chown", f"{USER}:{USER}", str(directory))
        try:
            yield made
        finally:
            remove_sandboxes()
            sh("rm", "-rf", str(BASE))
    sh("docker", "rmi", "-f", LINKED, check=False)


def created(user: str, spec: dict[str, object]) -> dict[str, object]:
    return api(user, "POST", "/v1/sandboxes", spec)


def destroy(user: str, answer: dict[str, object]) -> None:
    if "id" in answer:
        api(user, "DELETE", f"/v1/sandboxes/{answer['id']}")


def mounted_at_workspace(container_id: str) -> str:
    """What the running container really has at /workspace, looked at from the host without
    following a link: its dev:ino."""
    pid = sh("docker", "inspect", "-f", "{{.State.Pid}}", container_id).stdout.strip()
    found = os.lstat(f"/proc/{pid}/root/workspace")
    return f"{found.st_dev}:{found.st_ino}"


def nothing_staged() -> bool:
    """No staging point stays (their removal follows a create on a thread of the agent's)."""

    def empty() -> bool:
        return not STAGE.exists() or not any(STAGE.iterdir())

    wait_for(empty, timeout=60)
    return True


def test_a_users_component_of_a_root_swapped_for_a_link_to_slash_is_refused(home: Home) -> None:
    """Main followed it: the create got the host's /etc as its workspace."""
    kept = home.mine / "kept"
    as_user("mv", str(home.root), str(kept))
    as_user("ln", "-s", "/", str(home.root))
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        answer = created(USER, home.spec(home.root / "etc", log=False))
        destroy(USER, answer)
        assert answer.get("code") == "bind_root_unsafe", answer
        assert "sandboxes is a symlink" in str(answer["message"])
        doctor = sh("slicebox", "doctor", check=False)
        assert doctor.returncode != 0
        assert f"{home.root} is a symlink" in doctor.stdout, doctor.stdout
        journal = sh(
            "journalctl", "-u", "slicebox.service", "--since", since, "-o", "cat", "--no-pager"
        ).stdout
        assert f"refused a bind of {USER}" in journal
        assert "Traceback" not in journal
    finally:
        os.unlink(home.root)
        kept.rename(home.root)


SWAPPER = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
code, link = sys.argv[1], sys.argv[2]
while True:  # code and link trade places: at each instant code is the directory or the link
    libc.renameat2(-100, code.encode(), -100, link.encode(), 2)
    time.sleep(0.002)
"""


def test_a_workspace_swapped_for_a_link_while_creates_run_mounts_only_the_callers_own(
    home: Home,
) -> None:
    """Main handed Docker the checked name: a swap after the check mounted /etc, and the
    sandbox's command ran with it before the check caught it."""
    real = ids(home.code)
    link = home.root / "link"
    as_user("ln", "-s", "/etc", str(link))
    answers = [created(USER, home.spec(home.code))]  # unraced: the real directory, staged
    assert "id" in answers[0], answers
    swapper = subprocess.Popen(
        ["runuser", "-u", USER, "--", "python3", "-c", SWAPPER, str(home.code), str(link)],
        start_new_session=True,  # runuser and the loop, killed together
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            answers += pool.map(lambda _: created(USER, home.spec(home.code)), range(4))
    finally:
        os.killpg(swapper.pid, signal.SIGKILL)
        swapper.wait()
    try:
        if home.code.is_symlink():  # the loop stopped with the two swapped
            os.rename(home.code, home.root / "swapped")
            os.rename(link, home.code)
            link = home.root / "swapped"
        assert ids(home.code) == real
        made = [answer for answer in answers if "id" in answer]
        codes = {str(answer.get("code")) for answer in answers if "id" not in answer}
        assert codes <= {"mount_escape", "mount_changed"}, answers
        for answer in made:
            assert mounted_at_workspace(str(answer["container_id"])) == real
        wait_for(lambda: len(home.seen()) >= len(made), timeout=60)
        time.sleep(1)  # a command of a refused create would have written by now too
        assert set(home.seen()) == {real}, "a sandbox's command saw another directory"
        assert len(home.seen()) == len(made), "only the admitted sandboxes' commands ran"
        assert nothing_staged()
    finally:
        for answer in answers:
            destroy(USER, answer)
        os.unlink(link)
        (home.log / "seen").unlink(missing_ok=True)


def test_an_image_whose_workspace_is_a_link_to_a_host_path_is_refused_before_its_command(
    home: Home,
) -> None:
    """Main's check followed the image's absolute link against the agent's root: /workspace
    -> the user's own host path looked right wherever the bind went, and the command ran."""
    maker = sh(
        "docker", "create", IMAGE, "sh", "-c", f"rm -rf /workspace; ln -s {home.code} /workspace"
    ).stdout.strip()
    try:
        sh("docker", "start", "-a", maker)
        sh("docker", "commit", "--change", 'CMD ["sh"]', maker, LINKED)
    finally:
        sh("docker", "rm", "-f", maker)
    answer = created(USER, home.spec(home.code, LINKED))
    destroy(USER, answer)
    assert answer.get("code") == "mount_changed", answer
    assert home.seen() == [], "the sandbox's command ran before the check"
    assert nothing_staged()


def test_a_staging_point_a_killed_agent_left_is_removed_by_the_reaper(home: Home) -> None:
    """Made as the helper makes one, in the host's mount namespace, then left by no create."""
    orphan = STAGE / "sbx-orphan-0000"
    orphan.mkdir(parents=True, mode=0o700)
    (orphan / "0").mkdir(mode=0o700)
    sh("mount", "--bind", str(home.code), str(orphan / "0"))
    (home.code / "keep").write_text("the user's file")
    try:
        sh("slicebox", "reap")
        assert not orphan.exists()
        assert (home.code / "keep").read_text() == "the user's file", "only unmounted"
    finally:
        subprocess.run(["umount", str(orphan / "0")], check=False, capture_output=True)
        for left in (orphan / "0", orphan):
            subprocess.run(["rmdir", str(left)], check=False, capture_output=True)
        (home.code / "keep").unlink()
    assert sh("docker", "ps", "-aq", "--filter", f"label=slicebox.user={USER}").stdout == ""
