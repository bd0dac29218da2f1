"""A sandbox's scope cgroup and its processes, read from cgroupfs and /proc (host view).

``CgroupHost`` is ``execution.SandboxHost`` on a real host. Killing an exec only ever touches
processes listed in the sandbox's own ``cgroup.procs``: a recycled pid elsewhere on the host is
never signalled. What belongs to an exec: its process (the host pid Docker reports), every
descendant, and every process of its session when the exec leads one (runc starts an exec in a
new session), which catches children that were reparented to the container's init when their
parent died. A process that started a session of its own (a deliberate daemon) is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from slicebox.model.errors import HostError
from slicebox.model.paths import CGROUP_MOUNT

log = logging.getLogger(__name__)

PROC = Path("/proc")
KILL_ROUNDS = 50


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    session: int


def parse_stat(pid: int, text: str) -> ProcInfo:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces and parens)."""
    fields = text[text.rindex(")") + 2 :].split()
    return ProcInfo(pid=pid, ppid=int(fields[1]), session=int(fields[3]))


def exec_session(target: int, processes: Iterable[ProcInfo]) -> int | None:
    """The exec's session id if the exec leads its own session, else None."""
    for proc in processes:
        if proc.pid == target and proc.session == target:
            return target
    return None


def exec_members(roots: set[int], session: int | None, processes: Iterable[ProcInfo]) -> set[int]:
    """Living pids that belong to an exec: the roots, their descendants, the exec's session."""
    table = {proc.pid: proc for proc in processes}
    members = {pid for pid in roots if pid in table}
    members |= {p.pid for p in table.values() if session is not None and p.session == session}
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


def cgroup_from_proc(text: str) -> str:
    """The cgroup v2 path from /proc/<pid>/cgroup ("0::/a/b.scope")."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise HostError("the process is not in a cgroup v2 hierarchy: slicebox needs cgroup v2")


class CgroupHost:
    """``execution.SandboxHost`` on cgroupfs and /proc."""

    def __init__(
        self,
        cgroup_root: Path = CGROUP_MOUNT,
        proc: Path = PROC,
        kill: Callable[[int, int], None] = os.kill,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._root = cgroup_root
        self._proc = proc
        self._kill = kill
        self._sleep = sleep

    def cgroup_of(self, pid: int) -> Path:
        text = _read(self._proc / str(pid) / "cgroup")
        if text is None:
            raise HostError(f"process {pid} vanished while its cgroup was looked up: retry")
        return self._root / cgroup_from_proc(text).lstrip("/")

    def oom_kills(self, cgroup: Path) -> int | None:
        text = _read(cgroup / "memory.events")
        return None if text is None else parse_oom_kills(text)

    def kill_exec(self, cgroup: Path, pid: int) -> int:
        session = exec_session(pid, self.processes(cgroup))
        killed: set[int] = {pid}
        for _ in range(KILL_ROUNDS):
            # Killed pids stay roots: their children may outlive them for a moment.
            members = exec_members(killed, session, self.processes(cgroup))
            if not members:
                return len(killed)
            for member in members:
                self._signal(member)
            killed |= members
            self._sleep(0.02)
        raise HostError(f"processes of exec pid {pid} survived {KILL_ROUNDS} rounds of SIGKILL")

    def processes(self, cgroup: Path) -> list[ProcInfo]:
        """Living processes in the cgroup (zombies are dead already and cannot be killed)."""
        text = _read(cgroup / "cgroup.procs") or ""
        infos = (self._info(int(pid)) for pid in text.split())
        return [info for info in infos if info is not None]

    def _info(self, pid: int) -> ProcInfo | None:
        text = _read(self._proc / str(pid) / "stat")
        if text is None or text[text.rindex(")") + 2] in "ZX":
            return None
        return parse_stat(pid, text)

    def _signal(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._kill(pid, signal.SIGKILL)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError, OSError):
        return None
