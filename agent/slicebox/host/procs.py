"""A sandbox's scope cgroup and its processes, read from cgroupfs and /proc (host view).

``CgroupHost`` is ``execution.SandboxHost`` on a real host. Killing an exec only ever touches
processes listed in the sandbox's own ``cgroup.procs``: a recycled pid elsewhere on the host is
never signalled.

What belongs to an exec (``exec_members``), decided on the host pid Docker reports for it:

- its session. runc makes every exec a session leader (``setsid`` in nsexec), and the kernel
  keeps a pid number allocated while any process still has it as its session id, so every
  process whose session is the exec's pid is the exec's, even after the exec's own process
  exited and its children were reparented to the container's init. A fork bomb's first shell
  exits at once, so this is how its processes are found;
- the exec's process and every descendant of a member (which takes in a child that started a
  session of its own while its parent lives);
- nothing that started before the exec began (``since``, in /proc start-time ticks): the
  container's init and main process, and what earlier execs left, are never signalled.

Other execs of the same sandbox lead sessions of their own and are nobody's descendants inside
the container, so killing one exec never touches another. Left alone: a process that started
a session of its own and whose parent has died (a deliberate daemon). Nothing in /proc tells it
from the daemon of another exec started in the same window (both are young, children of init,
leaders of their own sessions), so it is left to the sandbox, which it ends with. The one hole:
once every process of the exec is gone, its pid may be recycled by a newer session leader in
the same sandbox; that needs the host's whole pid space (``pid_max``) to wrap meanwhile.

Forks race any enumerate-then-kill loop, so each round runs with the scope frozen
(``cgroup.freeze``): a frozen process cannot fork, and cgroup v2 delivers SIGKILL to frozen
processes, which die without being thawed. The freeze lasts milliseconds for the sandbox's
other processes. A scope that is frozen already (``docker pause``) is left frozen.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from slicebox.model.errors import HostError
from slicebox.model.paths import CGROUP_MOUNT

log = logging.getLogger(__name__)

PROC = Path("/proc")
KILL_ROUNDS = 50
ROUND_PAUSE = 0.02
FREEZE_WAIT = 1.0
FREEZE_POLL = 0.005
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ProcInfo(NamedTuple):
    pid: int
    ppid: int
    session: int
    started: int  # clock ticks after boot (starttime in /proc/<pid>/stat)


def parse_stat(pid: int, text: str) -> ProcInfo:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces and parens)."""
    fields = text[text.rindex(")") + 2 :].split()
    return ProcInfo(pid=pid, ppid=int(fields[1]), session=int(fields[3]), started=int(fields[19]))


def exec_members(pid: int, since: int, processes: Iterable[ProcInfo]) -> set[int]:
    """Living pids that belong to the exec ``pid`` begun at ``since`` (see the module doc)."""
    table = {p.pid: p for p in processes if p.started >= since}
    members = {p.pid for p in table.values() if pid in (p.pid, p.session)}
    grew = True
    while grew:
        more = {p.pid for p in table.values() if p.ppid in members} - members
        members |= more
        grew = bool(more)
    return members


def parse_oom_kills(text: str) -> int | None:
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None


def is_frozen(events: str | None) -> bool:
    """cgroup.events says ``frozen 1``: every process in the cgroup is stopped."""
    return events is not None and "frozen 1" in events.splitlines()


def cgroup_from_proc(text: str) -> str:
    """The cgroup v2 path from /proc/<pid>/cgroup ("0::/a/b.scope")."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise HostError("the process is not in a cgroup v2 hierarchy: slicebox needs cgroup v2")


def boot_clock() -> float:
    """Seconds since boot, suspend included: the clock /proc start times are kept on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class CgroupHost:
    """``execution.SandboxHost`` on cgroupfs and /proc."""

    def __init__(
        self,
        cgroup_root: Path = CGROUP_MOUNT,
        proc: Path = PROC,
        kill: Callable[[int, int], None] = os.kill,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = boot_clock,
    ) -> None:
        self._root = cgroup_root
        self._proc = proc
        self._kill = kill
        self._sleep = sleep
        self._clock = clock
        # One kill at a time (they are rare and take milliseconds): two execs of a sandbox
        # timing out together must not thaw the scope under each other.
        self._killing = threading.Lock()

    def cgroup_of(self, pid: int) -> Path:
        text = _read(self._proc / str(pid) / "cgroup")
        if text is None:
            raise HostError(f"process {pid} vanished while its cgroup was looked up: retry")
        return self._root / cgroup_from_proc(text).lstrip("/")

    def cgroup_at(self, relative: str) -> Path:
        return self._root / relative.lstrip("/")

    def oom_kills(self, cgroup: Path) -> int | None:
        text = _read(cgroup / "memory.events")
        return None if text is None else parse_oom_kills(text)

    def process_clock(self) -> int:
        # Rounded down, like the kernel's start times: a process started now is not earlier.
        return int(self._clock() * CLOCK_TICKS)

    def kill_exec(self, cgroup: Path, pid: int, since: int) -> int:
        killed: set[int] = set()
        with self._killing:
            for _ in range(KILL_ROUNDS):
                members = self._kill_round(cgroup, pid, since)
                if not members:
                    return len(killed)
                killed |= members
                self._sleep(ROUND_PAUSE)
        raise HostError(f"processes of exec pid {pid} survived {KILL_ROUNDS} rounds of SIGKILL")

    def kill_since(self, cgroup: Path, since: int) -> int:
        """SIGKILL every process of the cgroup started at ``since`` or later (a reused pool
        member's, since its acquire: its init and main process are older), with the cgroup
        frozen each round as for an exec; how many were killed."""
        killed: set[int] = set()
        with self._killing:
            for _ in range(KILL_ROUNDS):
                with self._frozen(cgroup):
                    members = {p.pid for p in self.processes(cgroup) if p.started >= since}
                    for member in members:
                        self._signal(member)
                if not members:
                    return len(killed)
                killed |= members
                self._sleep(ROUND_PAUSE)
        raise HostError(f"processes of {cgroup} survived {KILL_ROUNDS} rounds of SIGKILL")

    def processes(self, cgroup: Path) -> list[ProcInfo]:
        """Living processes in the cgroup (zombies are dead already and cannot be killed)."""
        text = _read(cgroup / "cgroup.procs") or ""
        infos = (self._info(int(pid)) for pid in text.split())
        return [info for info in infos if info is not None]

    def _kill_round(self, cgroup: Path, pid: int, since: int) -> set[int]:
        """SIGKILL every member seen with the scope frozen; the members signalled."""
        with self._frozen(cgroup):
            members = exec_members(pid, since, self.processes(cgroup))
            for member in members:
                self._signal(member)
        return members

    @contextlib.contextmanager
    def _frozen(self, cgroup: Path) -> Iterator[None]:
        """Freeze the cgroup for the block, then thaw it, unless it has no freezer (the block
        runs as it is) or was frozen already (a paused sandbox stays paused)."""
        freeze = cgroup / "cgroup.freeze"
        state = _read(freeze)
        if state is None or state.strip() != "0" or not _write(freeze, "1"):
            yield
            return
        try:
            self._wait_frozen(cgroup)
            yield
        finally:
            self._thaw(freeze)

    def _wait_frozen(self, cgroup: Path) -> None:
        # A process in uninterruptible sleep (a hung NFS read) can hold the freeze off: kill
        # what can be killed anyway; the next round sees the rest.
        for _ in range(round(FREEZE_WAIT / FREEZE_POLL)):
            if is_frozen(_read(cgroup / "cgroup.events")):
                return
            self._sleep(FREEZE_POLL)
        log.warning("%s did not freeze within %ss: killing without it", cgroup, FREEZE_WAIT)

    def _thaw(self, freeze: Path) -> None:
        try:
            freeze.write_text("0")
        except FileNotFoundError:
            return  # the sandbox is gone, and its cgroup with it
        except OSError as exc:
            raise HostError(
                f"could not thaw {freeze.parent} ({exc}): the sandbox stays frozen until "
                f"0 is written to {freeze}"
            ) from exc

    def _info(self, pid: int) -> ProcInfo | None:
        text = _read(self._proc / str(pid) / "stat")
        if text is None or text[text.rindex(")") + 2] in "ZX":
            return None
        return parse_stat(pid, text)

    def _signal(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._kill(pid, signal.SIGKILL)


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
    except OSError as exc:
        log.warning("could not write %s to %s: %s", value, path, exc)
        return False
    return True


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError, OSError):
        return None
