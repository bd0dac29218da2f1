"""A hostile local user against the agent's socket, run as that user (``runuser``) so the agent
knows it by SO_PEERCRED. Prints one JSON line per report on stdout.

    python3 -m tests.host.socketattack stall --connections 300 --ready FILE --stop FILE
        opens the connections, sends on each an exec request with ``Content-Length: 4194304``
        and all but the last byte of its body (as far as the agent takes them), and holds
        them until the stop FILE exists (or ``--hold`` seconds passed); the ready FILE is
        written once every connection has sent what it could or was closed. It reports how
        many were answered (by status), closed by the agent, and held open.

    python3 -m tests.host.socketattack corpus
        sends each request of the smuggling corpus on a connection of its own and reports
        the status of its answer (None: none) and whether a second answer came.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import time
from collections import Counter
from pathlib import Path

from tests.httpcorpus import SMUGGLING

SOCKET = "/run/slicebox/slicebox.sock"
BODY = 4 * 1024 * 1024
HEAD = (
    b"POST /v1/sandboxes/sbx-stalled/exec HTTP/1.1\r\nHost: localhost\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % BODY
)


class Stalled:
    """One connection sending its request (no copy of the 4 MiB: a view into one buffer)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent = 0
        self.got = b""

    def on(self, events: int, payload: memoryview) -> tuple[bool, bool]:
        """Read what the agent answers, send what it takes: (still open, bytes went out)."""
        if events & selectors.EVENT_READ:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                return False, False
            self.got += data[: 4096 - len(self.got)]
        if not events & selectors.EVENT_WRITE or self.sent == len(payload):
            return True, False
        try:
            self.sent += self.sock.send(payload[self.sent :])
        except BlockingIOError:
            return True, False
        except OSError:
            return False, False
        return True, True


def stall(connections: int, hold: float, ready: Path, stop: Path) -> dict[str, object]:
    payload = memoryview(HEAD + b"{" + b" " * (BODY - 2))  # all but the last byte
    selector = selectors.DefaultSelector()
    open_, failed = [], 0
    for _ in range(connections):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(SOCKET)
        except OSError:
            sock.close()
            failed += 1
            continue
        sock.setblocking(False)
        entry = Stalled(sock)
        open_.append(entry)
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, entry)
    closed, ready_said = 0, False
    progress = time.monotonic()
    end = progress + hold
    while time.monotonic() < end and not stop.exists():
        for key, events in selector.select(0.2):
            entry = key.data
            still, moved = entry.on(events, payload)
            if moved:
                progress = time.monotonic()
            if not still:
                selector.unregister(entry.sock)
                entry.sock.close()
                closed += 1
            elif entry.sent == len(payload) and key.events & selectors.EVENT_WRITE:
                selector.modify(entry.sock, selectors.EVENT_READ, entry)
        # Each connection sent all it could (nothing moved for 3 s): the agent reads no more
        # of the stalled ones.
        if not ready_said and time.monotonic() - progress > 3:
            ready.write_text("ready")
            ready_said = True
    statuses = Counter(_status(entry.got) for entry in open_ if entry.got)
    held = len(selector.get_map())
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return {
        "connected": len(open_),
        "connect_failed": failed,
        "answered": dict(statuses),
        "closed_by_agent": closed,
        "held": held,
    }


def _status(got: bytes) -> str:
    parts = got.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 and parts[0].startswith(b"HTTP/") else "?"


def corpus() -> list[dict[str, object]]:
    # The unit test's /echo is an exec here: a route that reads its body (a well-formed one
    # would be answered not_found, and do nothing).
    cases = [(request.replace(b" /echo ", b" /v1/sandboxes/sbx-none/exec "), status)
             for request, status in SMUGGLING]  # fmt: skip
    cases.append((b"GET /v1/sandboxes/a%2F..%2Fb HTTP/1.1\r\nHost: x\r\n\r\n", 400))
    reports = []
    for request, expected in cases:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(SOCKET)
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            got = b""
            try:
                while data := sock.recv(65536):
                    got += data
            except OSError:
                pass
        answers = got.count(b"HTTP/1.1 ")
        reports.append(
            {
                "request": request[:120].decode("latin-1"),
                "expected": expected,
                "status": int(_status(got)) if got else None,
                "answers": answers,
                "traceback": b"Traceback" in got,
            }
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # gone in mid-body
        sock.connect(SOCKET)
        sock.sendall(HEAD.replace(b"%d" % BODY, b"1000") + b"{ ")
        time.sleep(0.5)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["stall", "corpus"])
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--hold", type=float, default=60.0)
    parser.add_argument("--ready", type=Path, default=Path("/tmp/socketattack.ready"))
    parser.add_argument("--stop", type=Path, default=Path("/tmp/socketattack.stop"))
    options = parser.parse_args()
    if options.mode == "stall":
        print(
            json.dumps(stall(options.connections, options.hold, options.ready, options.stop)),
            flush=True,
        )
    else:
        print(json.dumps(corpus()), flush=True)


if __name__ == "__main__":
    main()
