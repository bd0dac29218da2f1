"""Bind sources handed to Docker at a path nobody but root can change (issue 37, finding 3).

``host.beneath.pin`` opens a bind source beneath its root following nothing; Docker (runc)
then mounts by *name*, so a caller who swaps the checked directory for a symlink between the
check and runc's mount would get the link's target mounted. So the name Docker gets is not the
caller's: the pinned directory is bound first onto a root-owned staging point,
``/run/slicebox/stage/<sandbox id>/<n>`` (every directory on that path root's, mode 0700), and
Docker binds the staging point. What is bound there is the very directory that was pinned:

- the bind is made in the host's mount namespace, where dockerd sees it (the agent runs in a
  namespace of its own under ``ProtectSystem=strict``/``PrivateTmp``, whose mounts dockerd
  never sees), by a small helper the agent runs with ``nsenter -t 1 -m`` (the unit grants
  ``CAP_SYS_CHROOT`` for this ``setns``): :data:`HELPER`, standard library only, given on the
  command line (nothing of the agent's is imported there);
- the helper opens each source with ``O_PATH`` (no open of a FIFO or a device, whatever was
  put there), and binds it only when the descriptor's device and inode are the pinned ones:
  a swap before that open is refused (``mount_changed``), and after it changes nothing, since
  the bind is made from the descriptor (``/proc/self/fd/<n>``), not from a name;
- once the sandbox runs (its mounts are its own copies) and was verified, the staging points
  are unmounted (``MNT_DETACH``) and removed, whatever the create's outcome; an agent killed
  in between leaves a staging directory the reaper's next pass removes (any not of a create in
  flight). Nothing under a staging point is ever removed: only the empty points, with rmdir.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from slicebox.model.errors import HostError, PolicyViolation

log = logging.getLogger(__name__)

STAGE_ROOT = Path("/run/slicebox/stage")
# The host's mount namespace: PID 1's, where dockerd (a service of it) mounts from.
ENTER_HOST = ("nsenter", "--target", "1", "--mount", "--")
HELPER_TIMEOUT = 60.0
CHANGED_EXIT = 3  # the helper's exit code: a source is not what was pinned

# Run as ``python3 -I -S -c HELPER stage|unstage <dir> [<source> <dev> <ino>]...`` in the
# host's mount namespace. Standard library only: no site, no import of the agent's package.
HELPER = r"""
import ctypes, os, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_BIND, MNT_DETACH = 4096, 2
def made(path):
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        sys.exit(f"{path} is not root's own directory")
def stage(where, entries):
    os.makedirs(os.path.dirname(os.path.dirname(where)), 0o755, exist_ok=True)
    made(os.path.dirname(where))
    made(where)
    for n in range(0, len(entries), 3):
        source, dev, ino = entries[n], int(entries[n + 1]), int(entries[n + 2])
        fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) != (dev, ino):
            print(source, file=sys.stderr)
            sys.exit(3)
        point = os.path.join(where, str(n // 3))
        if stat.S_ISDIR(found.st_mode):
            os.mkdir(point, 0o700)
        else:
            os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        if libc.mount(f"/proc/self/fd/{fd}".encode(), point.encode(), None, MS_BIND, None):
            sys.exit(f"bind of {source}: {os.strerror(ctypes.get_errno())}")
        os.close(fd)
def unstage(where):
    try:
        points = os.listdir(where)
    except FileNotFoundError:
        return
    for name in points:
        point = os.path.join(where, name)
        libc.umount2(point.encode(), MNT_DETACH)
        if os.path.ismount(point):
            sys.exit(f"{point} is still mounted")
        (os.rmdir if stat.S_ISDIR(os.lstat(point).st_mode) else os.unlink)(point)
    os.rmdir(where)
what, where = sys.argv[1], sys.argv[2]
stage(where, sys.argv[3:]) if what == "stage" else unstage(where)
"""


class Staged(tuple[str, ...]):
    """The staging points of one sandbox's binds, in the order of its pinned sources."""


Run = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), capture_output=True, text=True, check=False, timeout=HELPER_TIMEOUT
    )


class Stager:
    """Staging points made and removed by :data:`HELPER` in the host's mount namespace."""

    def __init__(
        self,
        root: Path = STAGE_ROOT,
        enter: Sequence[str] = ENTER_HOST,
        run: Run = _run,
    ) -> None:
        self._root = root
        self._enter = tuple(enter)
        self._run = run
        self._going: set[str] = set()  # sandbox ids whose points a thread is removing
        self._lock = threading.Lock()

    def stage(self, sandbox_id: str, sources: Sequence[tuple[str, int, int]]) -> Staged:
        """Bind each (source, device, inode) onto ``<root>/<sandbox_id>/<n>``; the points. A
        source that is not what was pinned (any more) is refused ``mount_changed``."""
        where = self._root / sandbox_id
        words = [word for source, dev, ino in sources for word in (source, str(dev), str(ino))]
        done = self._helper("stage", where, words)
        if done.returncode == 0:
            return Staged(str(where / str(n)) for n in range(len(sources)))
        self.unstage(sandbox_id)
        if done.returncode == CHANGED_EXIT:
            raise PolicyViolation(
                f"bind mount source {done.stderr.strip()!r} changed while the sandbox was "
                "created (it is no longer the directory that was checked); nothing was kept: "
                "create it again, and keep the source still",
                code="mount_changed",
            )
        raise HostError(f"the bind sources could not be staged for Docker: {_said(done)}")

    def unstage(self, sandbox_id: str) -> None:
        """Unmount and remove ``sandbox_id``'s staging points (none there is fine)."""
        done = self._helper("unstage", self._root / sandbox_id, [])
        if done.returncode != 0:
            log.warning("staging points of %s stay for the reaper: %s", sandbox_id, _said(done))

    def unstage_later(self, sandbox_id: str) -> None:
        """``unstage`` on a thread of its own: a create does not wait for it (an unmount in
        the host's namespace, which every namespace copied from it follows, cost a create more
        than its staging did; see docs/benchmarks.md). One the agent dies before is the
        reaper's (``staged``)."""
        with self._lock:
            if sandbox_id in self._going:
                return
            self._going.add(sandbox_id)
        threading.Thread(target=self._unstage_then_forget, args=(sandbox_id,), daemon=True).start()

    def _unstage_then_forget(self, sandbox_id: str) -> None:
        try:
            self.unstage(sandbox_id)
        finally:
            with self._lock:
                self._going.discard(sandbox_id)

    def staged(self) -> list[str]:
        """The sandbox ids with a staging directory (the agent's view: mounts propagate), but
        those being removed already."""
        try:
            found = sorted(entry.name for entry in self._root.iterdir())
        except FileNotFoundError:
            return []
        with self._lock:
            return [sandbox_id for sandbox_id in found if sandbox_id not in self._going]

    def _helper(
        self, what: str, where: Path, words: Sequence[str]
    ) -> subprocess.CompletedProcess[str]:
        argv = (*self._enter, sys.executable, "-I", "-S", "-c", HELPER, what, str(where), *words)
        try:
            return self._run(argv)
        except (OSError, subprocess.SubprocessError) as exc:
            return subprocess.CompletedProcess(argv, 1, "", str(exc))


def _said(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"
