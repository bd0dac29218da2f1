"""A caller that holds a request open, run as a test user (``runuser``): it sends one request
over the agent's socket, reads the answer until ``--until`` appears in it, prints ``held`` and
then reads nothing more until its stdin closes (a slow reader: the agent's answer waits on it,
and so does what the request holds).

    python3 -m tests.host.holder POST /v1/sandboxes/ID/exec/stream --body '{...}' --until stream
"""

from __future__ import annotations

import argparse
import socket
import sys

from tests.host.agentunits import SOCKET


def request(method: str, path: str, body: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("method")
    parser.add_argument("path")
    parser.add_argument("--body", default="")
    parser.add_argument("--until", default="")
    args = parser.parse_args()
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(str(SOCKET))
    conn.sendall(request(args.method, args.path, args.body.encode()))
    received = b""
    while args.until.encode() not in received:
        piece = conn.recv(4096)
        if not piece:
            sys.exit(f"the agent closed the answer before {args.until!r}: {received[:2000]!r}")
        received += piece
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
    conn.close()


if __name__ == "__main__":
    main()
