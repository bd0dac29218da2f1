"""One user's share of the load test, run as that user (``runuser``) so the agent identifies it
by the kernel: ``--clients`` threads create sandboxes across the user's projects, run execs
(some streaming and abandoned after their first output), read lists and usage, then destroy
everything they made. Prints one JSON summary on stdout; never raises on a failed request
(the test counts failures, it does not stop at the first).

    python3 -m tests.host.loadclient --creates 20 --execs 80 --clients 8 --projects a,b

With ``--until FILE`` it repeats that round until FILE exists (the agent is being killed
meanwhile: failures are expected, and the summary says which sandboxes were answered created
and which were asked to be destroyed); ``--progress FILE`` holds the number of calls answered
so far, so the killer can wait for the restarted agent to make progress.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pwd
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slicebox.client import Client
from slicebox.model.api import CreateSandbox
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecRequest, ExecResult
from tests.host.agentunits import SOCKET

EXEC_TIMEOUT = 600.0


class Load:
    def __init__(self, clients: int, progress: Path | None = None) -> None:
        self.clients = clients
        self.progress = progress
        self.answered = 0
        self.round: list[str] = []  # created in this round: what its execs and destroys use
        self.asked_destroy: list[str] = []
        self.client = Client(str(SOCKET), timeout=600)
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.calls: Counter[str] = Counter()
        self.failures: list[dict[str, Any]] = []
        self.created: list[str] = []
        self.foreign: list[str] = []  # sandboxes of other users this user was shown
        self.lock = threading.Lock()

    def call(self, route: str, action: Callable[[], Any]) -> Any:
        try:
            result = action()
        except SliceboxError as exc:
            with self.lock:
                self.failures.append(
                    {
                        "route": route,
                        "code": exc.code,
                        "status": exc.http_status,
                        "message": exc.message,
                    }
                )
            return None
        except Exception as exc:  # a stream cut short, a broken answer: counted, not fatal
            with self.lock:
                self.failures.append(
                    {"route": route, "code": type(exc).__name__, "status": 0, "message": str(exc)}
                )
            return None
        with self.lock:
            self.calls[route] += 1
            self.answered += 1
            if self.progress is not None:
                self.progress.write_text(str(self.answered))
        return result

    def create(self, project: str) -> None:
        made = self.call("create", lambda: self.client.create(CreateSandbox(project=project)))
        if made is not None:
            with self.lock:
                self.created.append(made.id)
                self.round.append(made.id)

    def destroy(self, sandbox: str) -> None:
        with self.lock:
            self.asked_destroy.append(sandbox)  # no promise once asked, answered or not
        self.call("destroy", lambda: self.client.destroy(sandbox))

    def exec_(self, n: int) -> None:
        sandbox = self.round[n % len(self.round)]
        if n % 8 == 3:  # streamed, then abandoned after its first output
            self.call("exec_abandoned", lambda: self._abandon(sandbox))
            return
        # A generous timeout: under emulation 40 clients keep Docker busy for tens of seconds
        # per exec start; what this test proves is that none is lost, not how fast it is.
        request = ExecRequest(argv=("sh", "-c", f"echo {n}"), timeout=EXEC_TIMEOUT)
        ran = self.call("exec", lambda: self.client.exec(sandbox, request))
        if ran is not None and (ran.exit_code, ran.stdout) != (0, f"{n}\n".encode()):
            self.failures.append(
                {"route": "exec", "code": "wrong_output", "status": 200, "message": repr(ran)}
            )
        if n % 10 == 0:
            listed = self.call("list", self.client.list_sandboxes) or []
            with self.lock:
                self.foreign += [s.id for s in listed if s.user != self.user]
            self.call("usage", lambda: self.client.usage(sandbox))

    def _abandon(self, sandbox: str) -> None:
        request = ExecRequest(
            argv=("sh", "-c", "echo first; sleep 30; echo never"), timeout=EXEC_TIMEOUT
        )
        events = self.client.exec_stream(sandbox, request)
        try:
            first = next(events)
            assert not isinstance(first, ExecResult), first
        finally:
            events.close()

    def run(
        self, creates: int, execs: int, projects: list[str], until: Path | None = None
    ) -> dict[str, Any]:
        rounds = 0
        with ThreadPoolExecutor(self.clients) as pool:
            while True:
                self.round = []
                list(pool.map(self.create, itertools.islice(itertools.cycle(projects), creates)))
                if self.round:
                    list(pool.map(self.exec_, range(execs)))
                list(pool.map(self.destroy, list(self.round)))
                rounds += 1
                if until is None or until.exists():
                    break
                if not self.round:
                    time.sleep(1)  # the agent is down: do not spin on refusals
        return {
            "user": self.user,
            "rounds": rounds,
            "calls": dict(self.calls),
            "failures": self.failures,
            "created": self.created,
            "asked_destroy": self.asked_destroy,
            "foreign": self.foreign,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, required=True)
    parser.add_argument("--execs", type=int, required=True)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--projects", required=True, help="comma-separated")
    parser.add_argument("--until", type=Path, help="repeat the round until this file exists")
    parser.add_argument("--progress", type=Path, help="keep the count of answered calls here")
    args = parser.parse_args()
    load = Load(args.clients, args.progress)
    summary = load.run(args.creates, args.execs, args.projects.split(","), args.until)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
