"""``GET /metrics`` over fakes: what a scrape reads from a temporary cgroupfs tree and the
agent's memory, who sees which series, the exposition formats, the metrics listener's token,
and the Grafana dashboard's queries against what is exposed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_parser,
)
from prometheus_client.parser import text_string_to_metric_families

from slicebox.backends.base import SandboxInfo, SandboxState
from slicebox.core.egresstally import EgressTally
from slicebox.core.execaudit import ExecTally
from slicebox.core.instruments import Instruments
from slicebox.core.poolstate import PoolCensus
from slicebox.host import identity
from slicebox.host.cgroupfs import parse_pressure
from slicebox.host.listen import bind_unix
from slicebox.model.api import CreateSandbox
from slicebox.model.config import parse_config
from slicebox.model.exec import ExecRequest, ExecResult
from slicebox.model.labels import Lineage
from slicebox.model.metrics import MetricsConfig
from slicebox.server import api
from slicebox.server.api import MEASURE, build_app
from slicebox.server.collectors import Sources
from slicebox.server.metrics import METRICS, AgentMetrics
from slicebox.server.routes import ROUTES
from slicebox.server.scrape import SCRAPER_LIMITS, ScrapeListener, TokenRefused, read_token
from slicebox.server.state import SERVICE
from slicebox.web.server import serve
from tests.fakes.threadside import ThreadSide
from tests.unit import test_egress, test_pool
from tests.unit.test_service import ALICE
from tests.unit.test_service import World as ServiceWorld
from tests.unit.test_tcpowner import NOBODY, lan_address
from tests.unit.test_telemetry import cgroup, events

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "packaging" / "grafana" / "slicebox.json"
MANAGED = "slicebox.slice"
ALICE_SLICE = f"{MANAGED}/slicebox-alice.slice"
ALICE_WEB = f"{ALICE_SLICE}/slicebox-alice-web.slice"
BOB_SLICE = f"{MANAGED}/slicebox-bob.slice"
BOB_API = f"{BOB_SLICE}/slicebox-bob-api.slice"
PSI = "some avg10=0.00 avg60=0.00 avg300=0.00 total={some}\n"
PSI += "full avg10=0.00 avg60=0.00 avg300=0.00 total={full}\n"
IDLE, BUSY, OTHER = "a" * 64, "b" * 64, "c" * 64  # container ids
NATIVE = "slicebox-bob-api-job.slice"
FINGERPRINT = "f" * 24


def psi(some: int, full: int) -> str:
    return PSI.format(some=some, full=full)


def host_tree(root: Path) -> None:
    """alice/web with two containers (one a pool's idle member, one handed out), bob/api with
    a container and a native sandbox; PSI files on alice's levels only, as on a kernel that
    has them; alice/web under a memory ceiling, the rest without."""
    pressure = {f"{r}.pressure": psi(2_000_000, 500_000) for r in ("cpu", "memory", "io")}
    cgroup(root, MANAGED, 900, hier=events(1, 1, 1), usage=30_000_000, extra=pressure)
    cgroup(root, ALICE_SLICE, 600, hier=events(1, 1, 1), usage=20_000_000, extra=pressure)
    web = {**pressure, "memory.max": "1073741824\n", "pids.max": "1024\n"}
    cgroup(root, ALICE_WEB, 500, hier=events(1, 1, 1), usage=20_000_000, extra=web)
    cgroup(root, f"{ALICE_WEB}/docker-{IDLE}.scope", 100, usage=1_000_000)
    cgroup(root, f"{ALICE_WEB}/docker-{BUSY}.scope", 400, hier=events(1, 1, 1), usage=19_000_000)
    cgroup(root, f"{ALICE_WEB}/libpod-conmon-{BUSY}.scope", 1)  # no sandbox
    cgroup(root, BOB_SLICE, 300, usage=10_000_000)
    cgroup(root, BOB_API, 300, usage=10_000_000)
    cgroup(root, f"{BOB_API}/docker-{OTHER}.scope", 200, usage=4_000_000)
    cgroup(root, f"{BOB_API}/{NATIVE}", 100, usage=6_000_000)
    (root / MANAGED / "init.scope").mkdir()  # not a user's


def listed(
    backend_id: str, sandbox_id: str, user: str, project: str, **lineage: Any
) -> SandboxInfo:
    """A sandbox as the reaper's listing has it (its labels)."""
    labels = Lineage(
        sandbox_id=sandbox_id,
        user=user,
        project=project,
        root_task_id=sandbox_id,
        task_id=sandbox_id,
        instance_id="run-1",
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        provisioned_cpu=0.5,
        provisioned_memory_bytes=256 << 20,
        provisioned_pids=100,
        **lineage,
    ).to_labels()
    return SandboxInfo(id=backend_id, name=sandbox_id, labels=labels, state=SandboxState.RUNNING)


class Host:
    """What a scrape reads, each part a fake the test sets."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = MetricsConfig()
        self.listed = [
            listed(NATIVE, "sbx-job", "bob", "api", backend="wasm"),
            listed(BUSY, "sbx-busy", "alice", "web", pool=True, pool_key=FINGERPRINT),
            listed("remote-1", "sbx-far", "bob", "api", backend="daytona"),
        ]
        self.pools = [
            PoolCensus("alice", "web", FINGERPRINT, frozenset({IDLE}), 3, 1, 0, frozenset())
        ]
        self.egress = {("alice", "web"): EgressTally(10, 1000, 2, 120, 3)}

    def sources(self) -> Sources:
        from slicebox.host.cgroupfs import CgroupFS

        return Sources(
            CgroupFS(self.root),
            lambda: self.config,
            lambda: self.listed,
            lambda: self.pools,
            lambda: self.egress,
        )


@pytest.fixture
def host(tmp_path: Path) -> Host:
    host_tree(tmp_path)
    return Host(tmp_path)


def agent_metrics(host: Host) -> AgentMetrics:
    """An agent's registry over ``host``, with each instrument used once (so every family of
    the agent has a sample)."""
    metrics = AgentMetrics(fresh_for=0)
    metrics.watch(host.sources())
    counted = metrics.instruments
    counted.exec_ended("alice", "ok")
    counted.exec_ended("bob", "timed_out")
    counted.reaped("expired", "ok")
    counted.pool_acquire_seconds.labels("alice", "web").observe(0.004)
    counted.pool_refill_seconds.labels("alice", "web").observe(0.8)
    metrics.requests.observe("/v1/sandboxes/{id}", "GET", 200, 0.01)
    return metrics


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def value(text: str, name: str, **labels: str) -> float | None:
    for found, have, number in samples(text):
        if found == name and all(have.get(k) == v for k, v in labels.items()):
            return number
    return None


def openmetrics_families(text: str) -> list[Metric]:
    """OpenMetrics parsed by prometheus-client's own parser."""
    return list(openmetrics_parser(text))  # type: ignore[no-untyped-call, unused-ignore]


def scrape(metrics: AgentMetrics, user: str | None = None, accept: str = "") -> str:
    body, _ = metrics.exposition(user, accept)
    return body.decode()


# --- what is in it ---------------------------------------------------------------------------


def test_each_level_s_counters_are_read_from_cgroupfs(host: Host) -> None:
    text = scrape(agent_metrics(host))
    project = {"level": "project", "user": "alice", "project": "web"}
    assert value(text, "slicebox_level_cpu_seconds_total", level="managed", user="") == 30.0
    assert value(text, "slicebox_level_cpu_seconds_total", **project) == 20.0
    assert value(text, "slicebox_level_memory_usage_bytes", **project) == 500
    assert value(text, "slicebox_level_memory_max_usage_bytes", **project) == 1000
    assert value(text, "slicebox_level_memory_limit_bytes", **project) == 1073741824
    assert value(text, "slicebox_level_oom_kills_total", **project) == 1
    assert value(text, "slicebox_level_tasks_current", **project) == 2
    assert value(text, "slicebox_level_tasks_max", **project) == 1024
    bob = {"level": "project", "user": "bob", "project": "api"}
    assert value(text, "slicebox_level_cpu_seconds_total", **bob) == 10.0
    # A ceiling of "max" is no limit: its series is left out, not written as a number.
    assert value(text, "slicebox_level_memory_limit_bytes", **bob) is None
    assert value(text, "slicebox_level_tasks_max", **bob) is None
    levels = {
        (labels["level"], labels["user"], labels["project"])
        for name, labels, _ in samples(text)
        if name == "slicebox_level_cpu_seconds_total"
    }
    assert levels == {
        ("managed", "", ""),
        ("user", "alice", ""),
        ("project", "alice", "web"),
        ("user", "bob", ""),
        ("project", "bob", "api"),
    }, "no series of what is not a user's slice (init.scope) nor of a sandbox"


def test_psi_series_are_left_out_where_the_kernel_has_no_pressure_file(host: Host) -> None:
    text = scrape(agent_metrics(host))
    name = "slicebox_level_pressure_memory_waiting_seconds_total"
    assert value(text, name, level="user", user="alice") == 2.0
    assert value(text, "slicebox_level_pressure_io_stalled_seconds_total", user="alice") == 0.5
    assert value(text, name, user="bob") is None, "bob's levels have no pressure files: no series"
    assert parse_pressure(psi(7, 9).splitlines()[0]) == {"some": 7}, "no full line: no full"
    assert parse_pressure(None) is None


def test_sandboxes_are_counted_from_the_slice_tree_and_what_the_agent_knows(host: Host) -> None:
    text = scrape(agent_metrics(host))
    counts = {
        (labels["user"], labels["project"], labels["backend"], labels["state"]): number
        for name, labels, number in samples(text)
        if name == "slicebox_sandboxes"
    }
    assert counts == {
        ("alice", "web", "docker", "idle"): 1,  # a pool's ready member
        ("alice", "web", "docker", "running"): 1,
        ("bob", "api", "docker", "running"): 1,
        ("bob", "api", "wasm", "running"): 1,  # a native slice the listing says is wasm
        ("bob", "api", "daytona", "running"): 1,  # remote: as last listed
    }


def test_per_sandbox_series_only_when_asked_and_never_past_the_cap(host: Host) -> None:
    metrics = agent_metrics(host)
    off = scrape(metrics)
    assert "slicebox_sandbox_" not in off
    assert "slicebox_metrics_sandboxes_dropped" not in off
    host.config = MetricsConfig(per_sandbox=True, per_sandbox_max=2)
    text = scrape(metrics)
    shown = [
        labels["sandbox"]
        for name, labels, _ in samples(text)
        if name == "slicebox_sandbox_cpu_seconds_total"
    ]
    assert shown == [IDLE[:12], "sbx-busy"], "the first two by owner and unit; ids as known"
    assert value(text, "slicebox_sandbox_cpu_seconds_total", sandbox="sbx-busy") == 19.0
    assert value(text, "slicebox_sandbox_oom_kills_total", sandbox="sbx-busy") == 1
    assert value(text, "slicebox_metrics_sandboxes_dropped") == 2
    host.config = MetricsConfig(per_sandbox=True)
    assert value(scrape(metrics), "slicebox_metrics_sandboxes_dropped") == 0


def test_the_pools_and_egress_come_from_the_agent_s_memory(host: Host) -> None:
    text = scrape(agent_metrics(host))
    pool = {"user": "alice", "project": "web", "pool": FINGERPRINT}
    assert value(text, "slicebox_pool_ready", **pool) == 1
    assert value(text, "slicebox_pool_busy", **pool) == 1, "the listed member not ready"
    assert value(text, "slicebox_pool_hits_total", **pool) == 3
    assert value(text, "slicebox_pool_misses_total", **pool) == 1
    assert value(text, "slicebox_pool_acquire_seconds_count", user="alice") == 1
    assert value(text, "slicebox_egress_packets_total", verdict="allowed") == 10
    assert value(text, "slicebox_egress_bytes_total", verdict="denied") == 120
    assert value(text, "slicebox_egress_dns_refused_total", user="alice") == 3
    host.pools = [host.pools[0]._replace(handed=frozenset({OTHER, "gone" * 16}))]
    host.listed = []
    assert value(scrape(agent_metrics(host)), "slicebox_pool_busy", **pool) == 1, (
        "a member handed out counts while its scope runs, and only then"
    )


def test_the_agent_s_own_process_and_build_are_there(host: Host) -> None:
    text = scrape(agent_metrics(host))
    assert (value(text, "process_resident_memory_bytes") or 0) > 0
    assert (value(text, "process_threads") or 0) >= 1
    assert value(text, "process_open_fds") is not None
    assert value(text, "process_start_time_seconds") is not None
    assert value(text, "slicebox_build_info", version=_version()) == 1


def _version() -> str:
    import slicebox

    return slicebox.__version__


def test_a_scrape_lists_no_backend_and_reads_no_sandbox_file_unless_asked(host: Host) -> None:
    """With per-sandbox series off, a scrape reads the levels' files and lists directories:
    none of a sandbox's files, however many there are."""
    opened: list[str] = []
    real = os.open

    def watched(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real(path, *args, **kwargs)

    metrics = agent_metrics(host)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", watched)
        scrape(metrics)
    ours = [p for p in opened if p.startswith(str(host.root))]
    assert ours
    assert not [p for p in ours if ".scope/" in p or f"{NATIVE}/" in p]


# --- formats ---------------------------------------------------------------------------------


def test_openmetrics_when_accept_asks_for_it(host: Host) -> None:
    metrics = agent_metrics(host)
    body, content_type = metrics.exposition(None, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode()
    assert text.endswith("# EOF\n")
    families = {family.name: family for family in openmetrics_families(text)}
    assert families["slicebox_level_cpu_seconds"].type == "counter"
    assert families["slicebox_build"].type == "info"
    _, plain = metrics.exposition(None, "text/plain")
    assert plain.startswith("text/plain")


# --- who sees what ---------------------------------------------------------------------------


def test_a_non_admin_sees_only_their_own_user_s_series(host: Host) -> None:
    text = scrape(agent_metrics(host), user="bob")
    names = {name for name, _, _ in samples(text)}
    for name, labels, _ in samples(text):
        assert labels.get("user") == "bob" or name.startswith(("process_", "slicebox_build")), (
            name,
            labels,
        )
    assert "slicebox_level_cpu_seconds_total" in names
    assert "slicebox_execs_total" in names
    assert "process_resident_memory_bytes" in names
    for theirs in ("slicebox_pool_ready", "slicebox_egress_packets_total"):
        assert theirs not in names, "alice's"
    for everyone in ("slicebox_http_requests_total", "slicebox_reaper_actions_total"):
        assert everyone not in names, "no user label: the admin's"
    assert value(text, "slicebox_level_cpu_seconds_total", level="managed") is None
    admin = scrape(agent_metrics(host))
    assert value(admin, "slicebox_level_cpu_seconds_total", level="managed") == 30.0


class Users:
    """The user database: bob (uid 1001) is a member of group slicebox."""

    def user_name(self, uid: int) -> str | None:
        return {0: "root", 1001: "bob"}.get(uid)

    def groups_of(self, user: str) -> tuple[int, frozenset[str]]:
        return (1001, frozenset({"slicebox"})) if user == "bob" else (-1, frozenset())


@pytest.fixture
def socket_agent(tmp_path: Path, host: Host) -> Iterator[tuple[Path, AgentMetrics, ServiceWorld]]:
    """The agent's app, every route, on a unix socket, with the metrics over ``host``."""
    world = ServiceWorld(tmp_path / "service")
    metrics = agent_metrics(host)
    world.service.instruments = metrics.instruments
    path = tmp_path / "agent.sock"
    sock = bind_unix(path, group=None)
    loop = asyncio.new_event_loop()
    state = {SERVICE: world.service, METRICS: metrics, MEASURE: metrics.requests}
    app = build_app(ROUTES, Users(), state)  # type: ignore[arg-type]
    serving = loop.run_until_complete(serve(app, sock))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield path, metrics, world
    finally:
        asyncio.run_coroutine_threadsafe(serving.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        sock.close()
        metrics.close()


def get(path: Path, target: str, headers: str = "") -> tuple[str, dict[str, str], str]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        s.sendall(
            f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n".encode()
        )
        return _answer(s)


def _answer(s: socket.socket) -> tuple[str, dict[str, str], str]:
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    head, _, body = b"".join(chunks).decode().partition("\r\n\r\n")
    status, *fields = head.split("\r\n")
    pairs = (field.split(": ", 1) for field in fields)
    return status.split()[1], {k.lower(): v for k, v in pairs}, body


def test_the_socket_serves_each_caller_their_view(
    socket_agent: tuple[Path, AgentMetrics, ServiceWorld], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _, _ = socket_agent
    status, fields, text = get(path, "/metrics")
    assert (status, fields["content-type"]) == ("200", "text/plain; version=0.0.4; charset=utf-8")
    assert value(text, "slicebox_level_cpu_seconds_total", user="alice") is not None
    bob = identity.PeerCredentials(pid=os.getpid(), uid=1001, gid=1001)
    monkeypatch.setattr(api, "peer_credentials", lambda sock: bob)
    status, _, text = get(path, "/metrics", "Accept: application/openmetrics-text\r\n")
    assert status == "200"
    users = {
        sample.labels.get("user")
        for family in openmetrics_families(text)
        for sample in family.samples
    }
    assert users == {None, "bob"}, "bob's series and the agent's own, no one else's"


def test_requests_are_counted_by_route_pattern_never_by_path(
    socket_agent: tuple[Path, AgentMetrics, ServiceWorld],
) -> None:
    path, _, _ = socket_agent
    assert get(path, "/v1/sandboxes/sbx-secretid12")[0] == "404"
    assert get(path, "/v1/no/such/route")[0] == "404"
    _, _, text = get(path, "/metrics")
    assert "sbx-secretid12" not in text
    name = "slicebox_http_requests_total"
    assert value(text, name, route="/v1/sandboxes/{id}", method="GET", code="404") == 1
    assert value(text, name, route="unmatched", code="404") == 1


def test_execs_are_counted_by_how_they_ended(
    socket_agent: tuple[Path, AgentMetrics, ServiceWorld],
) -> None:
    _, metrics, world = socket_agent
    box = world.create(ALICE)
    ThreadSide(world.service).exec(ALICE, box, ExecRequest(argv=("echo", "hi")))
    with pytest.raises(Exception, match="no sandbox"):
        ThreadSide(world.service).exec(ALICE, "sbx-nothing", ExecRequest(argv=("id",)))
    text = scrape(metrics)
    assert value(text, "slicebox_execs_total", user="alice", result="ok") == 2  # one was ours
    assert value(text, "slicebox_execs_total", user="alice", result="refused") == 1
    into = Instruments()
    cases = {"timed_out": ended(timed_out=True), "oom_killed": ended(oom_killed=True)}
    for result, ran in cases.items():
        tally = ExecTally("sbx-1")
        tally.found(world.sandboxes.get(box))
        tally.ran(ran)
        tally.counted(ALICE, None, into)
        assert into.execs.labels("alice", result)._value.get() == 1
    tally = ExecTally("sbx-1")
    tally.started = True
    tally.counted(ALICE, asyncio.CancelledError(), into)
    tally.counted(ALICE, RuntimeError("docker went away"), into)
    assert into.execs.labels("alice", "abandoned")._value.get() == 1
    assert into.execs.labels("alice", "failed")._value.get() == 1


def ended(*, timed_out: bool = False, oom_killed: bool = False) -> ExecResult:
    return ExecResult(
        stdout=b"",
        stderr=b"",
        exit_code=137,
        timed_out=timed_out,
        oom_killed=oom_killed,
        stdout_truncated=False,
        stderr_truncated=False,
        stdout_dropped_bytes=0,
        stderr_dropped_bytes=0,
        duration=1.0,
    )


# --- the core's instruments ------------------------------------------------------------------


def test_the_pool_observes_acquires_and_refills_and_the_reaper_its_actions(
    tmp_path: Path,
) -> None:
    world = test_pool.World(tmp_path)
    counted = Instruments()
    world.pool.instruments = world.reaper.instruments = counted
    world.fill()
    ThreadSide(world.service).create(
        test_pool.ALICE, CreateSandbox(project="web", memory="128MB", ttl_seconds=60)
    )
    assert counted.pool_acquire_seconds.labels("alice", "web")._sum.get() >= 0
    acquired = next(iter(counted.pool_acquire_seconds.collect())).samples
    assert [s.value for s in acquired if s.name.endswith("_count")] == [1.0]
    refilled = next(iter(counted.pool_refill_seconds.collect())).samples
    assert [s.value for s in refilled if s.name.endswith("_count")] == [2.0]
    (handed,) = world.pool.census()
    assert (len(handed.handed), handed.hits, len(handed.ready)) == (1, 1, 1)
    world.config = parse_config(test_pool.POOL.split("[[pool]]")[0])
    world.pool.configure(world.config)
    world.reaper.run()
    actions = next(iter(counted.reaper_actions.collect())).samples
    assert any(s.labels["rule"] == "pool_surplus" and s.value >= 1 for s in actions), actions


def test_egress_sums_survive_a_sandbox_s_release() -> None:
    world = test_egress.Guarded()
    world.guard.place("sbx-1", "alice", "web", test_egress.ALLOW)
    placed = world.guard.place("sbx-2", "alice", "web", test_egress.ALLOW)
    world.api.hit("ok_sbx_1", 5, 500)
    world.api.hit("deny_sbx_2", 2, 80)
    world.ask(placed.address, "github.com")
    before = world.guard.totals()[("alice", "web")]
    assert before == EgressTally(5, 500, 2, 80, 1)
    world.guard.release("sbx-1")
    world.guard.release("sbx-2")
    assert world.guard.totals()[("alice", "web")] == before, "a release takes nothing away"


# --- the metrics listener --------------------------------------------------------------------


def token_file(tmp_path: Path, text: str = "s3cret-token\n", mode: int = 0o600) -> Path:
    path = tmp_path / "metrics.token"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_token_file_must_be_the_agent_s_own_and_no_one_else_s(tmp_path: Path) -> None:
    assert read_token(token_file(tmp_path)) == "s3cret-token"
    cases: dict[str, Callable[[], Path]] = {
        "open to group or others": lambda: token_file(tmp_path, mode=0o640),
        "holds no token": lambda: token_file(tmp_path, "  \n"),
        "cannot be read": lambda: tmp_path / "missing",
    }
    for why, made in cases.items():
        with pytest.raises(TokenRefused, match=why):
            read_token(made())
    link = tmp_path / "link"
    link.symlink_to(token_file(tmp_path))
    with pytest.raises(TokenRefused, match="symbolic link"):
        read_token(link)
    with pytest.raises(TokenRefused) as refused:
        read_token(token_file(tmp_path, mode=0o644))
    assert "s3cret" not in str(refused.value), "never the token itself"


def tcp(
    address: tuple[str, int], target: str, headers: str = ""
) -> tuple[str, dict[str, str], str]:
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(
            f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n".encode()
        )
        return _answer(s)


def bound(listener: ScrapeListener) -> tuple[str, int] | None:
    return listener.address


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_listener_answers_the_token_only(
    tmp_path: Path, host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = agent_metrics(host)
    listener = ScrapeListener(metrics)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def apply(config: MetricsConfig) -> None:
        asyncio.run_coroutine_threadsafe(listener.apply(config), loop).result(10)

    listen = f"127.0.0.1:{free_port()}"
    try:
        token = token_file(tmp_path)
        apply(MetricsConfig(listen=listen, token_file=token))
        address = bound(listener)
        assert address is not None
        for headers in ("", "Authorization: Bearer wrong\r\n", "Authorization: Basic eDp5\r\n"):
            status, fields, body = tcp(address, "/metrics", headers)
            assert (status, fields["www-authenticate"]) == ("401", 'Bearer realm="slicebox"')
            assert json.loads(body)["code"] == "unauthorized"
        status, _, text = tcp(address, "/metrics", "Authorization: Bearer s3cret-token\r\n")
        assert status == "200"
        assert value(text, "slicebox_level_cpu_seconds_total", level="managed") == 30.0
        assert tcp(address, "/v1/health", "Authorization: Bearer s3cret-token\r\n")[0] == "404"
        token_file(tmp_path, "another\n")
        apply(MetricsConfig(listen=listen, token_file=token))
        assert bound(listener) == address, "a new token keeps the port"
        assert tcp(address, "/metrics", "Authorization: Bearer another\r\n")[0] == "200"
        assert tcp(address, "/metrics", "Authorization: Bearer s3cret-token\r\n")[0] == "401"
        with caplog.at_level(logging.ERROR):
            apply(MetricsConfig(listen=listen, token_file=token_file(tmp_path, mode=0o604)))
        assert bound(listener) is None, "no listener with a token others may read"
        assert "open to group or others" in caplog.text
        assert "another" not in caplog.text
        with pytest.raises(ConnectionRefusedError):
            tcp(address, "/metrics")
        apply(MetricsConfig(listen=listen, token_file=token_file(tmp_path)))
        assert bound(listener) is not None
        apply(MetricsConfig())
        assert bound(listener) is None, "unset: stopped"
    finally:
        asyncio.run_coroutine_threadsafe(listener.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        metrics.close()


@pytest.mark.parametrize(
    ("listen", "address"),
    [("127.0.0.1:9464", ("127.0.0.1", 9464)), ("[::1]:9464", ("::1", 9464))],
)
def test_the_listen_address_is_an_ip_and_a_port(listen: str, address: tuple[str, int]) -> None:
    assert MetricsConfig(listen=listen).address() == address
    assert MetricsConfig().address() is None


@pytest.mark.parametrize(
    "listen", ["localhost:9464", "127.0.0.1", "127.0.0.1:0x1", "1.2.3.4:70000"]
)
def test_a_listen_address_that_is_not_one_is_refused(listen: str) -> None:
    with pytest.raises(ValueError, match="listen"):
        MetricsConfig(listen=listen)


# --- the dashboard ---------------------------------------------------------------------------

PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "le", "without", "on", "ignoring",
    "max", "min", "avg", "count", "topk", "label_values", "job",
}  # fmt: skip


def queried_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Every metric name in the dashboard's queries (panels, rows' panels, variables)."""
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for each in [panel, *panel.get("panels", [])]
        for target in each.get("targets", [])
    ]
    variables = [var["query"] for var in dashboard["templating"]["list"] if var["type"] == "query"]
    exprs += [re.sub(r"label_values\(([^,]*),[^)]*\)", r"\1", query) for query in variables]
    names = set()
    for expr in exprs:
        bare = re.sub(r'"[^"]*"', "", re.sub(r"\{[^}]*\}", "", expr))  # no labels, no strings
        bare = re.sub(r"\[[^\]]*\]", "", bare)  # no ranges
        bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)  # no groupings
        names |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare) if w not in PROMQL_WORDS}
    return names


def test_every_series_the_dashboard_queries_is_exposed(host: Host) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = queried_metrics(dashboard)
    assert "slicebox_level_oom_kills_total" in wanted
    assert "slicebox_pool_acquire_seconds_bucket" in wanted
    assert "slicebox_egress_packets_total" in wanted
    exposed = {name for name, _, _ in samples(scrape(agent_metrics(host)))}
    assert wanted - exposed == set()


@contextmanager
def served(listener: ScrapeListener, config: MetricsConfig) -> Iterator[tuple[str, int]]:
    """``listener`` applying ``config`` on a loop of its own; where it listens."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(listener.apply(config), loop).result(10)
        address = bound(listener)
        assert address is not None
        yield address
    finally:
        asyncio.run_coroutine_threadsafe(listener.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextmanager
def held_as(uid: int, address: tuple[str, int], count: int) -> Iterator[None]:
    """``count`` connections to ``address`` opened and held by a child running as ``uid``."""
    ready_read, ready_write = os.pipe()
    hold_read, hold_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(hold_write)
            os.close(ready_read)
            os.setgid(uid)
            os.setuid(uid)
            # Numeric and connected as it is, as in test_tcpowner: no name look-up, whose
            # codecs this uid may not be able to import from where the test's Python lives.
            held = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
            for each in held:
                each.connect(address)
            os.write(ready_write, b"!")
            os.read(hold_read, 1)
            del held
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(hold_read)
    try:
        assert os.read(ready_read, 1) == b"!", "the child connected"
        time.sleep(0.2)  # the listener has accepted them
        yield
    finally:
        os.close(hold_write)
        os.close(ready_read)
        os.waitpid(pid, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="the holder runs as another uid: needs root")
def test_a_local_user_at_its_caps_on_the_lan_address_leaves_the_scraper_its_own(
    tmp_path: Path, host: Host
) -> None:
    """A local user holding every connection it may open to the host's LAN address (not
    loopback) is counted under its uid, not in one bucket with every other peer: the
    scraper's connection is still served (before: 429)."""
    lan = lan_address()
    metrics = agent_metrics(host)
    config = MetricsConfig(listen=f"{lan}:{free_port()}", token_file=token_file(tmp_path))
    try:
        with (
            served(ScrapeListener(metrics), config) as address,
            held_as(NOBODY, address, SCRAPER_LIMITS.connections_per_uid),
        ):
            status, _, _ = tcp(address, "/metrics", "Authorization: Bearer s3cret-token\r\n")
            assert status == "200"
    finally:
        metrics.close()
