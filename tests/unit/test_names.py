from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from slicebox.model.errors import InvalidName
from slicebox.model.names import (
    DOCKER_SCOPES,
    PODMAN_SCOPES,
    is_container_scope,
    parse_slice,
    project_slice,
    scope_cgroup,
    scope_name,
    slice_names,
    use_scope_prefix,
    user_slice,
)


@pytest.mark.parametrize(
    ("user", "project", "unit"),
    [
        ("alice", "demo", "slicebox-alice-demo.slice"),
        ("al-ice", "my-proj", "slicebox-al\\x2dice-my\\x2dproj.slice"),
        ("a.b", "c_d", "slicebox-a.b-c_d.slice"),
        ("_x", "9", "slicebox-_x-9.slice"),
        ("A-", "b--c", "slicebox-A\\x2d-b\\x2d\\x2dc.slice"),
    ],
)
def test_names_map_both_ways(user: str, project: str, unit: str) -> None:
    assert project_slice(user, project) == unit
    assert parse_slice(unit) == (user, project)
    assert parse_slice(user_slice(user)) == (user, None)


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "../x", "a/b", "-a", ".hidden", "a b", "é", "名前", "a\\x2db", "a\n", "x" * 65],
)
def test_hostile_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidName):
        user_slice(name)
    with pytest.raises(InvalidName):
        project_slice("alice", name)


def test_too_long_together_is_refused() -> None:
    with pytest.raises(InvalidName, match="too long"):
        project_slice("a" + "-" * 63, "b" + "-" * 63)


@pytest.mark.parametrize(
    "unit", ["system.slice", "slicebox-a-b-c.slice", "slicebox-a.scope", "slicebox-..slice"]
)
def test_foreign_units_do_not_parse(unit: str) -> None:
    with pytest.raises(InvalidName):
        parse_slice(unit)


def test_cgroup_paths_follow_the_nesting() -> None:
    cgroups = slice_names("a-b", "c").cgroups()
    assert cgroups.project == PurePosixPath(
        "/sys/fs/cgroup/slicebox.slice/slicebox-a\\x2db.slice/slicebox-a\\x2db-c.slice"
    )
    assert cgroups.user == cgroups.project.parent
    assert cgroups.managed == PurePosixPath("/sys/fs/cgroup/slicebox.slice")
    assert scope_cgroup("a-b", "c", "f00") == cgroups.project / "docker-f00.scope"


def test_podman_names_a_container_s_scope_libpod_and_its_monitor_is_not_one() -> None:
    assert scope_name("f00") == "docker-f00.scope"
    assert is_container_scope("docker-f00.scope")
    try:
        use_scope_prefix(PODMAN_SCOPES)
        assert scope_name("f00") == "libpod-f00.scope"
        assert scope_cgroup("a", "c", "f00").name == "libpod-f00.scope"
        assert is_container_scope("libpod-f00.scope")
        assert not is_container_scope("libpod-conmon-f00.scope")
        assert not is_container_scope("docker-f00.scope")
    finally:
        use_scope_prefix(DOCKER_SCOPES)
    with pytest.raises(ValueError, match="unknown scope prefix"):
        use_scope_prefix("lxc")
