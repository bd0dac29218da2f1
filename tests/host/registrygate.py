"""A gate in front of the guest's local registry, for the pull attacks (issue 60): run as
``python3 -m tests.host.registrygate PORT UPSTREAM LOG [private]``.

Every request is passed to ``UPSTREAM`` (``host:port``) and its answer streamed back, except:

- with ``private``, every request (the engine's ``/v2/`` ping first) answers 401 with a Basic
  challenge unless it carries ``Authorization: Basic`` of ``alice:alice-pass`` (what the
  operator's grant holds): a registry of private images;
- a repository under ``slow/`` is held until the file ``LOG.release`` exists (a slow
  registry of a user's own, holding the pull in flight).

Each request's method, path and Authorization header (as sent) is one line of ``LOG``, so a
test can say whose credentials reached the registry. It prints ``ready`` once it listens."""

from __future__ import annotations

import base64
import http.client
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

GRANTED = "Basic " + base64.b64encode(b"alice:alice-pass").decode()
CHUNK = 1 << 16


def main() -> None:
    port, upstream, log = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    private = sys.argv[4:] == ["private"]
    release = log.with_name(log.name + ".release")

    class Gate(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            return

        def _pass(self) -> None:
            auth = self.headers.get("Authorization", "")
            with log.open("a") as out:
                out.write(f"{self.command} {self.path} {auth or '-'}\n")
            if private and auth != GRANTED:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="gate"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            while "/slow/" in self.path and not release.exists():
                time.sleep(0.2)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            conn = http.client.HTTPConnection(upstream, timeout=600)
            headers: dict[str, str] = {}  # a repeated field (the engine's Accept) kept whole
            for key, value in self.headers.items():
                if key.lower() != "authorization":
                    headers[key] = f"{headers[key]}, {value}" if key in headers else value
            conn.request(self.command, self.path, body=body, headers=headers)
            answer = conn.getresponse()
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in {"connection", "transfer-encoding"}:
                    self.send_header(key, value)
            if answer.getheader("Content-Length") is None:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            while self.command != "HEAD" and (piece := answer.read(CHUNK)):
                self.wfile.write(piece)
            conn.close()

        do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Gate)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
