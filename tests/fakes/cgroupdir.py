"""cgroupfs as a plain directory tree: ``host.cgroupfs.CgroupFS``'s reads, for unit tests."""

from __future__ import annotations

from pathlib import Path


class CgroupDir:
    """cgroupfs below ``root``, as host.cgroupfs.CgroupFS reads it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def read(self, cgroup: str, name: str) -> str | None:
        try:
            return (self.root / cgroup / name).read_text()
        except FileNotFoundError:
            return None

    def children(self, cgroup: str) -> list[str]:
        return []
