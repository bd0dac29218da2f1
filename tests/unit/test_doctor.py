from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from pathlib import Path

import pytest

from slicebox.backends.base import Availability
from slicebox.backends.dockerendpoint import parse_docker_host
from slicebox.backends.engines import CONTEXT_CODE, FoundEngine
from slicebox.cli import main as cli
from slicebox.cli.doctor import (
    Host,
    State,
    check_agent,
    check_bind_roots,
    check_cgroup2,
    check_controllers,
    check_docker,
    check_native,
    check_systemd,
    failed,
    lines,
)
from slicebox.model.errors import Unavailable
from slicebox.model.spec import Backend


def fake_host(tmp_path: Path, pid1: str, controllers: str | None) -> Host:
    (tmp_path / "proc" / "1").mkdir(parents=True)
    (tmp_path / "proc" / "1" / "comm").write_text(pid1 + "\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    if controllers is not None:
        (cgroup / "cgroup.controllers").write_text(controllers)
        (cgroup / "cgroup.subtree_control").write_text(controllers)
    return Host(proc=tmp_path / "proc", cgroup=cgroup, agent_socket=str(tmp_path / "none.sock"))


def test_a_good_host_passes(tmp_path: Path) -> None:
    host = fake_host(tmp_path, "systemd", "cpuset cpu io memory pids")
    assert all(check(host).ok for check in (check_systemd, check_cgroup2, check_controllers))


def test_a_bad_host_says_what_to_fix(tmp_path: Path) -> None:
    host = fake_host(tmp_path, "tini", None)
    systemd, cgroup2, controllers = (
        check(host) for check in (check_systemd, check_cgroup2, check_controllers)
    )
    assert not systemd.ok
    assert "tini" in systemd.detail
    assert not cgroup2.ok
    assert "unified_cgroup_hierarchy" in cgroup2.fix
    assert not controllers.ok
    assert "cpu memory pids io" in controllers.fix


def test_unreachable_agent_fails_with_a_fix(tmp_path: Path) -> None:
    check = check_agent(Host(agent_socket=str(tmp_path / "none.sock")))
    assert not check.ok
    assert check.fix == "systemctl start slicebox.socket"


def test_cli_doctor_exits_nonzero_and_prints_fixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--socket", str(tmp_path / "none.sock"), "doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL agent" in out
    assert "fix: systemctl start slicebox.socket" in out


def found_at(url: str, source: str = "DOCKER_HOST") -> Callable[[], FoundEngine]:
    return lambda: FoundEngine(endpoint=parse_docker_host(url), source=source)


def test_a_docker_socket_not_ours_is_skipped_not_passed_nor_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = tmp_path / "docker.sock"
    sock.touch(mode=0o600)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as an ordinary user sees it
    check = check_docker(Host(engine=found_at(f"unix://{sock}", "the system's Docker socket")))
    assert check.state is State.SKIP
    assert not check.ok
    assert "sudo slicebox doctor" in check.fix
    assert not failed([check])
    assert list(lines([check])) == [
        f"skip docker               {check.detail}",
        f"     {'':<20} to check: {check.fix}",
    ]


def test_the_docker_check_names_the_engine_and_how_it_was_found(tmp_path: Path) -> None:
    none = tmp_path / "none.sock"
    unreachable = check_docker(Host(engine=found_at(f"unix://{none}", "the rootless socket")))
    assert unreachable.state is State.FAIL
    assert f"unix://{none} (the rootless socket)" in unreachable.detail
    assert "DOCKER_HOST" in unreachable.fix


def test_an_engine_that_cannot_be_found_fails_the_docker_check_with_why() -> None:
    def refused() -> FoundEngine:
        raise Unavailable("the Docker context 'gone' has no endpoint", code=CONTEXT_CODE)

    check = check_docker(Host(engine=refused))
    assert check.state is State.FAIL
    assert "'gone'" in check.detail
    assert "DOCKER_HOST" in check.fix


def roots_host(tmp_path: Path, roots: str) -> Host:
    config = tmp_path / "config.toml"
    config.write_text(f"bind_roots = {roots}\n")
    return Host(config=config, top=tmp_path, owner=os.getuid())


def test_bind_roots_that_nobody_else_can_write_pass(tmp_path: Path) -> None:
    (tmp_path / "srv" / "ws").mkdir(parents=True)
    (tmp_path / "fixed").mkdir()
    for directory in (tmp_path, tmp_path / "srv", tmp_path / "srv" / "ws", tmp_path / "fixed"):
        directory.chmod(0o755)
    host = roots_host(tmp_path, f'["{tmp_path}/srv/ws/{{user}}", "{tmp_path}/fixed"]')
    check = check_bind_roots(host)
    assert check.state is State.OK, check.detail
    assert "/srv/ws/{user}" in check.detail


def test_a_bind_root_below_a_writable_directory_fails_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "srv" / "ws").mkdir(parents=True)
    tmp_path.chmod(0o755)
    (tmp_path / "srv").chmod(0o777)  # anyone could plant srv/ws/alice -> /
    (tmp_path / "srv" / "ws").chmod(0o755)
    check = check_bind_roots(roots_host(tmp_path, f'["{tmp_path}/srv/ws/{{user}}"]'))
    assert check.state is State.FAIL
    assert f"{tmp_path / 'srv'} is writable by its group or others" in check.detail
    assert "chmod go-w" in check.fix
    missing = check_bind_roots(roots_host(tmp_path, f'["{tmp_path}/absent/{{user}}"]'))
    assert missing.state is State.FAIL
    assert "absent does not exist" in missing.detail


def test_a_users_own_directory_on_a_roots_path_that_is_a_symlink_fails(tmp_path: Path) -> None:
    # The old check stopped above {user}: /home/{user}/sandboxes with alice's sandboxes a link
    # to / passed, and the agent admitted / and /etc.
    me = pwd.getpwuid(os.getuid()).pw_name
    (tmp_path / "home" / me).mkdir(parents=True)
    (tmp_path / "home" / "not-a-user-name-here").mkdir()
    tmp_path.chmod(0o755)
    (tmp_path / "home").chmod(0o755)
    host = roots_host(tmp_path, f'["{tmp_path}/home/{{user}}/sandboxes"]')
    check = check_bind_roots(host)
    assert check.state is State.OK, "a user without the directory yet has nothing to redirect"
    (tmp_path / "home" / me / "sandboxes").symlink_to("/")
    check = check_bind_roots(host)
    assert check.state is State.FAIL
    assert f"{tmp_path}/home/{me}/sandboxes is a symlink" in check.detail


def test_no_bind_roots_means_bind_mounts_are_refused(tmp_path: Path) -> None:
    check = check_bind_roots(Host(config=tmp_path / "none.toml"))
    assert (check.state, check.detail) == (State.OK, "none configured: bind mounts are refused")
    (tmp_path / "bad.toml").write_text("bind_roots = 7\n")
    unreadable = check_bind_roots(Host(config=tmp_path / "bad.toml"))
    assert unreadable.state is State.SKIP


def _native(available: bool) -> Callable[[], Availability]:
    detail = "systemd transient units" if available else "systemd does not answer"
    return lambda: Availability(kind=Backend.NATIVE, available=available, detail=detail)


def test_the_native_backend_is_reported_with_its_fallback(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("allow_native_fallback = false\n")
    off = check_native(Host(native=_native(True), config=config))
    assert off.state is State.OK
    assert "no fallback to it (allow_native_fallback = false)" in off.detail
    on = check_native(Host(native=_native(True), config=tmp_path / "none.toml"))
    assert "falls back to it while Docker is unavailable" in on.detail
    down = check_native(Host(native=_native(False), config=config))
    assert down.state is State.FAIL
    assert "systemd does not answer" in down.detail
    assert "PID 1" in down.fix
