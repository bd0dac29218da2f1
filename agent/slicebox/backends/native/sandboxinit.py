"""A native sandbox's init: PID 1 of its PID namespace and the parent of every exec's process.

The sandbox's anchor runs it (``units.init_properties``) with the host's python3 as a script
(``python3 -I -B sandboxinit.py SOCKET AGENT_UID CWD [COMMAND...]``): it imports the standard
library alone, so it costs the sandbox a few MiB and starts in a moment. Every process of the
sandbox is forked from it and inherits what the anchor runs with: its namespaces (mount, user,
PID, network, IPC, /tmp), its system call filter, no capability, no new privileges. So every exec
sees and may signal the sandbox's other processes, and nothing outside it. It:

- listens on ``SOCKET``, in a runtime directory of its own that only root and the sandbox's
  user reach, and serves ``AGENT_UID`` alone (root: the agent; the peer's credentials are the
  kernel's), never the sandbox's own processes;
- for each exec the agent orders (a frame: argv, cwd and env, the stdio as descriptors) forks
  a child that says hello (``C``) on the connection, so the kernel tells the agent its pid,
  and waits: the agent moves it into a scope of its own, then says go (``G``), and only then
  does the child become the command (``/bin/sh`` enters the cwd and finds the program: 126
  and 127 as Docker's exec). When the command exits the init reports how, as one JSON line;
- reaps every orphan of the sandbox (it is PID 1);
- takes over an ended exec's output pipes when the agent hands them back (``D``), and reads
  and drops what the exec's background processes still write there, so a server left running
  never meets a closed pipe;
- runs the sandbox's own command, when it has one, and ends with it: the sandbox has exited.

Nothing here is trusted by the agent: the sandbox's own code can replace the init. The agent
believes only the kernel (the hello's credentials, the process's cgroup), see ``claims``.
The agent's side of this wire is ``initwire``.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys

SHELL = "/bin/sh"
EXEC_WRAPPER = 'cd -- "$1" || exit 126; shift; exec "$@"'
IDLE = ["sleep", "infinity"]  # the default command: the init's own waiting does as well
HEADER = struct.Struct(">I")
MAX_ORDER = 16 << 20
MAX_FDS = 3
ORDER_TIMEOUT = 10.0
READ_SIZE = 65536
HELLO, GO, DRAIN = b"C", b"G", b"D"
# What systemd gives the init alone: its children are not the service's main process.
PRIVATE_ENV = (
    "NOTIFY_SOCKET",
    "JOURNAL_STREAM",
    "SYSTEMD_EXEC_PID",
    "RUNTIME_DIRECTORY",
    "MEMORY_PRESSURE_WATCH",
    "MEMORY_PRESSURE_WRITE",
    "MAINPID",
)


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def report_of(status: int) -> bytes:
    if os.WIFSIGNALED(status):
        return json.dumps({"signaled": os.WTERMSIG(status)}).encode() + b"\n"
    return json.dumps({"exited": exit_code(status)}).encode() + b"\n"


def received_fds(conn: socket.socket, size: int) -> tuple[bytes, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, size, MAX_FDS)
    for fd in fds:
        os.set_inheritable(fd, False)
    return data, fds


def read_order(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    """The agent's order: a length, its JSON, and the exec's stdio with the first bytes."""
    data, fds = received_fds(conn, READ_SIZE)
    try:
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            if len(data) >= HEADER.size and HEADER.unpack_from(data)[0] > MAX_ORDER:
                raise ValueError("order too large")
            chunk = conn.recv(READ_SIZE)
            if not chunk:
                raise ValueError("the agent hung up mid-order")
            data += chunk
        order = json.loads(data[HEADER.size :])
        if not isinstance(order, dict):
            raise ValueError("an order is an object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return order, fds


def default_signals() -> None:
    """What a command is given: every signal at its default (Python ignores SIGPIPE)."""
    signal.set_wakeup_fd(-1)
    for number in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # The init is the OOM killer's last choice; its children are anyone's.
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as adj:
        adj.write("0")


def exec_command(cwd: str, argv: list[str], env: dict[str, str]) -> None:
    os.execve(SHELL, [SHELL, "-c", EXEC_WRAPPER, "sh", cwd, *argv], env)  # noqa: S606


def child(conn: socket.socket, go: int, order: dict[str, object], fds: list[int]) -> None:
    """The exec's process until it becomes the command: its stdio, its hello, the go."""
    default_signals()
    os.setsid()
    stdin = fds[0] if order.get("stdin") else os.open(os.devnull, os.O_RDONLY)
    out, err = fds[-2:]
    for target, fd in ((0, stdin), (1, out), (2, err)):
        os.dup2(fd, target)
    conn.sendall(HELLO)
    if os.read(go, 1) != GO:
        os._exit(1)  # the agent hung up (it refused the hello): nothing runs
    env = dict(os.environ)
    env.update(strings_of(order.get("env")))
    exec_command(str(order.get("cwd") or "/"), argv_of(order), env)


def argv_of(order: dict[str, object]) -> list[str]:
    argv = order.get("argv")
    if not isinstance(argv, list) or not argv:
        raise ValueError("an order names argv")
    return [str(arg) for arg in argv]


def strings_of(value: object) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


class Exec:
    """One exec's connection: the child's pid, its go pipe until the go, its report."""

    def __init__(self, conn: socket.socket, pid: int, go: int) -> None:
        self.conn = conn
        self.pid = pid
        self.go: int | None = go

    def release(self, word: bytes) -> None:
        if self.go is not None:
            if word == GO:
                os.write(self.go, GO)
            os.close(self.go)
            self.go = None


class Init:
    def __init__(self, path: str, agent_uid: int, cwd: str, command: list[str]) -> None:
        self.agent_uid = agent_uid
        self.selector = selectors.DefaultSelector()
        self.execs: dict[int, Exec] = {}  # child pid -> its exec
        self.main: int | None = None
        self.cwd = cwd
        self.listener = self._listen(path)
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(wake_read, selectors.EVENT_READ, self._woken)
        if command and command != IDLE:
            self.main = self._spawn_main(command)

    @staticmethod
    def _listen(path: str) -> socket.socket:
        if os.path.exists(path):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        # The agent has no CAP_DAC_OVERRIDE: the socket is anyone's to connect to, and its
        # directory (0700, the sandbox user's) is what keeps everyone else away. Whoever gets
        # through is still served only if it is the agent (its peer credentials).
        os.chmod(path, 0o666)  # noqa: S103
        listener.listen(64)
        listener.setblocking(False)
        return listener

    def _spawn_main(self, command: list[str]) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                default_signals()
                exec_command(self.cwd, command, dict(os.environ))
            finally:
                os._exit(127)
        return pid

    def run(self) -> None:
        while True:
            for key, _ in self.selector.select():
                key.data(key.fileobj)

    def _woken(self, fd: int) -> None:
        try:
            while os.read(fd, 512):
                pass
        except BlockingIOError:
            pass
        self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.main:
                sys.exit(exit_code(status))  # the sandbox's command ended: so does the sandbox
            ended = self.execs.pop(pid, None)
            if ended is not None:
                ended.release(b"")
                self._send(ended.conn, report_of(status))

    @staticmethod
    def _send(conn: socket.socket, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the agent has gone: nobody waits for the report
            conn.send(data)

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != self.agent_uid:  # the sandbox's own processes give no orders
            conn.close()
            return
        conn.settimeout(ORDER_TIMEOUT)
        try:
            order, fds = read_order(conn)
        except (OSError, ValueError):
            conn.close()
            return
        self._start(conn, order, fds)

    def _start(self, conn: socket.socket, order: dict[str, object], fds: list[int]) -> None:
        try:
            argv_of(order)
            if len(fds) != (3 if order.get("stdin") else 2):
                raise ValueError("an order passes the exec's stdio")
            go_read, go_write = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                os.close(go_read)
                os.close(go_write)
                raise
        except (OSError, ValueError) as exc:
            for fd in fds:
                os.close(fd)
            self._send(conn, json.dumps({"error": str(exc)}).encode() + b"\n")
            conn.close()
            return
        if pid == 0:
            try:
                os.close(go_write)
                for other in self.execs.values():  # another child's go is not this one's
                    other.release(b"")
                child(conn, go_read, order, fds)
            finally:
                os._exit(127)
        os.close(go_read)
        for fd in fds:
            os.close(fd)
        conn.setblocking(False)
        self.execs[pid] = Exec(conn, pid, go_write)
        self.selector.register(conn, selectors.EVENT_READ, self._heard)

    def _heard(self, conn: socket.socket) -> None:
        try:
            data, fds = received_fds(conn, 64)
        except BlockingIOError:
            return
        except OSError:
            data, fds = b"", []
        waiting = next((e for e in self.execs.values() if e.conn is conn), None)
        if waiting is not None and data[:1] == GO:
            waiting.release(GO)
        for fd in fds:  # DRAIN: an ended exec's output, still held by what it left running
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, self._drain)
        if not data:  # the agent hung up: a child still waiting for its go never runs
            if waiting is not None:
                waiting.release(b"")
            self.selector.unregister(conn)
            conn.close()

    def _drain(self, fd: int) -> None:
        try:
            if os.read(fd, READ_SIZE):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self.selector.unregister(fd)
        os.close(fd)


def notify_ready() -> None:
    """Tell systemd the socket listens (``Type=notify``), and keep its socket from children."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    for name in PRIVATE_ENV:
        os.environ.pop(name, None)
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.sendto(b"READY=1", address)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or not argv[1].isdigit():
        sys.exit("usage: sandboxinit.py SOCKET AGENT_UID CWD [COMMAND...]")
    init = Init(argv[0], int(argv[1]), argv[2], argv[3:])
    notify_ready()
    init.run()


if __name__ == "__main__":
    main(sys.argv[1:])
