"""A relay to the guest's Docker daemon from another listener: a TCP port on 127.0.0.1, or a
unix socket elsewhere. It stands where a daemon reached another way would listen (a tcp://
DOCKER_HOST, a context's socket, a rootless daemon's), so discovery is shown finding it and the
agent's calls, exec streams included, going through it. Nothing listens beyond the guest."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from types import TracebackType

DAEMON = "/run/docker.sock"


class Relay:
    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.accepted = 0
        self.relayed = 0  # bytes from the client to the daemon

    @classmethod
    def tcp(cls) -> Relay:
        listener = socket.create_server(("127.0.0.1", 0))
        return cls(listener)

    @classmethod
    def unix(cls, path: Path, owner: int = 0) -> Relay:
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        path.chmod(0o600)  # as a rootless daemon's socket: its user's only
        if owner:
            import os

            os.chown(path, owner, -1)
        listener.listen(64)
        return cls(listener)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def __enter__(self) -> Relay:
        self._spawn(self._accept)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        for thread in self._threads:
            thread.join(10)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            daemon = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            daemon.connect(DAEMON)
            with self._lock:
                self.accepted += 1
                self._open += [client, daemon]
            self._spawn(self._pump, client, daemon, True)
            self._spawn(self._pump, daemon, client, False)

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        """Copy until EOF, then half-close the other side (an exec's stdin ends so)."""
        try:
            while data := source.recv(65536):
                sink.sendall(data)
                if counted:
                    with self._lock:
                        self.relayed += len(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            return
