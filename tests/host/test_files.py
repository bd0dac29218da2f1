"""``slicebox cp`` as an ordinary user meets it, through the real agent on a real host: 200 MiB
of random bytes (a directory with one large file, a few middling ones and small ones) into the
sandbox's default tmpfs ``/workspace`` and into its root filesystem (``/tmp``), and back out,
every file's sha256 the same; the agent's resident memory grows by far less than what it moved
(nothing is buffered whole). One sandbox in all; it, the user and the files are removed after."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.host.agentunits import installed_agent, prop, remove_sandboxes
from tests.host.helpers import journal_records, ordinary_user, sh, wait_for

pytestmark = pytest.mark.host

USER = "sbxfiles"  # an ordinary user in group slicebox
MiB = 1024 * 1024
RSS_GROWTH_MAX = 40 * MiB
# tmpfs /workspace is half the sandbox's memory limit: room for the 200 MiB and tar's slack.
SANDBOX_MEMORY = "640MB"


def as_user(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["runuser", "-u", USER, "--", "slicebox", *argv],
        capture_output=True,
        check=False,
        timeout=900,
    )


def sha256_tree(root: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            digest = hashlib.sha256()
            with path.open("rb") as file:
                while piece := file.read(MiB):
                    digest.update(piece)
            found[str(path.relative_to(root))] = digest.hexdigest()
    return found


def write_random(path: Path, size: int) -> None:
    with path.open("wb") as file:
        for _ in range(size // MiB):
            file.write(os.urandom(MiB))
        file.write(os.urandom(size % MiB))


class PeakRss:
    """The agent's VmRSS, sampled every 50 ms while the block runs: its highest value."""

    def __init__(self, pid: int) -> None:
        self._status = Path(f"/proc/{pid}/status")
        self._stop = threading.Event()
        self.before = self.read()
        self.peak = self.before
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def read(self) -> int:
        for line in self._status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS in {self._status}")

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.read())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """A directory the user owns, with the 200 MiB tree in ``src``."""
    with installed_agent(), ordinary_user(USER):
        sh("systemctl", "start", "slicebox.socket")
        top = Path(tempfile.mkdtemp(prefix="slicebox-files-", dir="/var/tmp"))
        try:
            src = top / "src"
            (src / "nested" / "deeper").mkdir(parents=True)
            write_random(src / "big.bin", 175 * MiB + 12345)
            for n in range(4):
                write_random(src / "nested" / f"mid{n}.bin", 7 * MiB + n)
            for n in range(20):
                (src / "nested" / "deeper" / f"small{n}.txt").write_bytes(os.urandom(1000 + n))
            (src / "empty").write_bytes(b"")
            shutil.chown(top, USER)
            sh("chown", "-R", USER, str(top))
            yield top
        finally:
            remove_sandboxes()
            shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def box(work: Path) -> str:
    made = as_user("create", "--project", "files", "--memory", SANDBOX_MEMORY)
    assert made.returncode == 0, made.stderr
    return made.stdout.decode().strip()


# The whole 200 MiB goes to the tmpfs /workspace, which Docker's archive API cannot reach; the
# root filesystem (/tmp) gets the small files: moving 200 MiB through an emulated guest twice
# more would prove nothing new and cost minutes.
@pytest.mark.parametrize(
    ("where", "part"),
    [("/workspace", "src"), ("/tmp", "src/nested/deeper")],
    ids=["tmpfs-workspace", "rootfs-tmp"],
)
def test_200_mib_in_and_out_through_cp_unchanged_and_the_agent_stays_small(
    work: Path, box: str, where: str, part: str
) -> None:
    src, back = work / part, work / f"back{where.replace('/', '-')}"
    name = src.name
    expected = sha256_tree(src)
    if part == "src":
        assert sum((src / rel).stat().st_size for rel in expected) >= 200 * MiB
    agent_pid = int(prop("slicebox.service", "MainPID"))
    with PeakRss(agent_pid) as rss:
        sent = as_user("cp", str(src), f"{box}:{where}/")
        assert sent.returncode == 0, sent.stderr
        fetched = as_user("cp", f"{box}:{where}/{name}", str(back))
        assert fetched.returncode == 0, fetched.stderr
    assert sha256_tree(back) == expected
    first = sorted(expected)[0]
    inside = as_user("exec", box, "--", "sha256sum", f"{where}/{name}/{first}")
    assert inside.stdout.split()[0].decode() == expected[first]
    growth = rss.peak - rss.before
    assert growth < RSS_GROWTH_MAX, f"the agent's RSS grew {growth / MiB:.1f} MiB"
    shutil.rmtree(back)
    removed = as_user("exec", box, "--", "rm", "-rf", f"{where}/{name}")  # room for the next
    assert removed.returncode == 0, removed.stderr


def test_workspace_is_the_tmpfs_the_archive_api_could_not_reach(box: str) -> None:
    mounts = as_user("exec", box, "--", "cat", "/proc/mounts").stdout.decode()
    assert any(line.split()[1:3] == ["/workspace", "tmpfs"] for line in mounts.splitlines())


def test_each_transfer_is_in_the_journal(box: str) -> None:
    def records() -> list[dict[str, str]]:
        return journal_records(SLICEBOX_EVENT="file_transfer", SLICEBOX_SANDBOX_ID=box)

    wait_for(lambda: len(records()) >= 4, timeout=10)
    assert {r["SLICEBOX_RESULT"] for r in records()} == {"ok"}
    details = " ".join(r["SLICEBOX_DETAIL"] for r in records())
    assert "upload tar /workspace" in details
    assert "download tar /tmp/deeper" in details
