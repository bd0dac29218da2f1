"""Who a caller is and who its sandbox runs as, against a hostile member of group slicebox
(issue 37, findings 1, 4 and 5): each test here fails on the code before that work."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from slicebox.core.credentials import CredentialStore
from slicebox.host.identity import CachedUsers, PeerCredentials, resolve
from slicebox.model.config import CallersConfig, parse_config
from slicebox.model.errors import AdmissionRefused, ConfigError, Forbidden, PolicyViolation
from slicebox.model.spec import MAX_GIT_HOSTS, GitCredential
from tests.fakes.threadside import created
from tests.unit.test_identity import Users
from tests.unit.test_sandboxes import FakeBinds, bind_world, spec

DOCKER_GID = 998
ALICE = (1000, 1000)
USERS = Users(
    {1000: "alice", 1001: "bob", 1003: "carol", 1004: "dave"},
    {
        "alice": frozenset({"alice", "slicebox"}),
        "bob": frozenset({"bob", "slicebox"}),
        "carol": frozenset({"carol"}),  # removed from slicebox; her login still has it
        "dave": frozenset({"dave", "slicebox-admin"}),
    },
)


def creds(uid: int, gid: int | None = None) -> PeerCredentials:
    return PeerCredentials(pid=os.getpid(), uid=uid, gid=uid if gid is None else gid)


# --- finding 1: run_as with a host directory -------------------------------------------------

HOST_WS = {"kind": "host", "path": "/srv/ws/al-ice/code"}
HOST_RO = {**HOST_WS, "read_only": True}


@pytest.mark.parametrize(
    "fields",
    [
        {"run_as": f"1000:{DOCKER_GID}", "workspace": HOST_WS},  # set-gid docker on the host
        {"run_as": "1000:0", "workspace": HOST_WS},
        {"run_as": "1001:1001", "workspace": HOST_WS},  # bob's
        {"run_as": "1001:1001", "workspace": HOST_RO},  # read-only: still bob's reads
        {"run_as": "1000", "workspace": HOST_WS},  # the gid would be the image's
        {"run_as": "alice", "workspace": HOST_WS},  # a name the image's passwd maps
        {
            "run_as": f"1000:{DOCKER_GID}",
            "mounts": [{"source": "/srv/ws/al-ice/a", "target": "/a"}],
        },
        {
            "run_as": "1001:1001",
            "mounts": [{"source": "/srv/ws/al-ice/a", "target": "/a", "read_only": True}],
        },
    ],
)
def test_a_host_bind_runs_as_its_owner_and_nothing_else(fields: dict[str, object]) -> None:
    world = bind_world(FakeBinds())
    with pytest.raises(PolicyViolation) as refused:
        created(world.manager, spec(**fields), owner=ALICE)
    assert refused.value.code == "policy_run_as"
    assert refused.value.field == "run_as"
    assert world.docker.containers == {}
    assert world.user_slices() == set()


@pytest.mark.parametrize("run_as", [None, "1000:1000"])
def test_a_host_bind_runs_as_the_owners_uid_and_primary_gid(run_as: str | None) -> None:
    world = bind_world(FakeBinds())
    mounts = [{"source": "/srv/ws/al-ice/a", "target": "/a", "read_only": True}]
    box = created(world.manager, spec(run_as=run_as, mounts=mounts), owner=ALICE)
    assert world.docker.requests[box.container_id].user == "1000:1000"


def test_gid_0_is_refused_without_a_host_bind_too() -> None:
    world = bind_world(FakeBinds())
    with pytest.raises(PolicyViolation) as refused:
        created(world.manager, spec(run_as="1234:0"), owner=ALICE)
    assert refused.value.code == "policy_run_as"
    box = created(world.manager, spec(run_as="1234:1234"), owner=ALICE)
    assert world.docker.requests[box.container_id].user == "1234:1234", "their choice"


def test_a_host_bind_of_a_user_the_host_does_not_know_is_refused() -> None:
    world = bind_world(FakeBinds())
    with pytest.raises(PolicyViolation) as refused:  # an admin acting for al-ice: no passwd
        created(world.manager, spec(workspace=HOST_WS))
    assert refused.value.code == "policy_run_as"
    assert world.docker.containers == {}


# --- finding 5: identity ---------------------------------------------------------------------


def test_a_uid_without_a_passwd_entry_is_refused_unknown_user() -> None:
    with pytest.raises(Forbidden) as refused:
        resolve(creds(100000), USERS)
    assert refused.value.code == "unknown_user"


def test_an_allowed_range_of_unknown_uids_shares_one_user_level() -> None:
    callers = CallersConfig(unknown_uids=(100000, 165535), unknown_user="subids")
    one = resolve(creds(100000), USERS, callers=callers)
    two = resolve(creds(100001, 0), USERS, callers=callers)
    assert (one.user_name, two.user_name) == ("subids", "subids")
    assert not one.is_admin
    assert one.owner == (100000, 100000)
    assert two.owner == (100001, 100001), "a gid outside the range is not taken"
    with pytest.raises(Forbidden):
        resolve(creds(165536), USERS, callers=callers)


def test_the_callers_config_is_read_and_checked() -> None:
    config = parse_config('[callers]\nunknown_uids = [100000, 165535]\nunknown_user = "subids"\n')
    assert config.callers.admits_unknown(165535)
    assert not config.callers.admits_unknown(99999)
    with pytest.raises(ConfigError):
        parse_config("[callers]\nunknown_uids = [0, 10]\n")


def test_a_user_outside_group_slicebox_is_refused_whatever_its_process_groups() -> None:
    with pytest.raises(Forbidden) as refused:
        resolve(creds(1003), USERS)
    assert refused.value.code == "not_member"


def test_a_removal_from_the_group_counts_after_the_cache_time() -> None:
    users = Users(dict(USERS.names), dict(USERS.groups))
    now = [0.0]
    cached = CachedUsers(users, ttl=10, clock=lambda: now[0])
    assert resolve(creds(1001), cached).user_name == "bob"
    users.groups["bob"] = frozenset({"bob"})
    now[0] = 11
    with pytest.raises(Forbidden) as refused:
        resolve(creds(1001), cached)
    assert refused.value.code == "not_member"


def test_admin_is_the_users_membership_not_the_callers_gid() -> None:
    admin_gid = 2000
    egid_only = resolve(creds(1000, admin_gid), USERS)  # alice under `sg slicebox-admin`
    assert not egid_only.is_admin
    member = resolve(creds(1004), USERS)
    assert member.is_admin, "slicebox-admin implies access without group slicebox"


def test_a_sandbox_runs_as_the_users_primary_gid_not_the_callers_egid() -> None:
    alice = resolve(creds(1000, DOCKER_GID), USERS)  # alice under `sg docker`
    assert alice.owner == (1000, 100)  # the fake's primary gid of every user


# --- finding 4: credentials ------------------------------------------------------------------


def test_the_credential_store_is_root_only(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    root.mkdir(mode=0o755)
    CredentialStore(root).write("sbx-1", GitCredential(token="t"), "alice")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700, "nobody but root walks into it"


def test_a_credential_names_a_bounded_number_of_hosts() -> None:
    hosts = [f"h{n}.example" for n in range(MAX_GIT_HOSTS + 1)]
    with pytest.raises(ValidationError, match="at most 64"):
        GitCredential.model_validate({"token": "t", "hosts": hosts})


def test_a_users_credentials_are_bounded_by_their_share(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path, user_share=3 * 7 * 4096)  # 3 of 7 pages each
    big = GitCredential(token="t" * 8000, hosts=tuple(f"h{n}.example" for n in range(64)))
    for n in range(3):
        store.write(f"sbx-a{n}", big, "alice")
    with pytest.raises(AdmissionRefused) as refused:
        store.write("sbx-a9", big, "alice")
    assert refused.value.code == "credentials_share_exceeded"
    assert not (tmp_path / "sbx-a9").exists()
    store.write("sbx-b1", big, "bob")  # other users are unaffected
    store.remove("sbx-a0")
    store.write("sbx-a9", big, "alice")  # a destroy gives the share back
