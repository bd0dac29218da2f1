"""Many agents at once on a real host (issue 13): the installed agent under systemd, five users
each with eight parallel clients, the reaper running every 2 s.

The users create sandboxes across 10 projects (half of them new: the other half already hold a
sandbox when the load starts), run execs (one in eight streamed and abandoned after its first
output), read lists and usage, and destroy what they made. Asserted afterwards on what Docker,
systemd, /proc and the journal show: no failed request, no leaked container, slice or timer,
fewer than 40 agent threads throughout (an exec holds none while it runs), each user shown only
their own sandboxes, and one audit record per create, exec and destroy. Then: while 20 execs
run, a list answers within 3x its idle latency. Last, the same five users run the load in
rounds while the agent is killed with SIGKILL twenty times: after one reaper pass nothing has
leaked and nothing a caller was promised is lost.

The load runs at two sizes (issue 58). CI's run has it at CI's scale: the same five users,
eight clients each, both kinds of project and every kind of call in the same proportions, with
a fifth of the sandboxes and execs (20 and 80): 287 s of a CI lane of one vCPU on the slow
machine of 2026-12-07. At full size (100 sandboxes, 400 execs) it took 1089-1381 s of such a
lane on earlier machines and 1953 s there, where it failed (containerd's own deadlines passed
at a load average of 44-59, and Docker's answers with them); it is marked ``load`` and runs on
demand, with the two kill storms (the five users' and the smaller one: twenty kills under one
user's churn, four clients), whose twenty restarts each import the agent and reconcile for
20-30 s there::

    tests/guest/run python3 -m pytest -m load tests/host/test_load.py
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import docker
import pytest

from slicebox.client import Client
from slicebox.core.deadlines import Deadlines
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.api import CreateSandbox
from slicebox.model.exec import ExecRequest
from slicebox.model.labels import MANAGED
from tests.host.agentunits import SOCKET, agent_config, installed_agent
from tests.host.helpers import module_as, sh, unique, wait_for
from tests.host.sliceboxhost import active, slicebox_units

pytestmark = [pytest.mark.host]

USERS = [f"sbxload{n}" for n in range(1, 6)]
CLIENTS = 8


class Size(NamedTuple):
    """One user's share of the load: its sandboxes, made across its two projects, and its
    execs over them (one in eight abandoned, a list and a usage read every tenth)."""

    creates: int
    execs: int


FULL = Size(creates=20, execs=80)  # 100 sandboxes and 400 execs in all
CI_SCALE = Size(creates=4, execs=16)  # a fifth: 20 and 80, every kind of call still made
CONFIG = agent_config("interval_seconds = 2\n")


MAX_AGENT_THREADS = 40  # issue "Many agents at once": an exec holds no thread while it runs


def main_pid() -> int:
    return int(sh("systemctl", "show", "-P", "MainPID", "slicebox.service").stdout.strip() or 0)


def agent_threads(pid: int) -> int | None:
    """The thread count of process ``pid`` (the agent's main pid); None when it is gone (or
    ``pid`` is 0: systemd's answer while no agent runs)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text() if pid else ""
    except OSError:  # it exited meanwhile: ENOENT before the open, ESRCH during the read
        return None
    threads = [line.split()[1] for line in status.splitlines() if line.startswith("Threads")]
    return int(threads[0]) if threads else None


@contextmanager
def thread_counts() -> Iterator[list[int]]:
    """The agent's thread count, sampled every 0.2 s while the block runs. An agent killed and
    restarted meanwhile is followed: once its pid is gone, the new main pid is asked for (at
    most once a second: each ask is a ``systemctl`` process on the busy guest)."""
    pid = main_pid()
    first = agent_threads(pid)
    seen, done = [] if first is None else [first], threading.Event()

    def sample() -> None:
        nonlocal pid
        while not done.wait(0.2):
            count = agent_threads(pid)
            if count is None:
                if done.wait(1.0):
                    return
                pid = main_pid()
                continue
            seen.append(count)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()


def journal(since: str, event: str, user: str) -> list[dict[str, Any]]:
    out = sh(
        "journalctl",
        "--since",
        since,
        "-o",
        "json",
        f"SLICEBOX_EVENT={event}",
        f"SLICEBOX_USER={user}",
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def agent() -> Iterator[None]:
    # No start limit: the last test kills the agent twenty times and systemd restarts it.
    with installed_agent(CONFIG, start_limit=False):
        try:
            for user in USERS:
                sh("useradd", "--no-create-home", "--shell", "/bin/sh", user)
                sh("usermod", "-aG", "slicebox", user)
            sh("systemctl", "start", "slicebox.service")
            yield
        finally:
            wait_for(lambda: active("slicebox.service"), timeout=180)
            for sandbox in Client(str(SOCKET), timeout=600).list_sandboxes():
                if sandbox.user in USERS:
                    Client(str(SOCKET), timeout=600).destroy(sandbox.id)
            for user in USERS:
                sh("userdel", user, check=False)


def as_user(user: str, *argv: str) -> subprocess.Popen[str]:
    """``tests.host.loadclient`` run as ``user``: the agent knows it by SO_PEERCRED."""
    return module_as(user, "tests.host.loadclient", *argv)


def _load(size: Size) -> dict[str, Any]:
    """Every user's clients at once; their summaries."""
    runs = {
        user: as_user(
            user,
            "--creates",
            str(size.creates),
            "--execs",
            str(size.execs),
            "--clients",
            str(CLIENTS),
            "--projects",
            "old,new",
        )
        for user in USERS
    }
    summaries = {}
    for user, run in runs.items():
        out, err = run.communicate(timeout=3600)
        assert run.returncode == 0, err[-3000:]
        summaries[user] = json.loads(out)
    return summaries


def test_five_users_eight_clients_each_lose_nothing_and_leak_nothing(agent: None) -> None:
    """The load at CI's scale: every property of the full size, on a fifth of the work."""
    _five_users(CI_SCALE)


@pytest.mark.load
def test_five_users_at_full_size_lose_nothing_and_leak_nothing(agent: None) -> None:
    """100 sandboxes and 400 execs: on demand (see the module)."""
    _five_users(FULL)


def _five_users(size: Size) -> None:
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    root = Client(str(SOCKET), timeout=600)
    # Half of the ten projects exist before the load: each user's "old" project holds one.
    existing = {user: root.create(CreateSandbox(user=user, project="old")).id for user in USERS}
    with thread_counts() as threads:
        summaries = _load(size)
    for sandbox_id in existing.values():
        root.destroy(sandbox_id)

    failures = {user: s["failures"] for user, s in summaries.items() if s["failures"]}
    # Said whole: pytest cuts a long comparison short, and each failure's message is the clue.
    assert not failures, f"no request failed, none answered 5xx: {json.dumps(failures, indent=1)}"
    for user, summary in summaries.items():
        assert len(summary["created"]) == size.creates
        assert summary["calls"]["destroy"] == size.creates
        assert summary["calls"]["exec"] + summary["calls"]["exec_abandoned"] == size.execs
        assert summary["calls"]["exec_abandoned"] == size.execs // 8
        assert summary["calls"]["list"] == summary["calls"]["usage"] == -(-size.execs // 10)
        assert summary["foreign"] == [], f"{user} was shown another user's sandboxes"

    # Nothing leaked: containers, slices, deadline timers, agent threads.
    left = docker.from_env().api.containers(all=True, filters={"label": MANAGED})
    assert [c["Names"] for c in left if c["Labels"].get("slicebox.user") in USERS] == []
    root.reap()  # one pass takes every empty slice
    slices = [u for u in slicebox_units("slicebox-sbxload*") if u.endswith(".slice")]
    assert slices == []
    made = {s for summary in summaries.values() for s in summary["created"]} | set(
        existing.values()
    )
    timers = {timer.sandbox_id for timer in Deadlines(PystemdSystemd()).timers()}
    assert timers & made == set()
    # Bounded pools only (they start threads on demand and keep them): no thread per caller or
    # per exec, during the load or left after it.
    assert max(threads) < MAX_AGENT_THREADS, f"agent threads during the load: {max(threads)}"
    after = agent_threads(main_pid())
    assert after is not None, "the agent runs after the load"
    assert after < MAX_AGENT_THREADS

    # One audit record per create, exec (abandoned ones included) and destroy.
    for user in USERS:
        created = journal(since, "sandbox_created", user)
        execs = journal(since, "exec", user)
        destroyed = journal(since, "sandbox_destroyed", user)
        assert len(created) == size.creates + 1
        assert len(execs) == size.execs
        assert len(destroyed) == size.creates + 1
        abandoned = [e for e in execs if e.get("SLICEBOX_RESULT") == "abandoned"]
        assert len(abandoned) == summaries[user]["calls"]["exec_abandoned"]


def test_a_list_stays_quick_while_twenty_execs_run(agent: None) -> None:
    client = Client(str(SOCKET), timeout=300)
    # Each exec that Docker starts puts a multi-threaded `runc init` into the sandbox's cgroup
    # for a moment, and pids.max counts threads: twenty starting at once pass the default 100,
    # and a waiting shell whose `sleep` cannot fork exits 2. This test is about the list, not
    # about pids: give the sandbox room for all twenty.
    sandbox = client.create(CreateSandbox(project=unique("busy-"), pids=400))
    try:

        def list_seconds() -> float:
            started = time.perf_counter()
            client.list_sandboxes()
            return time.perf_counter() - started

        idle = statistics.median(list_seconds() for _ in range(7))
        # Each exec runs until the test lets it go: starting twenty under emulation can take
        # longer than any fixed sleep, and all twenty must be running while the lists are timed.
        # They wait blocked on a FIFO, costing no CPU: twenty shells polling once a second
        # forked twenty processes a second, which under emulation took enough of the guest's
        # two CPUs to slow any request, the list's included (a rehearsal's list failed so).
        sh("docker", "exec", sandbox.container_id, "mkfifo", GO)
        waiting = ExecRequest(argv=("cat", GO), timeout=600)
        with ThreadPoolExecutor(20) as pool:
            running = [pool.submit(client.exec, sandbox.id, waiting) for _ in range(20)]
            try:
                wait_for(lambda: _waiting(sandbox.container_id) >= 20, timeout=300, step=2)
                busy = statistics.median(list_seconds() for _ in range(7))
                assert _waiting(sandbox.container_id) >= 20, "the execs were still running"
            finally:
                # Writing opens the FIFO for every waiting reader at once; it is held open a
                # while so that a reader still on its way to open() gets there too, then each
                # reads to the end and exits 0.
                release = f"exec 3> {GO}; echo go >&3; sleep 5"
                sh("docker", "exec", sandbox.container_id, "sh", "-c", release)
            assert [f.result().exit_code for f in running] == [0] * 20
        assert busy <= 3 * idle, f"list took {busy:.3f}s with 20 execs, {idle:.3f}s idle"
    finally:
        client.destroy(sandbox.id)


GO = "/tmp/go"


def _waiting(container_id: str) -> int:
    """The container's execs still waiting on the FIFO (``docker top`` shows each command)."""
    top = sh("docker", "top", container_id).stdout
    return sum(1 for line in top.splitlines() if line.rstrip().endswith(f"cat {GO}"))


KILLS = 20


def kill_round(clients: int) -> tuple[str, ...]:
    return ("--creates", "4", "--execs", "8", "--clients", str(clients), "--projects", "a,b")


@pytest.mark.load
def test_twenty_kill_9s_under_one_users_churn_lose_nothing_and_leak_nothing(agent: None) -> None:
    """Twenty kills under one user's four clients: 6 min under emulation, on demand (see the
    module); the five users' storm below took 11 min (2026-12-05), 20-35 min before the
    agent's start got faster."""
    _kill_storm(USERS[:1], clients=4)


@pytest.mark.load
def test_twenty_kill_9s_during_the_load_lose_nothing_and_leak_nothing(agent: None) -> None:
    _kill_storm(USERS, clients=CLIENTS)


def _kill_storm(users: list[str], clients: int) -> None:
    """Every kill lands once the restarted agent has answered the load again, at a random
    point of what it does next: creates, execs, streams and destroys are cut in every state."""
    root = Client(str(SOCKET), timeout=600)
    # Live before the first kill: they must survive all twenty.
    kept = {root.create(CreateSandbox(user=user, project="kept")).id for user in users}
    shared = Path("/run/sbxload")
    shared.mkdir(mode=0o1777, exist_ok=True)
    shared.chmod(0o1777)
    stop = shared / "stop"
    progress = {user: shared / user for user in users}
    runs = {
        user: as_user(
            user, *kill_round(clients), "--until", str(stop), "--progress", str(progress[user])
        )
        for user in users
    }

    def answered() -> int:
        return sum(int(p.read_text() or 0) for p in progress.values() if p.exists())

    rng, kills = random.Random(13), 0
    summaries: dict[str, Any] = {}
    try:
        with thread_counts() as threads:
            while kills < KILLS:
                wait_for(lambda: main_pid() != 0 and active("slicebox.service"), timeout=180)
                seen = answered()
                wait_for(lambda seen=seen: answered() > seen, timeout=300)  # type: ignore[misc]
                time.sleep(rng.uniform(0.0, 4.0))
                pid = main_pid()
                if pid:
                    sh("kill", "-9", str(pid))
                    kills += 1
                    wait_for(lambda gone=pid: main_pid() != gone, timeout=60)  # type: ignore[misc]
    finally:
        stop.touch()
        for user, run in runs.items():
            out, err = run.communicate(timeout=1800)
            assert run.returncode == 0, err[-3000:]
            summaries[user] = json.loads(out)
        sh("rm", "-rf", str(shared))

    failures = sum(len(s["failures"]) for s in summaries.values())
    created = {sandbox for s in summaries.values() for sandbox in s["created"]}
    print(f"{kills} kills; {answered()} calls answered, {failures} failed, {len(created)} created")
    assert len(created) >= 4 * len(users), "the load really ran between the kills"
    assert failures >= 5, "the kills really hit requests in flight"
    restarts = int(sh("systemctl", "show", "-P", "NRestarts", "slicebox.service").stdout)
    assert restarts >= KILLS
    assert max(threads) < MAX_AGENT_THREADS, f"agent threads: {max(threads)}"

    # One reaper pass after the last restart; then nothing is half made or half gone.
    wait_for(lambda: active("slicebox.service"), timeout=180)
    root.reap()
    containers = docker.from_env().api.containers(all=True, filters={"label": MANAGED})
    states = {
        c["Labels"]["slicebox.sandbox_id"]: c["State"]
        for c in containers
        if c["Labels"].get("slicebox.user") in USERS
    }
    assert set(states.values()) <= {"running"}, f"half made or half gone: {states}"
    # What a caller was told exists, and did not ask to destroy, is still there and usable;
    # others may be there too (created while the answer was lost): the agent adopted them.
    asked = {sandbox for s in summaries.values() for sandbox in s["asked_destroy"]}
    promised = kept | (created - asked)
    assert promised <= set(states), f"lost: {promised - set(states)}"
    timers = [timer.sandbox_id for timer in Deadlines(PystemdSystemd()).timers()]
    for sandbox_id in states:
        ran = root.exec(sandbox_id, ExecRequest(argv=("echo", "ok"), timeout=600))
        assert (ran.exit_code, ran.stdout) == (0, b"ok\n")
        assert timers.count(sandbox_id) == 1, "each has its deadline armed, once"
    assert set(timers) & (created | kept) <= set(states), "no timer outlives its sandbox"
    used = {
        (c["Labels"]["slicebox.user"], c["Labels"]["slicebox.project"])
        for c in containers
        if c["Labels"].get("slicebox.user") in USERS
    }
    slices = {u for u in slicebox_units("slicebox-sbxload*") if u.endswith(".slice")}
    expected = {f"slicebox-{u}-{p}.slice" for u, p in used} | {
        f"slicebox-{u}.slice" for u, _ in used
    }
    assert slices == expected, "no empty slice is left, none missing"
    state_dirs = {p.name for p in Path("/run/slicebox/sandboxes").glob("*")}
    assert state_dirs & (created | kept) <= set(states), "no state left for a sandbox gone"
    for sandbox_id in states:
        root.destroy(sandbox_id)
