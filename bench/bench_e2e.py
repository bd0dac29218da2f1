"""Bench: what a user sees through the agent's socket against Docker doing the same, one run.

    tests/guest/run python3 -m bench.bench_e2e [--rounds N]

The agent is the real service (the checkout's units, started by systemd, answering on its
socket); each call is one ``curl --unix-socket`` process, as each Docker call is one ``docker``
CLI process, so both sides pay one process start per call. Interleaved round by round so both
see the same load:

- one-shot: ``POST /v1/run`` of ``echo hi`` vs ``docker run --rm`` with the same hardening;
- create: ``POST /v1/sandboxes`` vs ``docker create`` + ``docker start``;
- exec: ``POST /v1/sandboxes/{id}/exec`` of ``echo hi`` vs ``docker exec``;
- destroy: ``DELETE /v1/sandboxes/{id}`` vs ``docker rm -f``.

The Docker side uses the flags the Docker backend derives from the same settings table
(``run_flags``), in the same project slice. Absolute times under emulation say little about
real hosts; the ratios (medians) are the result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tests.host.agentunits import SOCKET, TEST_CONFIG, installed_agent

from slicebox.backends.base import SandboxRequest
from slicebox.backends.dockerbody import run_flags
from slicebox.core.creation import KEEP_ALIVE
from slicebox.model.config import parse_config
from slicebox.model.names import slice_names

IMAGE = "slicebox-test/busybox:latest"
PROJECT = "bench"
ECHO = {"argv": ["echo", "hi"]}
T = TypeVar("T")


def api(method: str, path: str, body: object | None = None) -> dict[str, Any]:
    argv = ["curl", "-sf", "--unix-socket", str(SOCKET), "-X", method]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    out = subprocess.run([*argv, f"http://localhost/v1{path}"], capture_output=True, check=True)
    return dict(json.loads(out.stdout))


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, check=True, text=True).stdout


def flags() -> list[str]:
    request = SandboxRequest(
        name="bare",
        image=IMAGE,
        command=KEEP_ALIVE,
        labels={},
        slice=slice_names("root", PROJECT).project,
        limits=parse_config(TEST_CONFIG).sandbox.limits(),
    )
    return run_flags(request)


def timed(action: Callable[[], T]) -> tuple[float, T]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


class Round:
    """One of each operation on each side; the sandboxes it makes are removed before it ends."""

    def __init__(self, times: dict[str, dict[str, list[float]]], hardening: list[str]) -> None:
        self.times = times
        self.hardening = hardening

    def record(self, name: str, side: str, seconds: float) -> None:
        self.times.setdefault(name, {"slicebox": [], "docker": []})[side].append(seconds)

    def ours(self) -> None:
        seconds, ran = timed(
            lambda: api("POST", "/run", {"sandbox": {"project": PROJECT}, "exec": ECHO})
        )
        assert ran["result"]["exit_code"] == 0, ran
        self.record("one-shot", "slicebox", seconds)
        seconds, made = timed(lambda: api("POST", "/sandboxes", {"project": PROJECT}))
        self.record("create", "slicebox", seconds)
        sandbox = str(made["id"])
        try:
            seconds, _ = timed(lambda: api("POST", f"/sandboxes/{sandbox}/exec", ECHO))
            self.record("exec", "slicebox", seconds)
        finally:
            seconds, _ = timed(lambda: api("DELETE", f"/sandboxes/{sandbox}"))
            self.record("destroy", "slicebox", seconds)

    def theirs(self) -> None:
        run = ["run", "--rm", *self.hardening, IMAGE, "echo", "hi"]
        seconds, out = timed(lambda: docker(*run))
        assert out == "hi\n", out
        self.record("one-shot", "docker", seconds)
        create = ["create", *self.hardening, IMAGE, *KEEP_ALIVE]
        seconds, cid = timed(lambda: docker(*create).strip())
        try:
            started, _ = timed(lambda: docker("start", cid))
            self.record("create", "docker", seconds + started)
            seconds, _ = timed(lambda: docker("exec", cid, "echo", "hi"))
            self.record("exec", "docker", seconds)
        finally:
            seconds, _ = timed(lambda: docker("rm", "-f", cid))
            self.record("destroy", "docker", seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, dict[str, list[float]]] = {}
    with installed_agent():
        subprocess.run(["systemctl", "start", "slicebox.service"], check=True)
        api("GET", "/health")
        round_ = Round(times, flags())
        round_.ours()  # warm-up: images, slices, the agent's first imports; not counted
        round_.theirs()
        times.clear()
        try:
            for _ in range(args.rounds):
                round_.ours()
                round_.theirs()
        finally:
            names = slice_names("root", PROJECT)
            for unit in (names.project, names.user):
                subprocess.run(["systemctl", "stop", unit], check=False)
    for name, sides in times.items():
        ours, bare = statistics.median(sides["slicebox"]), statistics.median(sides["docker"])
        print(
            f"{name:9} slicebox {ours * 1000:6.0f} ms  docker {bare * 1000:6.0f} ms  "
            f"RATIO {ours / bare:.2f}  ({len(sides['slicebox'])} rounds)"
        )


if __name__ == "__main__":
    main()
