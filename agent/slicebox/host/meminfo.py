"""The host's memory as the kernel counts it (``/proc/meminfo``): the total, and what is
available now (``MemAvailable``: free memory and what the kernel can reclaim without swapping),
which the capacity answer reports beside admission's figures, never in them: it moves with
every page cache, while admission counts what sandboxes are promised.
"""

from __future__ import annotations

from pathlib import Path

from slicebox.model.capacity import HostMemory

MEMINFO = Path("/proc/meminfo")


def parse_meminfo(text: str) -> HostMemory:
    """MemTotal and MemAvailable (kB in the file) in bytes; MemAvailable is None where the
    kernel gives none (before 3.14)."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if name in ("MemTotal", "MemAvailable") and words and words[0].isdigit():
            found[name] = int(words[0]) * 1024
    return HostMemory(
        total_bytes=found.get("MemTotal", 0), available_bytes=found.get("MemAvailable")
    )


def read_meminfo(path: Path = MEMINFO) -> HostMemory:
    """The host's memory now; a file that cannot be read says nothing (zero, None)."""
    try:
        return parse_meminfo(path.read_text())
    except OSError:
        return HostMemory(total_bytes=0, available_bytes=None)
