"""A cgroup's freezer (``cgroup.freeze``): a native sandbox's pause, its state kept by the
kernel, where a restarted agent reads it back (a frozen cgroup stays frozen whoever wrote it).
Docker's sandboxes are paused by the engine instead (backends.dockersnap), which records it."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from slicebox.model.errors import HostError, SandboxNotFound
from slicebox.model.paths import CGROUP_MOUNT


class Freezer(Protocol):
    def set_frozen(self, cgroup: str, frozen: bool) -> None: ...


class CgroupFreezer:
    """:class:`Freezer` on the cgroup v2 files below ``root``."""

    def __init__(self, root: Path = CGROUP_MOUNT) -> None:
        self._root = root

    def set_frozen(self, cgroup: str, frozen: bool) -> None:
        path = self._root / cgroup.lstrip("/") / "cgroup.freeze"
        try:
            path.write_text("1" if frozen else "0")
        except FileNotFoundError as exc:
            raise SandboxNotFound(f"no cgroup {cgroup}: the sandbox is gone") from exc
        except OSError as exc:
            raise HostError(f"could not write {path} ({exc.strerror})") from exc
