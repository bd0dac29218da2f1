"""The agent's side of the wire to a native sandbox's init (``sandboxinit``, which says how it
works): an exec's order, the child's hello, the go, the init's report, the hand-back of the
output pipes.

The init runs as the sandbox's user and its code can be replaced by the sandbox's own: what it
sends is parsed here, once, and believed only where the kernel vouches for it (the hello's
credentials, which a process cannot forge for another pid).
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import stat
import struct
from pathlib import Path

from pydantic import ConfigDict

from slicebox.model.base import Model
from slicebox.model.errors import HostError

HEADER = struct.Struct(">I")
HELLO, GO, DRAIN = b"C", b"G", b"D"
CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
HANDSHAKE_TIMEOUT = 10.0  # the order's answer: a hello, or the init's refusal
MAX_REPORT = 4096


# The sandbox's init did not run the exec: it refused, or what it said cannot be believed (a
# hello from a process that is not a new child of the init). The error tree's own class (its
# classes are found by their code): a host_error, which the exec's caller is answered.
InitError = HostError


class Order(Model):
    """One exec, as the init is told it: the stdio goes with it as descriptors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    stdin: bool

    def frame(self) -> bytes:
        body = self.model_dump_json().encode()
        return HEADER.pack(len(body)) + body


class Report(Model):
    """How an exec's command ended, as the init reports it (or could not run it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exited: int | None = None
    signaled: int | None = None
    error: str | None = None

    @property
    def exit_code(self) -> int:
        """The exit code as a shell reports it (128+signal when killed)."""
        if self.exited is not None:
            return self.exited
        return 128 + (self.signaled if self.signaled is not None else 9)


def lost() -> Report:
    """The report of an exec whose init hung up first: the sandbox was stopped."""
    return Report(error="the sandbox's init is gone (the sandbox was stopped)")


def report_of(line: bytes) -> Report:
    try:
        return Report.model_validate_json(line)
    except ValueError:
        return Report(error=f"the sandbox's init answered {line[:80]!r}")


def _socket_inode(runtime: Path, name: str, socket_name: str) -> int:
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(runtime, flags | os.O_DIRECTORY)
    try:
        where = os.open(name, flags | os.O_DIRECTORY, dir_fd=top)
    finally:
        os.close(top)
    try:
        owner = os.fstat(where).st_uid
        fd = os.open(socket_name, flags, dir_fd=where)
    finally:
        os.close(where)
    found = os.fstat(fd)
    if not stat.S_ISSOCK(found.st_mode) or found.st_uid != owner or found.st_nlink != 1:
        os.close(fd)
        what = "a link" if stat.S_ISLNK(found.st_mode) else "not the init's own socket"
        raise InitError(
            f"the init's socket of native sandbox {name} was replaced ({what}): code in the "
            "sandbox tampered with it; nothing was run. Destroy the sandbox and create another"
        )
    return fd


def _hello_of(data: bytes, ancillary: list[tuple[int, int, bytes]], rest: bytes) -> int:
    if data != HELLO:
        why = report_of(rest).error if rest else "it hung up"
        raise InitError(f"the sandbox's init did not run the exec: {why}")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _, _ = CREDENTIALS.unpack(payload[: CREDENTIALS.size])
            return int(pid)
    raise InitError("the sandbox's init sent a hello without credentials")


async def handshake(
    runtime: Path, name: str, socket_name: str, order: Order, fds: list[int]
) -> tuple[socket.socket, int]:
    """A connection to the init's socket ``<runtime>/<name>/<socket_name>``, in a directory
    its user (whom its code runs as) may write, made never through a link: each step is opened
    with ``O_NOFOLLOW``, the socket's inode must be a socket of the directory's own owner with
    no other name (not a link to, or a hard link of, the agent's socket or another user's), and
    the connection is made to that very inode (``/proc/self/fd``), whatever the name says by
    then; it receives its peers' credentials. Then ``order`` sent on it with ``fds``, and the
    pid the kernel gives for the sender of the child's hello (in the agent's own PID
    namespace), all on the event loop: a listener of the sandbox's own that never
    answers holds no thread, only this exec (on its user's share of execs) for
    ``HANDSHAKE_TIMEOUT``. InitError past that, or when the init refused or hung up."""
    fd = _socket_inode(runtime, name, socket_name)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        conn.setblocking(False)
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            await _connected(conn, f"/proc/self/fd/{fd}")
            await _sent(conn, order.frame(), fds)
            pid = await _hello(conn)
    except TimeoutError as exc:
        conn.close()
        raise InitError(
            f"the init of native sandbox {name} did not answer the exec within "
            f"{HANDSHAKE_TIMEOUT:.0f} s: nothing was run. Destroy the sandbox and create another"
        ) from exc
    except BaseException:
        conn.close()
        raise
    finally:
        os.close(fd)
    return conn, pid


async def _connected(conn: socket.socket, path: str) -> None:
    """A unix connect does not block but for a full backlog (EAGAIN), when it is tried again."""
    while True:
        try:
            conn.connect(path)
            return
        except BlockingIOError:
            await asyncio.sleep(0.02)


async def _readable(conn: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def heard() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), heard)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())


async def _sent(conn: socket.socket, frame: bytes, fds: list[int]) -> None:
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                sent = socket.send_fds(conn, [frame], fds)
                break
            except BlockingIOError:
                await asyncio.sleep(0.02)
        if sent < len(frame):
            await loop.sock_sendall(conn, frame[sent:])
    except OSError as exc:
        raise InitError(f"the sandbox's init hung up on the exec's order: {exc}") from exc


async def _hello(conn: socket.socket) -> int:
    """The pid the kernel gives for the sender of the child's hello; InitError when the init
    refused the order, hung up, or the hello came without credentials."""
    space = socket.CMSG_SPACE(CREDENTIALS.size)
    try:
        while True:
            try:
                data, ancillary, _, _ = conn.recvmsg(1, space)
                break
            except BlockingIOError:
                await _readable(conn)
        rest = b""
        if data and data != HELLO:
            rest = data + await _line(conn)
    except OSError as exc:  # reset
        raise InitError(f"the sandbox's init did not run the exec: it hung up ({exc})") from exc
    return _hello_of(data, ancillary, rest)


async def _line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_REPORT:
        try:
            chunk = conn.recv(MAX_REPORT)
        except BlockingIOError:
            await _readable(conn)
            continue
        if not chunk:
            break
        data += chunk
    return data


def hand_back(conn: socket.socket, fds: list[int]) -> None:
    """Give the init an ended exec's output pipes to drain (best effort: a full or closed
    connection just leaves them closed)."""
    try:
        conn.sendmsg([DRAIN], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    except OSError:
        return
