"""A small "outside world" inside the guest for the egress tests: a network namespace behind a
veth pair, with HTTP servers and a DNS zone on its own private addresses. Nothing here ever
leaves the guest.

    python3 -m tests.host.egressworld serve   # run inside the namespace: servers and zone

The host side routes 10.77.0.0/16 into the namespace; Docker's masquerade makes a sandbox's
packets come from the veth's host address, so the namespace needs no route to the sandboxes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from slicebox.model import dnswire

NETNS = "sbxt-world"
HOST_SIDE, WORLD_SIDE = "sbxt-h", "sbxt-w"
HOST_ADDRESS, WORLD_ADDRESS = "10.77.0.1", "10.77.0.2"
NAMESERVER = "10.77.0.53"
PKGS, OTHER, LISTED, PORTED, WILD, PRIVATE = (
    "10.77.1.10",
    "10.77.1.20",
    "10.77.1.30",
    "10.77.1.40",
    "10.77.1.50",
    "10.77.9.9",
)
INTERNAL = "10.77.1.0/24"  # the operator's internal network: answers may point here
ZONE = {
    "pkgs.test": PKGS,
    "other.test": OTHER,
    "port.test": PORTED,
    "files.wild.test": WILD,
    "rebind.wild.test": PRIVATE,  # private and outside INTERNAL: a rebinding answer
}
SERVERS = [(PKGS, 8000), (OTHER, 8000), (LISTED, 8000), (PORTED, 8080), (PORTED, 8081)]
SERVERS += [(WILD, 8000), (PRIVATE, 8000)]
REPO = Path(__file__).resolve().parents[2]


def ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


@contextmanager
def world() -> Iterator[None]:
    """The namespace, its addresses and its servers, for the block; all gone after."""
    subprocess.run(["ip", "netns", "del", NETNS], check=False, capture_output=True)
    ip("netns", "add", NETNS)
    server: subprocess.Popen[bytes] | None = None
    try:
        ip("link", "add", HOST_SIDE, "type", "veth", "peer", "name", WORLD_SIDE)
        ip("link", "set", WORLD_SIDE, "netns", NETNS)
        ip("addr", "add", f"{HOST_ADDRESS}/24", "dev", HOST_SIDE)
        ip("link", "set", HOST_SIDE, "up")
        inside = ["netns", "exec", NETNS, "ip"]
        ip(*inside, "addr", "add", f"{WORLD_ADDRESS}/24", "dev", WORLD_SIDE)
        for address in sorted({NAMESERVER, *(a for a, _ in SERVERS)}):
            ip(*inside, "addr", "add", f"{address}/32", "dev", WORLD_SIDE)
        ip(*inside, "link", "set", WORLD_SIDE, "up")
        ip(*inside, "link", "set", "lo", "up")
        ip(*inside, "route", "add", "default", "via", HOST_ADDRESS)
        for network in ("10.77.1.0/24", "10.77.9.0/24", f"{NAMESERVER}/32"):
            ip("route", "add", network, "via", WORLD_ADDRESS)
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'agent'}"}
        server = subprocess.Popen(
            ["ip", "netns", "exec", NETNS, sys.executable, "-m", "tests.host.egressworld", "serve"],
            cwd=REPO,
            env=env,
        )
        _wait_listening()
        yield
    finally:
        if server is not None:
            server.kill()
            server.wait()
        for network in ("10.77.1.0/24", "10.77.9.0/24", f"{NAMESERVER}/32"):
            subprocess.run(["ip", "route", "del", network], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", HOST_SIDE], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", NETNS], check=False, capture_output=True)


def _wait_listening() -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((PKGS, 8000), timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("the egress test world's servers did not start")


# --- inside the namespace ---------------------------------------------------------------


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        address: Any = self.server.server_address
        body = f"hello from {address[0]}:{address[1]}\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: object) -> None:
        return


def _zone() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((NAMESERVER, 53))
    while True:
        data, peer = sock.recvfrom(4096)
        try:
            query = dnswire.parse_query(data)
        except dnswire.DnsFormatError:
            continue
        name = query.question.name
        if name in ZONE and query.question.qtype == dnswire.A:
            answer = dnswire.build_response(query, [(name, dnswire.A, 60, ZONE[name])])
        elif name in ZONE:
            answer = dnswire.build_response(query, [])
        else:
            answer = dnswire.reply(query, dnswire.NXDOMAIN)
        sock.sendto(answer, peer)


def serve() -> None:
    for address, port in SERVERS:
        httpd = ThreadingHTTPServer((address, port), _Hello)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _zone()


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
