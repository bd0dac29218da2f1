"""The exec engine and one-shot runs on a real host, on sandboxes made by the agent's own
create path (issue 4's "Done when", issue 12's "no stand-in").

The sandboxes come from ``SandboxManager.create`` over the real Docker backend, slices and
deadlines, with the security defaults the agent gives every sandbox (no capabilities,
no-new-privileges, network none, pids 100, 256 MB, 0.5 CPU, init, ``sleep infinity``, a tmpfs
at /workspace). One sandbox serves most of the module: container starts are slow in the guest
(three in all: that one, the stock-image one, the one-shot). Each test checks afterwards that
only the sandbox's own init and main process are left in its scope cgroup.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import docker
import docker.errors
import pytest

from slicebox.backends.base import ExecApi
from slicebox.backends.docker import DockerBackend
from slicebox.core.blocking import from_thread
from slicebox.core.deadlines import Deadlines
from slicebox.core.execution import ExecEngine
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.service import Service
from slicebox.core.slices import SliceManager
from slicebox.core.telemetry import MemoryIntegrator, TreeReader, UsageReader
from slicebox.host.cgroupfs import CgroupFS
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.host.procs import CgroupHost
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.config import parse_config, read_host_memory
from slicebox.model.errors import InvalidCommand, InvalidTimeout, SandboxNotFound
from slicebox.model.exec import ExecEvent, ExecRequest, ExecResult, OutputStream, StreamChunk
from slicebox.model.names import MANAGED_SLICE, slice_names
from slicebox.model.spec import SandboxSpec
from tests.fakes.journal import ListJournal
from tests.fakes.threadside import ThreadSide, created
from tests.host.helpers import TEST_IMAGE, unique
from tests.host.sliceboxhost import active, cleanup_slices, reap_empty_slices, slicebox_units

pytestmark = pytest.mark.host

STOCK_IMAGE = "slicebox-test/stock:latest"  # no /workspace in it, like alpine:3.19
TEN_MB = 10_000_000


class Agent:
    """The agent's parts over the real host, assembled as ``server.runtime`` does."""

    def __init__(self) -> None:
        systemd = PystemdSystemd()
        self.user = unique("exec-")
        self.backend = DockerBackend.from_env()
        self.engine = ExecEngine(self.backend, CgroupHost())
        self.manager = SandboxManager(
            self.backend,
            SliceManager(systemd),
            config=parse_config(f'default_image = "{TEST_IMAGE}"\n'),
            host_memory=read_host_memory(),
            instance_id=unique("test-"),
            deadlines=Deadlines(systemd),
        )
        self.journal = ListJournal()
        self.service = Service(
            self.manager,
            self.engine,
            usage=UsageReader(CgroupFS(), integrator=MemoryIntegrator(time.monotonic)),
            tree=TreeReader(CgroupFS()),
            auditor=Auditor(self.journal),
            pid_of=lambda sandbox: None,
        )
        self.who = Identity(uid=0, gid=0, pid=os.getpid(), user_name=self.user, is_admin=False)

    def spec(self, project: str, **fields: object) -> SandboxSpec:
        return SandboxSpec.model_validate({"user": self.user, "project": project, **fields})

    def units(self) -> list[str]:
        return slicebox_units(slice_names(self.user, "x").user[:-6] + "*")

    def leftovers(self, project: str) -> tuple[list[str], list[str]]:
        """The project's containers and slice (the module's shared sandbox is elsewhere), once
        a reaper pass without a grace stopped the slices its destroys left."""
        reap_empty_slices(self.manager, self.user)
        found = self.backend.find({"slicebox.user": self.user, "slicebox.project": project})
        return [c.id for c in found], slicebox_units(slice_names(self.user, project).project)


class Sandbox:
    def __init__(self, container_id: str, engine: ExecEngine, host: CgroupHost) -> None:
        self.id = container_id
        self.engine = engine
        self.host = host
        self.cgroup = host.cgroup_of(DockerBackend.from_env().sandbox_pid(container_id))
        self.baseline = self.pids()

    def pids(self) -> set[int]:
        return {proc.pid for proc in self.host.processes(self.cgroup)}

    def run(self, **fields: object) -> ExecResult:
        return self.engine.run(self.id, ExecRequest.parse(fields))


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    managed_was_active = active(MANAGED_SLICE)
    made = Agent()
    yield made
    for leftover in made.manager.find(user=made.user):
        made.manager.destroy(leftover.id)
    cleanup_slices(*made.units())
    if not managed_was_active:
        cleanup_slices(MANAGED_SLICE)


@pytest.fixture(scope="module")
def engine(agent: Agent) -> ExecEngine:
    return agent.engine


@pytest.fixture(scope="module")
def sandbox(agent: Agent) -> Iterator[Sandbox]:
    made = created(agent.manager, agent.spec("shared"))
    try:
        yield Sandbox(made.container_id, agent.engine, CgroupHost())
    finally:
        assert agent.manager.destroy(made.id) is not None


@pytest.fixture
def no_leftovers(sandbox: Sandbox) -> Iterator[Sandbox]:
    """The test's execs leave no process in the sandbox, and the sandbox still answers."""
    yield sandbox
    assert sandbox.pids() == sandbox.baseline
    assert sandbox.run(argv=["echo", "alive"]).stdout == b"alive\n"


def test_streams_and_exit_code_are_exact(no_leftovers: Sandbox) -> None:
    result = no_leftovers.run(argv="echo to-out; echo to-err >&2; exit 7", shell=True)
    assert result.stdout == b"to-out\n"
    assert result.stderr == b"to-err\n"
    assert result.exit_code == 7
    assert not result.timed_out
    assert not result.stdout_truncated
    assert result.duration > 0


def test_argv_runs_without_a_shell_in_workspace_with_env(no_leftovers: Sandbox) -> None:
    result = no_leftovers.run(
        argv=["sh", "-c", 'echo "$1 $GREETING"; pwd', "-", "$HOME;"], env={"GREETING": "hello"}
    )
    assert result.stdout == b"$HOME; hello\n/workspace\n"


def test_a_missing_program_or_cwd_is_explained_on_stderr(no_leftovers: Sandbox) -> None:
    missing = no_leftovers.run(argv=["no-such-program"])
    assert missing.exit_code == 127
    assert b"executable file not found" in missing.stderr
    assert missing.stdout == b""
    nowhere = no_leftovers.run(argv=["true"], cwd="/no/such/dir")
    assert nowhere.exit_code == 126
    assert b"/no/such/dir" in nowhere.stderr


def test_output_closed_early_still_waits_for_the_exit_code(no_leftovers: Sandbox) -> None:
    result = no_leftovers.run(argv="exec >&- 2>&-; sleep 3; exit 3", shell=True)
    assert result.exit_code == 3
    assert not result.timed_out
    assert result.duration >= 3


def test_stdin_round_trips_every_byte_value(no_leftovers: Sandbox) -> None:
    data = bytes(range(256)) * 4
    raw = json.dumps({"argv": ["cat"], "stdin": base64.b64encode(data).decode()})
    request = ExecRequest.parse_json(raw)
    result = no_leftovers.engine.run(no_leftovers.id, request)
    assert result.stdout == data
    assert result.exit_code == 0


async def _events(events: AsyncIterator[ExecEvent]) -> list[ExecEvent]:
    return [event async for event in events]


def test_ten_megabytes_per_stream_keeps_the_head_and_memory_flat(no_leftovers: Sandbox) -> None:
    command = f"head -c {TEN_MB} /dev/zero | tr '\\0' o & head -c {TEN_MB} /dev/zero >&2; wait"
    request = ExecRequest(argv=command, shell=True, timeout=600)
    _reset_peak_rss()
    before = _rss_kib("VmRSS")
    chunks: list[StreamChunk] = []
    result: ExecResult | None = None
    for event in from_thread(
        lambda b: _events(no_leftovers.engine.stream(no_leftovers.id, request, b))
    ):
        if isinstance(event, StreamChunk):
            chunks.append(event)
        else:
            result = event
    growth_kib = _rss_kib("VmHWM") - before
    assert result is not None
    assert result.stdout == b"o" * 50_000
    assert result.stderr == b"\0" * 50_000
    assert result.stdout_truncated
    assert result.stderr_truncated
    assert result.stdout_dropped_bytes == TEN_MB - 50_000
    assert result.stderr_dropped_bytes == TEN_MB - 50_000
    streamed = b"".join(c.data for c in chunks if c.stream is OutputStream.STDOUT)
    assert streamed == result.stdout
    # 20 MB went through; holding it would grow the peak by at least that much.
    assert growth_kib < 4 * 1024, f"peak RSS grew by {growth_kib} KiB"


def test_timeout_kills_the_exec_and_its_children_and_answers_124(no_leftovers: Sandbox) -> None:
    started = time.monotonic()
    result = no_leftovers.run(argv="sleep 60 & sleep 60", shell=True, timeout=1)
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert result.exit_code == 124
    # The exec itself needs ~2 s to start under emulation; far from the 60 s it would take.
    assert elapsed < 15, elapsed
    assert no_leftovers.pids() == no_leftovers.baseline


def test_plain_sleep_times_out_in_about_a_second(no_leftovers: Sandbox) -> None:
    result = no_leftovers.run(argv=["sleep", "60"], timeout=1)
    assert (result.exit_code, result.timed_out) == (124, True)
    assert result.duration < 10, result.duration


def test_timeout_kills_a_fork_bomb_whole_before_answering(no_leftovers: Sandbox) -> None:
    """Each of the bomb's shells forks a pipeline and exits at once, so at the timeout its
    processes are orphans of the container's init, forking and dying at the pids limit. Every
    one is gone when the answer says timed out (a kill of the exec's process and its
    descendants alone would leave every orphan).

    The exec's own shell becomes ``sleep`` (``exec``: no fork the bomb could starve), so the
    exec runs until its timeout: a shell that exited would end the exec's streams about 2 s
    later, and on a slow guest that came before the bomb had forked at all (CI saw 7 of its
    processes at a 2 s timeout). 8 s gives it time to reach the limit.
    """
    with _peak_pids(no_leftovers.cgroup) as peak:
        result = no_leftovers.run(argv="f(){ f | f & }; f; exec sleep 60", shell=True, timeout=8)
    assert (result.exit_code, result.timed_out) == (124, True)
    assert no_leftovers.pids() == no_leftovers.baseline, "right after the answer"
    assert peak() >= len(no_leftovers.baseline) + 10, "the bomb forked before the timeout"


class ThawOnSecondCreate:
    """The Docker backend, thawing a frozen scope when the engine creates its second exec."""

    def __init__(self, backend: DockerBackend, freeze: Path) -> None:
        self._backend = backend
        self._freeze = freeze
        self.creates = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)

    async def exec_create(
        self, container_id: str, request: ExecRequest, streamed: bool = False
    ) -> str:
        self.creates += 1
        if self.creates == 2:
            self._freeze.write_text("0")
        return await self._backend.exec_create(container_id, request, streamed)


def test_an_exec_started_while_a_kill_has_the_sandbox_frozen_runs_once_thawed(
    no_leftovers: Sandbox,
) -> None:
    """An exec's kill freezes its sandbox's scope for milliseconds (host.procs); real runc
    refuses an exec of the same sandbox starting then ("cannot exec in a paused container",
    which the five users' load met). The engine runs such an exec again; the caller sees its
    output alone."""
    freeze = no_leftovers.cgroup / "cgroup.freeze"
    api = ThawOnSecondCreate(DockerBackend.from_env(), freeze)
    engine = ExecEngine(cast(ExecApi, api), CgroupHost())
    freeze.write_text("1")
    try:
        result = engine.run(no_leftovers.id, ExecRequest.parse({"argv": ["echo", "ran"]}))
    finally:
        freeze.write_text("0")
    assert (result.exit_code, result.stdout, result.stderr) == (0, b"ran\n", b"")
    assert api.creates == 2, "the first exec met the frozen scope and was refused"


def test_allocation_past_the_memory_limit_reports_oom_killed(no_leftovers: Sandbox) -> None:
    before = _oom_kills(no_leftovers.cgroup)
    result = no_leftovers.run(argv=["dd", "if=/dev/zero", "of=/dev/null", "bs=300M", "count=1"])
    assert result.oom_killed
    assert result.exit_code == 137
    assert _oom_kills(no_leftovers.cgroup) > before
    assert not no_leftovers.run(argv=["true"]).oom_killed


def test_bad_requests_get_clear_errors(sandbox: Sandbox) -> None:
    with pytest.raises(InvalidCommand, match="argv is empty") as empty:
        sandbox.run(argv=[])
    assert empty.value.code == "invalid_command"
    with pytest.raises(InvalidCommand, match="shell: true"):
        sandbox.run(argv="echo hi")
    with pytest.raises(InvalidTimeout) as negative:
        sandbox.run(argv=["true"], timeout=-1)
    assert negative.value.code == "invalid_timeout"
    with pytest.raises(SandboxNotFound) as unknown:
        sandbox.engine.run("no-such-sandbox-4d1e", ExecRequest(argv=("true",)))
    assert unknown.value.code == "sandbox_not_found"
    assert unknown.value.http_status == 404


def test_a_hundred_echoes_eight_at_a_time_lose_no_byte(no_leftovers: Sandbox) -> None:
    """The soak at CI's scale: 100 execs, eight at a time as parallel tool calls arrive, each
    answer exactly its own output. The 500 below took 338-400 s of a CI lane of one vCPU."""
    _echoes(no_leftovers, 100)


@pytest.mark.load
def test_five_hundred_echoes_lose_no_byte(no_leftovers: Sandbox) -> None:
    """The soak at full size, on demand (``-m load``)."""
    _echoes(no_leftovers, 500)


def _echoes(sandbox: Sandbox, count: int) -> None:
    """``count`` execs, eight at a time: each answer carries exactly its own output (no byte
    lost, none from a neighbouring stream)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        outputs = list(pool.map(lambda n: sandbox.run(argv=["echo", f"hi-{n}"]), range(count)))
    assert len(outputs) == count
    wrong = [
        (n, r.stdout, r.exit_code) for n, r in enumerate(outputs) if r.stdout != b"hi-%d\n" % n
    ]
    assert wrong == []
    assert {r.exit_code for r in outputs} == {0}


def test_every_default_works_on_an_image_without_workspace(agent: Agent) -> None:
    made = created(agent.manager, agent.spec("stock", image=STOCK_IMAGE))
    try:
        box = Sandbox(made.container_id, agent.engine, CgroupHost())
        assert box.run(argv=["echo", "hi"]).stdout == b"hi\n"
        assert box.run(argv=["pwd"]).stdout == b"/workspace\n"
        wrote = box.run(argv="echo kept > note && cat /workspace/note && id -u", shell=True)
        # as the default non-root uid: the tmpfs is 1777, so any uid may write there
        assert (wrote.exit_code, wrote.stdout, wrote.stderr) == (0, b"kept\n65534\n", b"")
        mounts = box.run(argv=["grep", " /workspace ", "/proc/mounts"]).stdout.decode()
        assert mounts.startswith("tmpfs /workspace tmpfs rw,"), mounts
        assert f"size={128 * 1024}k" in mounts, "half the sandbox's 256 MB"
        script = "printf '#!/bin/sh\\necho ran\\n' > run.sh && chmod +x run.sh && ./run.sh"
        assert box.run(argv=script, shell=True).stdout == b"ran\n", "programs may run there"
        assert box.pids() == box.baseline
    finally:
        assert agent.manager.destroy(made.id) is not None
    assert agent.leftovers("stock") == ([], [])


def test_one_shot_run_destroys_its_sandbox_even_on_timeout(
    agent: Agent, client: docker.DockerClient
) -> None:
    request = RunRequest(
        sandbox=CreateSandbox(project="oneshot"),
        exec=ExecRequest(argv="echo started; sleep 60", shell=True, timeout=6),
    )
    ran = ThreadSide(agent.service).run(agent.who, request)
    assert ran.result.stdout == b"started\n"
    assert (ran.result.exit_code, ran.result.timed_out) == (124, True)
    assert ran.usage is not None, "the final usage of the one-shot's sandbox"
    assert client.api.containers(all=True, filters={"name": ran.sandbox_id}) == []
    assert agent.leftovers("oneshot") == ([], [])
    assert [event for event, _ in agent.journal.events()] == [
        "sandbox_created",
        "exec",
        "sandbox_destroyed",
    ]


@contextlib.contextmanager
def _peak_pids(cgroup: Path) -> Iterator[Callable[[], int]]:
    """The most tasks (pids.current) seen in the cgroup, sampled every 10 ms in the block."""
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.01):
            peak = max(peak, int((cgroup / "pids.current").read_text()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield lambda: peak
    finally:
        done.set()
        sampler.join()


def _oom_kills(cgroup: Path) -> int:
    count = CgroupHost().oom_kills(cgroup)
    assert count is not None
    return count


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} missing from /proc/self/status")
