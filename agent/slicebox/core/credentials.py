"""Credentials a sandbox is given: a git token, through an askpass helper in a directory of its own.

Each sandbox with credentials has ``<state_dir>/<sandbox id>/`` on the host (``/run`` is a
tmpfs: the token never reaches a disk), mode 0700 and owned by the uid the sandbox runs as,
bind-mounted read-only at :data:`MOUNTED_AT` in the sandbox. ``state_dir`` itself is root's,
mode 0700: many sandboxes share a uid (``default_run_as``, the host's nobody among them), and
no host process but root, nor any other sandbox, can reach a directory below it; Docker binds
each into its own sandbox alone. Each user's credentials together hold at most their share of
the tmpfs (``[credentials] user_share``), counted in the pages the tmpfs gives each file:
one user cannot fill it for everyone (``credentials_share_exceeded``). In it:

- ``askpass``: what ``GIT_ASKPASS`` names (set with ``GIT_TERMINAL_PROMPT=0`` for every exec,
  as the container's environment). git runs it with its prompt as the one argument
  (``Username for 'https://host': ``, ``Password for 'https://user@host': ``) and reads the
  answer from its stdout: the username, or the token, for an allowed host only. It uses the
  shell's builtins alone (``read``, ``printf``), so any image with a ``sh`` can run it, and it
  passes the token to no program: it is in no process's argv.
- ``token``, ``username``, ``hosts``: the values, one a line; ``user``: whose they are (the
  share's count).

The state directory is a tmpfs of its own (``run-slicebox-sandboxes.mount``): ``/run`` is
``noexec``, and a bind keeps its source's flags, so git could not run a helper bound from there.

So the token is in no argv, no URL, no ``.git/config``, no label, no environment variable and no
log. The directory goes with its sandbox: a destroy removes it, the deadline timer's expiry
does while the agent is down, and the reaper's ``leftover_files`` rule takes any whose sandbox
is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from pathlib import Path

from slicebox.model.errors import AdmissionRefused, HostError
from slicebox.model.spec import GitCredential

log = logging.getLogger(__name__)

MOUNTED_AT = "/run/slicebox/credentials"
ASKPASS = f"{MOUNTED_AT}/askpass"
GIT_ENV = {"GIT_ASKPASS": ASKPASS, "GIT_TERMINAL_PROMPT": "0"}

# The prompt's URL is between its quotes; its host is after the scheme and any user@.
ASKPASS_SCRIPT = r"""#!/bin/sh
# slicebox: answers git's credential prompts for the hosts allowed, from the files beside it.
here=${0%/*}
url=${1#*\'}
url=${url%\'*}
host=${url#*://}
host=${host#*@}
host=${host%%/*}
allowed=
while IFS= read -r line || [ -n "$line" ]; do
    [ "$line" = "$host" ] && allowed=yes
done < "$here/hosts"
[ -s "$here/hosts" ] || allowed=yes
[ -n "$allowed" ] || exit 1
case "$1" in
    Username*) IFS= read -r answer < "$here/username" ;;
    Password*) IFS= read -r answer < "$here/token" ;;
    *) exit 1 ;;
esac
printf '%s\n' "$answer"
"""


# What a tmpfs gives a file at least (a page), and a directory.
PAGE = 4096
# Writes of every store: a share is counted and taken under it (two creates at once).
_WRITING = threading.Lock()


class CredentialStore:
    """The per-sandbox credential directories under ``state_dir``; ``user_share``: the most
    bytes one user's directories together take (0: no bound)."""

    def __init__(self, state_dir: Path, user_share: int = 0) -> None:
        self._root = state_dir
        self._share = user_share

    def directory(self, sandbox_id: str) -> Path:
        return self._root / sandbox_id

    def write(self, sandbox_id: str, git: GitCredential, user: str = "") -> Path:
        """Make the sandbox's directory with the helper and the values (root's until
        :meth:`give`); a directory left from before is replaced. Refused
        ``credentials_share_exceeded`` when ``user``'s directories would outgrow the share."""
        directory = self.directory(sandbox_id)
        files = {
            "askpass": (ASKPASS_SCRIPT, 0o500),
            "token": (git.token.get_secret_value() + "\n", 0o400),
            "username": (git.username + "\n", 0o400),
            "hosts": ("".join(f"{host}\n" for host in git.hosts), 0o400),
            "user": (user + "\n", 0o400),
        }
        try:
            with _WRITING:
                self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(self._root, 0o700)  # a mount made 0755 by an older unit, too
                self.remove(sandbox_id)
                self._check_share(user, PAGE + sum(_pages(text) for text, _ in files.values()))
                directory.mkdir(mode=0o700)
                for name, (text, mode) in files.items():
                    _write(directory / name, text, mode)
        except OSError as exc:
            self.remove(sandbox_id)
            raise HostError(
                f"the credential directory {directory} could not be written ({exc.strerror}); "
                "is /run/slicebox writable by the agent?"
            ) from exc
        return directory

    def _check_share(self, user: str, wanted: int) -> None:
        if not self._share:
            return
        held = sum(self._size(d) for d in self._root.iterdir() if self._owner(d) == user)
        if held + wanted > self._share:
            raise AdmissionRefused(
                f"the git credentials of user {user!r}'s sandboxes would take {held + wanted} "
                f"bytes of the agent's credential store, more than each user's share of "
                f"{self._share}; destroy sandboxes you no longer need (theirs go with them), "
                "give fewer hosts, or ask an operator to raise [credentials] user_share",
                code="credentials_share_exceeded",
                field="credentials",
            )

    @staticmethod
    def _owner(directory: Path) -> str | None:
        try:
            return (directory / "user").read_text().strip()
        except OSError:
            return None

    @staticmethod
    def _size(directory: Path) -> int:
        try:
            return PAGE + sum(_pages_of(p.stat().st_size) for p in directory.iterdir())
        except OSError:  # removed meanwhile
            return 0

    def give(self, sandbox_id: str, uid: int, gid: int) -> None:
        """Hand the directory and its files to the uid the sandbox runs as."""
        directory = self.directory(sandbox_id)
        try:
            for path in (directory, *sorted(directory.iterdir())):
                os.chown(path, uid, gid, follow_symlinks=False)
        except OSError as exc:
            raise HostError(
                f"the credential directory {directory} could not be given to uid {uid} "
                f"({exc.strerror})"
            ) from exc

    def remove(self, sandbox_id: str) -> bool:
        """Remove the sandbox's directory; False when there was none, or when it could not be
        removed (logged: the reaper's ``leftover_files`` tries again). It is taken back first:
        the agent may not write in a directory that is the sandbox uid's (no DAC_OVERRIDE)."""
        directory = self.directory(sandbox_id)
        if not directory.is_dir():
            return False
        try:
            os.chown(directory, 0, 0, follow_symlinks=False)
            shutil.rmtree(directory)
        except OSError as exc:
            log.warning("the credentials of %s stay for now: %s", sandbox_id, exc)
            return False
        log.info("removed the credentials of %s", sandbox_id)
        return True


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with contextlib.closing(os.fdopen(fd, "w")) as file:
        file.write(text)


def _pages(text: str) -> int:
    return _pages_of(len(text.encode()))


def _pages_of(size: int) -> int:
    """What a file of ``size`` bytes takes in a tmpfs: whole pages, at least one."""
    return max(1, -(-size // PAGE)) * PAGE
