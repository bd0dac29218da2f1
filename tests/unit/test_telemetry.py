"""ResourceUsage and the level tree over temporary cgroupfs trees, and the netns counter sum."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from slicebox.core.telemetry import (
    MemoryIntegrator,
    SandboxCgroups,
    SandboxMeta,
    TreeReader,
    UsageReader,
    find_scope,
    scope_pid,
)
from slicebox.host.cgroupfs import CgroupFS
from slicebox.host.netstats import LinkCounters, NetnsCounters, link_counters, total_bytes
from slicebox.model.usage import Level, ResourceUsage, oom_blame, throttle_blame

MANAGED = "slicebox.slice"
USER = f"{MANAGED}/slicebox-alice.slice"
PROJECT = f"{USER}/slicebox-alice-web.slice"
SCOPE = f"{PROJECT}/docker-aaa.scope"
OTHER = f"{PROJECT}/docker-bbb.scope"
CREATED = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)

EVENTS = "low 0\nhigh 0\nmax {max}\noom {oom}\noom_kill {kill}\noom_group_kill 0\n"
CPU = "usage_usec {usage}\nuser_usec 0\nsystem_usec 0\nnr_periods 9\nnr_throttled {thr}\n"
CPU += "throttled_usec {thr_usec}\n"


def events(max: int = 0, oom: int = 0, kill: int = 0) -> str:  # the kernel's key
    return EVENTS.format(max=max, oom=oom, kill=kill)


def cgroup(
    root: Path,
    path: str,
    memory: int,
    *,
    hier: str = "",
    local: str = "",
    usage: int = 0,
    throttled: int = 0,
    extra: dict[str, str] | None = None,
) -> None:
    files = {
        "memory.current": f"{memory}\n",
        "memory.peak": f"{memory * 2}\n",
        "memory.max": "max\n",
        "memory.events": hier or events(),
        "memory.events.local": local or events(),
        "cpu.stat": CPU.format(usage=usage, thr=throttled, thr_usec=throttled * 1000),
        "cpu.max": "max 100000\n",
        "pids.current": "2\n",
        "pids.max": "max\n",
        **(extra or {}),
    }
    (root / path).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / path / name).write_text(text)


@pytest.fixture
def tree_root(tmp_path: Path) -> Path:
    """A project OOM: the project's memory.max was hit, the victim lived in docker-aaa."""
    cgroup(tmp_path, MANAGED, 300, hier=events(1, 1, 1), usage=9_000_000)
    cgroup(tmp_path, USER, 200, hier=events(1, 1, 1), usage=8_000_000)
    cgroup(
        tmp_path,
        PROJECT,
        150,
        hier=events(1, 1, 1),
        local=events(1, 1, 0),
        usage=7_000_000,
        throttled=4,
        extra={"memory.max": "67108864\n", "cpu.max": "20000 100000\n"},
    )
    scope_files = {"io.stat": "254:0 rbytes=0 wbytes=52428800 rios=0 wios=9\n"}
    cgroup(tmp_path, SCOPE, 100, hier=events(0, 0, 1), local=events(0, 0, 1), usage=2_500_000)
    for name, text in scope_files.items():
        (tmp_path / SCOPE / name).write_text(text)
    cgroup(tmp_path, OTHER, 50, usage=1)
    (tmp_path / MANAGED / "not-ours.scope").mkdir()
    (tmp_path / USER / "stray.service").mkdir()
    return tmp_path


class FakeNet:
    """NetCounters with fixed per-pid readings."""

    def __init__(self, readings: dict[int, int | None]) -> None:
        self.readings = readings

    def bytes_for_pid(self, pid: int) -> int | None:
        return self.readings.get(pid)


def meta(**overrides: Any) -> SandboxMeta:
    values: dict[str, Any] = {
        "backend": "docker",
        "created_at": CREATED,
        "cpu": 0.5,
        "memory_bytes": 268435456,
    }
    return SandboxMeta(**{**values, **overrides})


def test_usage_reads_the_seed_fields_from_the_tree(tree_root: Path) -> None:
    reader = UsageReader(CgroupFS(tree_root), net=FakeNet({42: 1234}))
    usage = reader.usage(SandboxCgroups.of_scope(SCOPE), meta(init_pid=42))
    assert usage.to_wire() == {
        "memory_bytes": {"managed": 300, "user": 200, "project": 150},
        "cpu_seconds": 2.5,
        "sandbox": {
            "backend": "docker",
            "created_at": "2026-11-30T02:00:00Z",
            "provisioned": {"cpu": 0.5, "memory_bytes": 268435456},
        },
        "disk_bytes_written": 52428800,
        "network_bytes": 1234,
    }


def test_a_process_of_the_scope_stands_for_its_netns_and_none_when_it_is_gone(
    tree_root: Path,
) -> None:
    files = CgroupFS(tree_root)
    (tree_root / SCOPE / "cgroup.procs").write_text("4242\n4250\n")
    assert scope_pid(files, SCOPE) == 4242
    (tree_root / SCOPE / "cgroup.procs").write_text("")
    assert scope_pid(files, SCOPE) is None
    assert scope_pid(files, f"{PROJECT}/docker-gone.scope") is None


def test_of_scope_derives_the_three_slices() -> None:
    assert SandboxCgroups.of_scope("/" + SCOPE) == SandboxCgroups(SCOPE, PROJECT, USER, MANAGED)
    with pytest.raises(ValueError, match="deep"):
        SandboxCgroups.of_scope("slicebox.slice/docker-x.scope")


def test_vanished_sandbox_reads_no_values_not_zeros(tree_root: Path) -> None:
    gone = SandboxCgroups.of_scope(f"{PROJECT}/docker-gone.scope")
    usage = UsageReader(CgroupFS(tree_root), net=FakeNet({})).usage(gone, meta(init_pid=7))
    assert usage.cpu_seconds is None
    assert usage.disk_bytes_written is None
    assert usage.network_bytes is None
    assert usage.memory_bytes is not None  # the slices are still there


def test_vanished_slice_drops_memory_bytes(tree_root: Path) -> None:
    (tree_root / USER / "memory.current").unlink()
    usage = UsageReader(CgroupFS(tree_root)).usage(SandboxCgroups.of_scope(SCOPE), meta())
    assert usage.memory_bytes is None
    assert "memory_bytes" not in usage.to_wire()


def test_network_none_zero_is_a_reading() -> None:
    assert total_bytes([LinkCounters(1, 500, 500)]) == 0  # lo
    links = [LinkCounters(1, 9, 9), LinkCounters(2, 10, 20)]
    assert total_bytes(links) == 30


def test_final_usage_sets_deleted_at_and_closes_the_integral(tree_root: Path) -> None:
    clock = iter([0.0, 10.0])
    integrator = MemoryIntegrator(lambda: next(clock))
    reader = UsageReader(CgroupFS(tree_root), integrator=integrator)
    where = SandboxCgroups.of_scope(SCOPE)
    integrator.sample(SCOPE, 100)
    deleted = CREATED + timedelta(minutes=5)
    final = reader.final_usage(where, meta(), deleted)
    assert final.sandbox is not None
    assert final.sandbox.deleted_at == deleted
    assert final.to_wire()["sandbox"]["deleted_at"] == "2026-11-30T02:05:00Z"
    assert final.memory_seconds == 1000.0  # 100 bytes held for 10 s
    assert integrator.value(SCOPE) is None  # forgotten with the sandbox


def test_final_usage_without_labels_keeps_the_kernel_counters(tree_root: Path) -> None:
    """Docker down: no labels, so no sandbox part, but the cgroup still tells the story."""
    reader = UsageReader(CgroupFS(tree_root), net=FakeNet({100: 5}))
    final = reader.final_usage(SandboxCgroups.of_scope(SCOPE), None, CREATED)
    assert final.to_wire() == {
        "memory_bytes": {"managed": 300, "user": 200, "project": 150},
        "cpu_seconds": 2.5,
        "disk_bytes_written": 52428800,
    }


def test_find_scope_looks_through_every_user_and_project(tree_root: Path) -> None:
    files = CgroupFS(tree_root)
    assert find_scope(files, "bbb") == OTHER
    assert find_scope(files, "ccc") is None
    assert find_scope(CgroupFS(tree_root / "nothing"), "aaa") is None


def test_integrator_trapezoids_and_skips_missing_readings() -> None:
    times = iter([0.0, 2.0, 4.0])
    integrator = MemoryIntegrator(lambda: next(times))
    assert integrator.value("s") is None
    integrator.sample("s", 100)
    integrator.sample("s", None)  # a vanished reading does not consume the clock
    integrator.sample("s", 300)
    integrator.sample("s", 300)
    assert integrator.value("s") == 400.0 + 600.0


def test_sample_all_reads_memory_current(tree_root: Path) -> None:
    times = iter([0.0, 0.0, 1.0, 1.0])  # the vanished one never reads the clock
    integrator = MemoryIntegrator(lambda: next(times))
    reader = UsageReader(CgroupFS(tree_root)).cgroups
    gone = f"{PROJECT}/docker-gone.scope"
    for _ in range(2):
        integrator.sample_all(reader, [SCOPE, OTHER, gone])
    assert (integrator.value(SCOPE), integrator.value(OTHER)) == (100.0, 50.0)
    assert integrator.value(gone) is None


def valid_wire() -> dict[str, Any]:
    return {
        "memory_bytes": {"managed": 3, "user": 2, "project": 1},
        "cpu_seconds": 1.5,
        "sandbox": {
            "backend": "docker",
            "created_at": "2026-11-30T02:00:00Z",
            "provisioned": {"cpu": 1, "memory_bytes": 5},
        },
    }


def test_strict_model_round_trips_the_seed_shape() -> None:
    usage = ResourceUsage.model_validate_json(json.dumps(valid_wire()))
    assert usage.to_wire() == {**valid_wire(), "sandbox": {**valid_wire()["sandbox"]}}


@pytest.mark.parametrize(
    "path",
    [(), ("memory_bytes",), ("sandbox",), ("sandbox", "provisioned")],
    ids=["top", "memory_bytes", "sandbox", "provisioned"],
)
def test_strict_model_rejects_unknown_keys_at_every_level(path: tuple[str, ...]) -> None:
    wire = json.loads(json.dumps(valid_wire()))
    target = wire
    for key in path:
        target = target[key]
    target["surprise"] = 1
    with pytest.raises(ValidationError, match="surprise"):
        ResourceUsage.model_validate(wire)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_seconds", -1.0),
        ("cpu_seconds", "1.5"),
        ("disk_bytes_written", 1.5),
        ("network_bytes", True),
    ],
)
def test_strict_model_rejects_bad_numbers(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        ResourceUsage.model_validate({**valid_wire(), field: value})


def test_timestamps_become_utc_and_naive_ones_are_refused() -> None:
    plus_two = datetime(2026, 11, 30, 4, 0, tzinfo=timezone(timedelta(hours=2)))
    info = meta(created_at=plus_two).info()
    assert info.model_dump(mode="json")["created_at"] == "2026-11-30T02:00:00Z"
    with pytest.raises(ValidationError, match="created_at"):
        meta(created_at=datetime(2026, 11, 30)).info()  # naive: the point of the test
    with pytest.raises(ValidationError, match="backend"):
        meta(backend="").info()


def test_tree_walks_managed_users_projects_sandboxes(tree_root: Path) -> None:
    tree = TreeReader(CgroupFS(tree_root)).tree()
    levels = [(n.level, n.unit) for n in tree.walk()]
    assert levels == [
        (Level.MANAGED, MANAGED),
        (Level.USER, "slicebox-alice.slice"),
        (Level.PROJECT, "slicebox-alice-web.slice"),
        (Level.SANDBOX, "docker-aaa.scope"),
        (Level.SANDBOX, "docker-bbb.scope"),
    ]
    project = tree.find(PROJECT)
    assert project is not None
    assert (project.memory_current, project.memory_peak, project.memory_max) == (150, 300, 67108864)
    assert (project.cpu_quota, project.pids_current, project.pids_max) == (0.2, 2, None)
    sandbox = tree.find(SCOPE)
    assert sandbox is not None
    assert (sandbox.cpu_usage_usec, sandbox.oom_kills) == (2_500_000, 1)


def test_project_oom_is_blamed_on_the_project_not_the_sandbox(tree_root: Path) -> None:
    tree = TreeReader(CgroupFS(tree_root)).tree()
    assert [n.level for n in oom_blame(tree, SCOPE)] == [Level.PROJECT]
    assert [n.level for n in throttle_blame(tree, SCOPE)] == [Level.PROJECT]
    assert oom_blame(tree, f"{PROJECT}/docker-unknown.scope") == []


def test_sandbox_own_limit_oom_is_blamed_on_the_sandbox(tmp_path: Path) -> None:
    for path in (MANAGED, USER, PROJECT):
        cgroup(tmp_path, path, 10, hier=events(1, 1, 1))
    cgroup(tmp_path, SCOPE, 10, hier=events(1, 1, 1), local=events(1, 1, 1))
    tree = TreeReader(CgroupFS(tmp_path)).tree()
    assert [n.level for n in oom_blame(tree, SCOPE)] == [Level.SANDBOX]


def test_decoder_names_levels_and_missing_root_is_empty(tree_root: Path) -> None:
    tree = TreeReader(CgroupFS(tree_root), decode=lambda level, unit: f"{level}:{unit}").tree()
    assert tree.children[0].name == "user:slicebox-alice.slice"
    empty = TreeReader(CgroupFS(tree_root / "nothing")).tree()
    assert (empty.children, empty.memory_current) == ((), None)


class CountingFiles(CgroupFS):
    """A real CgroupFS over the temporary tree that counts reads per file."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: dict[str, int] = {}

    def read(self, cgroup: str, name: str) -> str | None:
        key = f"{cgroup}/{name}"
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().read(cgroup, name)


def test_usage_many_reads_each_slice_once_and_matches_single_reads(tree_root: Path) -> None:
    files = CountingFiles(tree_root)
    reader = UsageReader(files)
    pairs = [(SandboxCgroups.of_scope(s), meta()) for s in (SCOPE, OTHER)]
    many = reader.usage_many(pairs)
    assert files.reads[f"{PROJECT}/memory.current"] == 1
    assert many == [reader.usage(where, m) for where, m in pairs]
    assert [u.cpu_seconds for u in many] == [2.5, 1e-6]


class FakeStatsMessage:
    """The parts of a pyroute2 RTM_NEWSTATS message that link_counters reads."""

    def __init__(self, index: int, stats: dict[str, int] | None) -> None:
        self.attrs: dict[str, object] = {"IFLA_STATS_LINK_64": stats}
        self.index = index

    def get_attr(self, key: str) -> object:
        return self.attrs.get(key)

    def __getitem__(self, key: str) -> int:
        assert key == "ifindex"
        return self.index


def test_link_counters_take_link_1_for_loopback_and_sum_the_rest() -> None:
    eth = link_counters(FakeStatsMessage(7, {"rx_bytes": 7, "tx_bytes": 5}))
    lo = link_counters(FakeStatsMessage(1, {"rx_bytes": 1, "tx_bytes": 1}))
    bare = link_counters(FakeStatsMessage(9, None))
    assert eth == LinkCounters(7, 7, 5)
    assert lo.loopback
    assert not eth.loopback
    assert bare == LinkCounters(9, 0, 0)
    assert total_bytes([eth, lo, bare]) == 12


def test_netns_of_a_gone_pid_reads_none(tmp_path: Path) -> None:
    assert NetnsCounters(proc=str(tmp_path)).bytes_for_pid(4242) is None


def test_podman_s_monitor_beside_a_container_is_not_a_sandbox(tree_root: Path) -> None:
    cgroup(tree_root, f"{PROJECT}/libpod-ccc.scope", 10, usage=1)
    cgroup(tree_root, f"{PROJECT}/libpod-conmon-ccc.scope", 1, usage=1)
    tree = TreeReader(CgroupFS(tree_root)).tree()
    sandboxes = [n.unit for n in tree.walk() if n.level is Level.SANDBOX]
    assert sandboxes == ["docker-aaa.scope", "docker-bbb.scope", "libpod-ccc.scope"]
