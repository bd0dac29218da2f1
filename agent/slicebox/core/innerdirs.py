"""A nested sandbox's socket directory on the host (``/run/slicebox/nested/<id>``), made
by its create and bound into it at ``/run/slicebox``, with the environment that names it;
``server.inner`` binds the socket in it once the sandbox runs."""

from __future__ import annotations

import contextlib
from pathlib import Path

from slicebox.model.labels import Lineage
from slicebox.model.nested import (
    INNER_DIRECTORY,
    INNER_SOCKET,
    INNER_SOCKET_NAME,
    PROJECT_ENV,
    SOCKET_ENV,
)
from slicebox.model.spec import Backend, Mount


def inner_directory(root: Path, sandbox_id: str) -> Path:
    """The directory of a nested sandbox's socket (``server.inner`` binds the socket in it),
    made now, root's and empty, for the create to bind into the sandbox."""
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    root.chmod(0o711)  # whatever the umask: anyone may pass, no one may list the ids
    directory = root / sandbox_id
    directory.mkdir(mode=0o755, exist_ok=True)
    directory.chmod(0o755)  # the sandbox's processes, whoever they run as, reach its socket
    return directory


def drop_inner_directory(root: Path, sandbox_id: str) -> None:
    """A nested sandbox's socket directory gone, with the socket in it."""
    directory = root / sandbox_id
    with contextlib.suppress(FileNotFoundError):
        for entry in directory.iterdir():
            entry.unlink(missing_ok=True)
        directory.rmdir()


def handed_socket(lineage: Lineage, root: Path) -> tuple[tuple[Mount, ...], dict[str, str]]:
    """A nested sandbox's socket directory at ``/run/slicebox`` (the directory, not the
    socket: one re-made after an agent's restart is a new file the bind would not show), and
    the environment that names it and the project its children are in. A native sandbox has
    it at its own path, where its unit shows it and no other sandbox's."""
    if not lineage.nested:
        return (), {}
    source = str(root / lineage.sandbox_id)
    if lineage.backend == Backend.NATIVE.value:  # it sees the host's /run (backends.native)
        mount = Mount(source=source, target=source, read_only=True)
        return (mount,), {SOCKET_ENV: f"{source}/{INNER_SOCKET_NAME}", PROJECT_ENV: lineage.project}
    mount = Mount(source=source, target=INNER_DIRECTORY, read_only=True)
    return (mount,), {SOCKET_ENV: INNER_SOCKET, PROJECT_ENV: lineage.project}
