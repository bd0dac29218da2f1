"""Bench: a native sandbox through the agent's socket against systemd doing the same, one run.

    tests/guest/run python3 -m bench.bench_native [--rounds N]

The agent is the real service (the checkout's units, started by systemd, answering on its
socket); each call is one ``curl --unix-socket`` process. The raw side is what an operator
would type to get the same isolation from systemd alone, one ``systemctl``/``systemd-run``
process per step, with the very properties the native backend sets (``hardening``, written
as unit-file settings):

- create: ``POST /v1/sandboxes`` (native) vs the sandbox slice's limits
  (``systemctl set-property --runtime``), its anchor (``systemd-run`` of ``sleep infinity``
  in it, ``Type=exec`` as the agent's) and a deadline timer bound to the slice;
- exec: ``POST /v1/sandboxes/{id}/exec`` of ``echo hi`` vs ``systemd-run --wait --pipe`` of
  the same in that slice, joined to the anchor's namespaces;
- destroy: ``DELETE /v1/sandboxes/{id}`` vs ``systemctl stop`` of the slice.

Interleaved round by round so both see the same load; the ratios (medians) are the result.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import subprocess
from collections.abc import Callable
from typing import Any

from tests.host.agentunits import installed_agent
from tests.host.sliceboxhost import cleanup_slices

from bench.bench_e2e import api, timed
from slicebox.backends.native.names import anchor_unit, sandbox_slice
from slicebox.backends.native.units import WORKSPACE, hardening
from slicebox.model.names import slice_names

PROJECT = "nbench"
ECHO = {"argv": ["echo", "hi"]}
SIGNALS = {9: "SIGKILL"}
ERRNOS = {1: "EPERM"}


def run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, check=True, text=True).stdout


# How a unit file writes the properties whose D-Bus form is not theirs.
SPECIAL: dict[str, Callable[[Any], str]] = {
    "CapabilityBoundingSet": lambda value: "",  # empty: none
    "AmbientCapabilities": lambda value: "",
    "RestrictNamespaces": lambda value: "yes",
    "UMask": lambda value: f"{value:04o}",
    "RuntimeDirectoryMode": lambda value: f"{value:04o}",
    "KillSignal": lambda value: SIGNALS[value],
    "SystemCallErrorNumber": lambda value: ERRNOS[value],
    "BindPaths": lambda value: " ".join(f"{source}:{target}" for source, target, *_ in value),
    "IPAddressDeny": lambda value: "any",
}


def setting(name: str, value: Any) -> str:
    """One D-Bus property of ``hardening`` as a unit file writes it."""
    if name in SPECIAL:
        written = SPECIAL[name](value)
    elif isinstance(value, bool):
        written = "yes" if value else "no"
    elif isinstance(value, tuple):  # (allow-list, items)
        written = " ".join(value[1])
    elif isinstance(value, list):
        written = " ".join(value)
    else:
        written = str(value)
    return f"{name}={written}"


def properties(name: str, *, anchor: bool = False) -> list[str]:
    settings = hardening(name, anchor=anchor).items()
    return [arg for key, value in settings for arg in ("-p", setting(key, value))]


class Round:
    def __init__(self, times: dict[str, dict[str, list[float]]]) -> None:
        self.times = times

    def record(self, name: str, side: str, seconds: float) -> None:
        self.times.setdefault(name, {"slicebox": [], "systemd": []})[side].append(seconds)

    def ours(self) -> None:
        body = {"project": PROJECT, "backend": "native", "memory": "256MB", "pids": 100}
        seconds, made = timed(lambda: api("POST", "/sandboxes", body))
        self.record("create", "slicebox", seconds)
        sandbox = str(made["id"])
        try:
            seconds, ran = timed(lambda: api("POST", f"/sandboxes/{sandbox}/exec", ECHO))
            assert ran["exit_code"] == 0, ran
            self.record("exec", "slicebox", seconds)
        finally:
            seconds, _ = timed(lambda: api("DELETE", f"/sandboxes/{sandbox}"))
            self.record("destroy", "slicebox", seconds)

    def theirs(self) -> None:
        name = "sbx-" + secrets.token_hex(6)
        unit = sandbox_slice(slice_names("root", PROJECT).project, name)
        limits = ("MemoryMax=268435456", "MemorySwapMax=0", "TasksMax=100", "CPUQuota=50%")
        anchor = [
            *("systemd-run", "--quiet", f"--unit={anchor_unit(name)}", f"--slice={unit}"),
            *properties(name, anchor=True),
            *("-p", "Type=exec", "sleep", "infinity"),  # started once it runs, as the agent's
        ]

        # A deadline, as the agent arms one for every sandbox: a timer bound to the slice.
        deadline = [
            *("systemd-run", "--quiet", "--on-active=3600", f"--timer-property=BindsTo={unit}"),
            *("systemctl", "stop", unit),
        ]

        def create() -> None:
            run("systemctl", "set-property", "--runtime", unit, *limits)
            run(*anchor)
            run(*deadline)

        seconds, _ = timed(create)
        self.record("create", "systemd", seconds)
        try:
            exec_ = [
                *("systemd-run", "--quiet", "--wait", "--pipe", f"--slice={unit}"),
                *("-p", f"JoinsNamespaceOf={anchor_unit(name)}"),
                *properties(name),
                *("-p", f"WorkingDirectory={WORKSPACE}"),
                *("echo", "hi"),
            ]
            seconds, out = timed(lambda: run(*exec_))
            assert out == "hi\n", out
            self.record("exec", "systemd", seconds)
        finally:
            seconds, _ = timed(lambda: run("systemctl", "stop", unit))
            self.record("destroy", "systemd", seconds)
            cleanup_slices(unit)  # set-property's drop-ins (untimed: the agent has none)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, dict[str, list[float]]] = {}
    with installed_agent():
        subprocess.run(["systemctl", "start", "slicebox.service"], check=True)
        api("GET", "/health")
        round_ = Round(times)
        round_.ours()  # warm-up: slices, the agent's first imports; not counted
        round_.theirs()
        times.clear()
        try:
            for number in range(args.rounds):  # the sides take turns going first
                first, second = (round_.ours, round_.theirs)[:: 1 if number % 2 else -1]
                first()
                second()
        finally:
            names = slice_names("root", PROJECT)
            cleanup_slices(names.project, names.user)
    for name, sides in times.items():
        ours, bare = statistics.median(sides["slicebox"]), statistics.median(sides["systemd"])
        print(
            f"{name:8} slicebox {ours * 1000:6.0f} ms  systemd {bare * 1000:6.0f} ms  "
            f"RATIO {ours / bare:.2f}  ({len(sides['slicebox'])} rounds)"
        )


if __name__ == "__main__":
    main()
