"""The agent's listening socket: systemd's (socket activation) or one it binds itself."""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path

from slicebox.model.errors import HostError

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
SOCKET_MODE = 0o660
SOCKET_GROUP = "slicebox"


def activated_sockets(env: Mapping[str, str], pid: int) -> list[socket.socket]:
    """Sockets passed by systemd (sd_listen_fds protocol), meant for this very process."""
    if env.get("LISTEN_PID") != str(pid):
        return []
    count = int(env.get("LISTEN_FDS", "0"))
    return [
        socket.socket(fileno=fd) for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count)
    ]


def bind_unix(path: Path, group: str | None = SOCKET_GROUP) -> socket.socket:
    """Bind ``path`` ourselves: mode 0660, owned by ``group`` when that group exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise HostError(f"{path} exists and is not a socket; remove it or pick another path")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117)  # never a moment where the socket is wider than 0660
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, SOCKET_MODE)
    _chgrp(path, group)
    sock.listen(128)
    return sock


def _chgrp(path: Path, group: str | None) -> None:
    if group is None:
        return
    try:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    except KeyError:
        log.warning("group %s does not exist; %s is reachable by its owner only", group, path)


def listening_socket(path: Path, env: Mapping[str, str] | None = None) -> socket.socket:
    sockets = activated_sockets(os.environ if env is None else env, os.getpid())
    if len(sockets) > 1:
        raise HostError(f"systemd passed {len(sockets)} sockets; slicebox.socket defines one")
    if sockets:
        log.info("using the socket passed by systemd")
        return sockets[0]
    return bind_unix(path)
