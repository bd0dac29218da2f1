"""One-shot runs: the sandbox is destroyed whatever happens; the hardened defaults as data."""

from __future__ import annotations

import pytest

from slicebox.core.execution import ExecEngine
from slicebox.core.oneshot import (
    MinimalSandboxConfig,
    execute,
    hardened_cli_flags,
    hardened_run_options,
)
from slicebox.model.errors import InvalidTimeout
from slicebox.model.exec import ExecRequest, OutputStream, StreamChunk
from tests.fakes.exec_fakes import FakeClock, FakeExec, FakeExecApi, FakeSandboxHost

CONFIG = MinimalSandboxConfig(image="busybox", cgroup_parent="slicebox-u-p.slice")


class RecordingProvider:
    def __init__(self, api: FakeExecApi) -> None:
        self.api = api
        self.live: set[str] = set()

    def create(self, config: MinimalSandboxConfig) -> str:
        self.live.add("box")
        self.api.containers["box"] = 100
        return "box"

    def destroy(self, container_id: str) -> None:
        self.live.discard(container_id)
        self.api.containers.pop(container_id, None)


def setup(run: FakeExec) -> tuple[ExecEngine, RecordingProvider]:
    clock = FakeClock()
    host = FakeSandboxHost(procs={100: 0})
    api = FakeExecApi(clock, host, run)
    api.containers.clear()
    return ExecEngine(api, host, clock=clock, sleep=clock.sleep), RecordingProvider(api)


def test_execute_runs_then_destroys() -> None:
    engine, provider = setup(
        FakeExec([[StreamChunk(stream=OutputStream.STDOUT, data=b"4\n")], None])
    )
    result = execute(
        ExecRequest(argv=("expr", "2", "+", "2")), CONFIG, provider=provider, engine=engine
    )
    assert result.stdout == b"4\n"
    assert provider.live == set()


def test_a_timed_out_one_shot_is_destroyed() -> None:
    engine, provider = setup(FakeExec([], pid=5))
    result = execute(
        ExecRequest(argv=("sleep", "60"), timeout=1), CONFIG, provider=provider, engine=engine
    )
    assert result.timed_out
    assert provider.live == set()


def test_a_failing_exec_still_destroys() -> None:
    engine, provider = setup(FakeExec([None]))

    def broken(container_id: str) -> int:
        raise InvalidTimeout("x")

    provider.api.sandbox_pid = broken  # type: ignore[method-assign]
    with pytest.raises(InvalidTimeout):
        execute(ExecRequest(argv=("true",)), CONFIG, provider=provider, engine=engine)
    assert provider.live == set()


def test_hardened_defaults_as_options_and_flags() -> None:
    options = hardened_run_options(CONFIG)
    assert options["cap_drop"] == ["ALL"]
    assert options["security_opt"] == ["no-new-privileges"]
    assert options["network_mode"] == "none"
    assert (options["pids_limit"], options["mem_limit"], options["nano_cpus"]) == (
        100,
        256 * 1024 * 1024,
        500_000_000,
    )
    assert options["init"] is True
    flags = hardened_cli_flags(CONFIG)
    assert {"--cap-drop=ALL", "--network=none", "--init", "--pids-limit=100"} <= set(flags)
    assert "--cgroup-parent=slicebox-u-p.slice" in flags


def test_config_refuses_a_cgroup_parent_that_is_not_a_slice() -> None:
    with pytest.raises(ValueError, match="cgroup_parent"):
        MinimalSandboxConfig(image="busybox", cgroup_parent="../etc")
