#!/usr/bin/env python3
"""The rig's few words of QMP, QEMU's JSON control protocol (standard library only).

    qmp.py SOCKET save URI [TIMEOUT]   stop the guest and migrate its state to URI; 0 when done
    qmp.py SOCKET resume [TIMEOUT]     wait for an -incoming state to load, then run the guest
    qmp.py SOCKET quit                 end QEMU
    qmp.py SOCKET COMMAND [JSON]       any command; prints its return value as JSON

A failure prints one short line (why) on stderr and exits 1; a socket that cannot be reached
(QEMU gone) is such a failure too.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from typing import Any


class QMPError(Exception):
    pass


class QMP:
    def __init__(self, path: str, timeout: float = 5.0, answer_timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # Loading a state keeps QEMU's main loop busy: an answer may wait for seconds.
            self.sock.settimeout(answer_timeout)
            try:
                self.sock.connect(path)
                break
            except FileNotFoundError:
                # QEMU listens before its -daemonize returns: no socket yet is QEMU starting.
                self.sock.close()
                if time.monotonic() >= deadline:
                    raise QMPError(f"no QMP socket at {path}") from None
                time.sleep(0.1)
            except OSError as err:
                # A socket nobody listens on any more: QEMU is gone.
                self.sock.close()
                raise QMPError(f"QEMU does not answer on its QMP socket ({err.strerror})") from None
        self.reader = self.sock.makefile("rb")
        self._read()  # the greeting
        self.command("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while True:
            line = self.reader.readline()
            if not line:
                raise QMPError("QEMU closed its QMP socket (QEMU exited)")
            message = json.loads(line)
            if "event" not in message:  # events arrive unasked: not an answer
                return message  # type: ignore[no-any-return]

    def command(self, name: str, **arguments: Any) -> Any:
        request: dict[str, Any] = {"execute": name}
        if arguments:
            request["arguments"] = arguments
        self.sock.sendall(json.dumps(request).encode() + b"\n")
        answer = self._read()
        if "error" in answer:
            raise QMPError(f"{name}: {answer['error'].get('desc', answer['error'])}")
        return answer.get("return")


def save(qmp: QMP, uri: str, timeout: float) -> None:
    """Stop the guest, then write its whole state to URI: a still image, not a live copy."""
    qmp.command("stop")
    # The default bandwidth cap (128 MiB/s) is for a live guest on a shared network.
    qmp.command("migrate-set-parameters", **{"max-bandwidth": 64 << 30})
    qmp.command("migrate", uri=uri)
    deadline = time.monotonic() + timeout
    while True:
        status = qmp.command("query-migrate")
        state = status.get("status")
        if state == "completed":
            return
        if state in ("failed", "cancelled"):
            raise QMPError(f"migration {state}: {status.get('error-desc', 'no reason given')}")
        if time.monotonic() >= deadline:
            qmp.command("migrate_cancel")
            raise QMPError(f"migration not done after {timeout:.0f}s")
        time.sleep(0.2)


def resume(qmp: QMP, timeout: float) -> None:
    """Wait until an incoming state has loaded; a guest saved stopped comes back paused: run it."""
    deadline = time.monotonic() + timeout
    while True:
        state = qmp.command("query-status")["status"]
        if state == "running":
            return
        if state in ("paused", "postmigrate", "prelaunch"):
            qmp.command("cont")
        elif state != "inmigrate":
            migration = qmp.command("query-migrate")
            raise QMPError(
                f"the guest is {state}: {migration.get('error-desc', migration.get('status'))}"
            )
        if time.monotonic() >= deadline:
            raise QMPError(f"the state did not load in {timeout:.0f}s")
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    path, verb, rest = argv[0], argv[1], argv[2:]
    try:
        qmp = QMP(path)
        if verb == "save":
            save(qmp, rest[0], float(rest[1]) if len(rest) > 1 else 300)
        elif verb == "resume":
            resume(qmp, float(rest[0]) if rest else 60)
        elif verb == "quit":
            with contextlib.suppress(QMPError):  # QEMU may close the socket before it answers
                qmp.command("quit")
        else:
            print(json.dumps(qmp.command(verb, **(json.loads(rest[0]) if rest else {}))))
    except TimeoutError:
        print("QEMU did not answer on its QMP socket", file=sys.stderr)
        return 1
    except (QMPError, OSError, ValueError) as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
