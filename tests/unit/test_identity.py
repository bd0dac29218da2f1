from __future__ import annotations

import os
import socket

import pytest

from slicebox.host.identity import PeerCredentials, SystemUsers, peer_credentials, resolve
from slicebox.model.errors import Forbidden


class Users:
    def __init__(self, names: dict[int, str], groups: dict[str, frozenset[str]]) -> None:
        self.names = names
        self.groups = groups

    def user_name(self, uid: int) -> str | None:
        return self.names.get(uid)

    def groups_of(self, user: str) -> tuple[int, frozenset[str]]:
        return 100, self.groups.get(user, frozenset())


USERS = Users(
    {0: "root", 1000: "alice", 1001: "bob", 1002: "orch"},
    {
        "alice": frozenset({"alice", "slicebox"}),
        "bob": frozenset({"bob", "slicebox"}),
        "orch": frozenset({"slicebox-admin"}),
    },
)


def creds(uid: int) -> PeerCredentials:
    return PeerCredentials(pid=os.getpid(), uid=uid, gid=uid)


def test_kernel_credentials_of_a_unix_socket_peer() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        got = peer_credentials(left)
    assert (got.pid, got.uid, got.gid) == (os.getpid(), os.getuid(), os.getgid())


def test_own_user_by_default_and_not_another() -> None:
    alice = resolve(creds(1000), USERS)
    assert alice.acting_user(None) == "alice"
    assert alice.acting_user("alice") == "alice"
    assert not alice.is_admin
    with pytest.raises(Forbidden, match="slicebox-admin"):
        alice.acting_user("bob")
    assert alice.may_see("alice")
    assert not alice.may_see("bob")


@pytest.mark.parametrize("uid", [0, 1002])
def test_root_and_admin_group_act_for_anyone(uid: int) -> None:
    admin = resolve(creds(uid), USERS)
    assert admin.is_admin
    assert admin.acting_user("bob") == "bob"
    assert admin.may_see("carol")


def test_an_unknown_uid_is_refused() -> None:
    with pytest.raises(Forbidden) as refused:
        resolve(creds(4242), USERS)
    assert refused.value.code == "unknown_user"


def test_caller_comm_is_read_from_proc() -> None:
    me = resolve(creds(1000), USERS)
    assert me.comm
    assert me.caller.pid == os.getpid()


def test_system_users_resolves_root() -> None:
    users = SystemUsers()
    assert users.user_name(0) == "root"
    assert users.groups_of("root") == (0, users.groups_of("root")[1])
    assert "root" in users.groups_of("root")[1]
    assert users.groups_of("no-such-user-here") == (-1, frozenset())
