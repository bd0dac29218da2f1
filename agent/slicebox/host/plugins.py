"""WebAssembly plugins the agent holds, by sha256, and plugins read from a caller's roots.

The store is a directory of root's (``/var/cache/slicebox/wasm``, the unit's
``CacheDirectory``), a directory in it per user level, ``<user>/<sha256>.wasm``: a module is
its uploader's, and another user who knows its sha256 neither finds it nor evicts it. Each is
written once through a temporary file and renamed, so a reader never sees half a module. A
user holds at most ``user_limit`` bytes (half of ``limit`` by default): past it that user's
least recently used modules go, never one in use by a sandbox that lives (the caller says
which); the store as a whole holds at most ``limit`` (256 MiB), and an upload that would pass
it with other users' modules is refused ``wasm_store_full`` (nothing of theirs goes). A
sandbox's execs get their module from here on stdin (``backends.wasmrun``), so no sandbox
reads this directory.

A plugin named by path is read the way a bind source is checked (``host.beneath``): beneath
one of the caller's bind roots, no symlink, no ``..``, no other mount on the way; then it must
be a regular file the caller could read (its owner with the owner's read bit, or anyone's read
bit), and a WebAssembly binary.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Collection
from pathlib import Path

from slicebox.host.beneath import BindRoot, pin
from slicebox.model.errors import InvalidRequest, NotFound, PolicyViolation, Unavailable
from slicebox.model.wasm import MAX_PLUGIN_BYTES, digest, is_wasm

STORE = Path("/var/cache/slicebox/wasm")
LIMIT = 256 * 1024 * 1024


class PluginStore:
    """Modules by user and sha256, at most ``user_limit`` bytes a user, ``limit`` in all."""

    def __init__(self, root: Path = STORE, limit: int = LIMIT, user_limit: int = 0) -> None:
        self._root = root
        self._limit = limit
        self._user_limit = user_limit or limit // 2
        self._lock = threading.Lock()

    def path(self, user: str, sha256: str) -> Path:
        return self._directory(user) / f"{sha256}.wasm"

    def _directory(self, user: str) -> Path:
        if not user or "/" in user or user.startswith("."):
            raise ValueError(f"not a user level: {user!r}")
        return self._root / user

    def put(self, user: str, module: bytes, keep: Collection[str] = ()) -> str:
        """Hold ``module`` as ``user``'s; its sha256. ``keep``: modules in use, never evicted
        for it."""
        if not is_wasm(module):
            raise InvalidRequest(
                "the plugin is not a WebAssembly binary (it must start with \\0asm, version 1); "
                "compile it first (wat2wasm for text)",
                code="wasm_invalid",
            )
        if len(module) > MAX_PLUGIN_BYTES:
            raise InvalidRequest(
                f"the plugin is over {MAX_PLUGIN_BYTES // 2**20} MiB", code="wasm_invalid"
            )
        sha = digest(module)
        with self._lock:
            target = self.path(user, sha)
            self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
            target.parent.mkdir(mode=0o700, exist_ok=True)
            if target.exists():
                os.utime(target)  # recently used
                return sha
            partial = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.partial")
            descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as out:
                out.write(module)
            partial.replace(target)
            self._evict(user, {*keep, sha}, target)
        return sha

    def get(self, user: str, sha256: str) -> bytes:
        """``user``'s module; NotFound when the agent holds none of theirs (any more)."""
        target = self.path(user, sha256)
        try:
            module = target.read_bytes()
        except FileNotFoundError as exc:
            raise missing(sha256) from exc
        with contextlib.suppress(OSError):
            os.utime(target)
        return module

    def require(self, user: str, sha256: str) -> None:
        """NotFound (``wasm_not_found``) unless the agent holds the module as ``user``'s."""
        if not self.path(user, sha256).exists():
            raise missing(sha256)

    def held(self, user: str) -> list[str]:
        found = self._directory(user)
        return sorted(p.stem for p in found.glob("*.wasm")) if found.exists() else []

    def _evict(self, user: str, keep: Collection[str], new: Path) -> None:
        """``user``'s least recent modules beyond their share, and beyond the store's limit;
        ``wasm_store_full`` (the new module gone again) when other users' hold the rest."""
        for stray in self._root.glob("*.wasm"):  # an older agent's, by sha256 alone: no one's
            stray.unlink(missing_ok=True)
        files = []
        for path in self._root.glob("*/*.wasm"):
            with contextlib.suppress(FileNotFoundError):
                found = path.stat()
                files.append((found.st_mtime, found.st_size, path))
        total = sum(size for _, size, _ in files)
        own = sorted(f for f in files if f[2].parent.name == user)
        mine = sum(size for _, size, _ in own)
        for _, size, path in own:
            if mine <= self._user_limit and total <= self._limit:
                return
            if path.stem in keep:
                continue
            path.unlink(missing_ok=True)
            mine -= size
            total -= size
        if total > self._limit:
            new.unlink(missing_ok=True)
            raise Unavailable(
                f"the agent's plugin store holds its {self._limit // 2**20} MiB in other "
                "users' plugins and yours in use: this one does not fit now",
                code="wasm_store_full",
            )


def missing(sha256: str) -> NotFound:
    return NotFound(
        f"the agent holds no plugin {sha256}; upload it again (module) or name its path",
        code="wasm_not_found",
    )


def read_plugin(path: str, roots: tuple[BindRoot, ...], uid: int, gids: Collection[int]) -> bytes:
    """The module at ``path``, read beneath the caller's roots as the caller could read it."""
    pinned = pin(path, "/plugin", roots)  # PolicyViolation: outside the roots, a link, missing
    try:
        # O_NONBLOCK: a FIFO put there would otherwise hold the agent's thread on the open.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        descriptor = os.open(pinned.source, flags)
    except OSError as exc:
        raise PolicyViolation(
            f"the plugin {path!r} cannot be read: {exc.strerror}", code="policy_mount"
        ) from exc
    try:
        found = os.fstat(descriptor)
        if (found.st_dev, found.st_ino) != (pinned.device, pinned.inode):
            raise PolicyViolation(
                f"the plugin {path!r} changed while it was read; try again", code="policy_mount"
            )
        if not stat.S_ISREG(found.st_mode):
            raise InvalidRequest(f"the plugin {path!r} is not a regular file", code="wasm_invalid")
        if not _readable(found, uid, gids):
            raise PolicyViolation(
                f"the plugin {path!r} is not readable by you; chmod it or upload it instead",
                code="policy_mount",
            )
        if found.st_size > MAX_PLUGIN_BYTES:
            raise InvalidRequest(
                f"the plugin {path!r} is over {MAX_PLUGIN_BYTES // 2**20} MiB", code="wasm_invalid"
            )
        os.set_blocking(descriptor, True)
        with os.fdopen(os.dup(descriptor), "rb") as source:
            return source.read(MAX_PLUGIN_BYTES + 1)
    finally:
        os.close(descriptor)


def _readable(found: os.stat_result, uid: int, gids: Collection[int]) -> bool:
    if found.st_uid == uid:
        return bool(found.st_mode & stat.S_IRUSR)
    if found.st_gid in gids:
        return bool(found.st_mode & stat.S_IRGRP)
    return bool(found.st_mode & stat.S_IROTH)
