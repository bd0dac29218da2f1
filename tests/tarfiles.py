"""Tar streams made and read in memory, for the tests that move trees (stdlib only: the MCP
driver imports it from the MCP venv's python in the guest)."""

from __future__ import annotations

import io
import tarfile


def tar_of(files: dict[str, bytes]) -> bytes:
    """A tar stream of regular files, each name to its bytes."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def files_of(tar: bytes) -> dict[str, bytes]:
    """The regular files of a tar stream, each name to its bytes."""
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        found = {}
        for member in archive.getmembers():
            extracted = archive.extractfile(member) if member.isfile() else None
            if extracted is not None:
                found[member.name] = extracted.read()
        return found
