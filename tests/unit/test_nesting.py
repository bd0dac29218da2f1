"""Nested sandboxes over fakes (issue 44): what a sandbox's own socket may make and reach,
decided from labels; its limits against creates at once; the socket opened and closed with
its sandbox; the parent's subtree destroyed before it. The guest proves it on real Docker and
a real socket (tests/host/test_nested.py)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from slicebox.backends.native.units import RunAs, init_properties, refusal
from slicebox.core import creation
from slicebox.core.nesting import Births, check_deadline, child_request, reaches
from slicebox.core.sandbox import Sandbox
from slicebox.host.identity import Identity
from slicebox.model.api import CreateSandbox
from slicebox.model.audit import AuditEvent, AuditRecord, Caller, journal_fields
from slicebox.model.config import parse_config
from slicebox.model.errors import NotFound, SliceboxError
from slicebox.model.exec import ExecRequest
from slicebox.model.labels import decode
from slicebox.model.nested import NestedConfig, NestedSpec
from slicebox.model.paths import NESTED_ROOT
from slicebox.model.spec import Mount
from tests.fakes.threadside import ThreadSide
from tests.unit.test_inner_sockets import nested_sandbox
from tests.unit.test_native import request
from tests.unit.test_service import ALICE, NOW, ORCH, World

CONFIG = """
[nested]
max_children = 4
max_depth = 2
creates_per_minute = 5
[nested.users.bob]
max_depth = 0
"""
NESTED = NestedSpec(max_children=2, max_depth=2)


class Sockets:
    """The agent's sockets as a record of what was opened and closed."""

    def __init__(self) -> None:
        self.opened: set[str] = set()
        self.events: list[tuple[str, str]] = []
        self.fail = False

    async def open(self, sandbox: Sandbox) -> None:
        if self.fail:
            raise OSError("no room for a socket")
        self.opened.add(sandbox.id)
        self.events.append(("open", sandbox.id))

    async def close(self, sandbox_id: str) -> None:
        self.opened.discard(sandbox_id)
        self.events.append(("close", sandbox_id))


class Nest:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        # Alice and bob have accounts on this "host", whatever the build machine's users.
        monkeypatch.setattr(creation, "user_ids", lambda user: (1000, 1000))
        self.sockets = Sockets()
        self.tmp = tmp
        self.world = World(tmp, config=CONFIG, inner=self.sockets)
        self.side = ThreadSide(self.world.service)

    def parent(self, **fields: Any) -> str:
        body = {"project": "web", "nested": NESTED, "memory": "256MB", **fields}
        return self.side.create(ALICE, CreateSandbox.model_validate(body)).id

    def inner(self, sandbox_id: str) -> Identity:
        return ALICE.model_copy(update={"pid": 99}).within_sandbox(sandbox_id)

    def child(self, within: str, **fields: Any) -> str:
        body = {"project": "web", **fields}
        return self.side.create(self.inner(within), CreateSandbox.model_validate(body)).id

    def labels(self, sandbox_id: str) -> dict[str, str]:
        found = self.world.docker.find({"slicebox.sandbox_id": sandbox_id})
        assert len(found) == 1
        return dict(found[0].labels)


@pytest.fixture
def nest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Nest:
    return Nest(tmp_path, monkeypatch)


def refused_code(call: Any) -> str:
    with pytest.raises(SliceboxError) as refused:
        call()
    return refused.value.code


def test_a_nested_sandbox_s_child_takes_its_lineage_from_the_socket(nest: Nest) -> None:
    parent = nest.parent()
    assert nest.sockets.opened == {parent}, "its socket is made before the create answers"
    child = nest.child(parent, memory="128MB")
    labels = nest.labels(child)
    lineage = decode(labels)
    assert (lineage.parent_id, lineage.depth, lineage.ancestors) == (parent, 1, parent)
    assert lineage.root_task_id == decode(nest.labels(parent)).root_task_id
    assert (lineage.user, lineage.project, lineage.nested) == ("alice", "web", False)
    assert labels["slicebox.ancestors"] == parent
    assert nest.sockets.opened == {parent}, "a child without nesting has no socket"
    created = [e for e in nest.world.journal.entries if e.get("SLICEBOX_SANDBOX_ID") == child]
    assert created[0]["SLICEBOX_EVENT"] == "sandbox_created"
    assert created[0]["SLICEBOX_CALLER_SANDBOX"] == parent


def test_a_child_left_without_limits_gets_its_parent_s_never_more(nest: Nest) -> None:
    parent = nest.parent(cpus=0.5, pids=64)
    child = decode(nest.labels(nest.child(parent)))
    assert (child.provisioned_memory_bytes, child.provisioned_cpu, child.provisioned_pids) == (
        256 << 20,
        0.5,
        64,
    )
    assert child.expires_at is not None
    assert child.expires_at <= decode(nest.labels(parent)).expires_at  # type: ignore[operator]


@pytest.mark.parametrize(
    "fields",
    [
        {"memory": "1GB"},
        {"cpus": 2},
        {"pids": 100000},
        {"network": "bridge"},
        {"network": {"egress": {"allow": ["pkgs.example"]}}},
        {"project": "elsewhere"},
        {"user": "bob"},
        {"parent_id": "sbx-000000000999"},
        {"root_task_id": "another"},
        {"backend": "native"},
        {"ttl_seconds": 10**6},
        {"workspace": {"kind": "volume", "name": "theirs"}},
        {"workspace": {"kind": "host", "path": "/srv/x"}},
        {"mounts": [{"source": "/etc", "target": "/x"}]},
        {"cap_add": ["NET_RAW"]},
        {"privileged": True},
        {"nested": {"max_children": 3, "max_depth": 1}},
        {"nested": {"max_children": 1, "max_depth": 2}},
    ],
)
def test_a_child_wider_than_its_parent_is_refused_before_anything_is_made(
    nest: Nest, fields: dict[str, Any]
) -> None:
    parent = nest.parent()
    before = {s.id for s in nest.world.sandboxes.find()}
    assert refused_code(lambda: nest.child(parent, **fields)) == "policy_nested"
    assert {s.id for s in nest.world.sandboxes.find()} == before


def test_depth_ends_where_the_parent_says(nest: Nest) -> None:
    parent = nest.parent()
    middle = nest.child(parent, nested={"max_children": 1, "max_depth": 1})
    assert nest.sockets.opened == {parent, middle}
    leaf = nest.child(middle)
    assert decode(nest.labels(leaf)).ancestors == f"{parent},{middle}"
    assert decode(nest.labels(leaf)).depth == 2
    code = refused_code(lambda: nest.child(middle, nested={"max_children": 1}))
    assert code == "policy_nested"


def test_the_socket_reaches_its_subtree_only(nest: Nest) -> None:
    parent = nest.parent()
    sibling = nest.world.create(ALICE)
    other = nest.world.create(ORCH, user="bob")
    child = nest.child(parent)
    grandparent_view = nest.inner(child)
    me = nest.inner(parent)
    assert [v.id for v in nest.side.list_sandboxes(me)] == [child]
    for target in (parent, sibling, other):
        with pytest.raises(NotFound):
            nest.side.get(me, target)
        with pytest.raises(NotFound):
            nest.side.exec(me, target, ExecRequest(argv=("true",)))
        assert nest.side.destroy(me, target).destroyed is False
    with pytest.raises(NotFound):
        nest.side.get(grandparent_view, parent)
    assert nest.side.exec(me, child, ExecRequest(argv=("echo", "hi"))).stdout == b"hi\n"


def test_max_children_holds_against_creates_at_once(nest: Nest) -> None:
    parent = nest.parent()
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def one() -> None:
        barrier.wait()
        try:
            nest.child(parent)
            outcomes.append("made")
        except SliceboxError as exc:
            outcomes.append(exc.code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["made", "made", "nested_limit", "nested_limit"]
    assert len(nest.world.sandboxes.find(parent_id=parent)) == 2


def test_creates_per_minute_are_counted_per_parent() -> None:
    now = [0.0]
    births = Births(lambda: now[0])
    parent = nested_sandbox(max_children=100)
    for _ in range(3):
        with births.taking(parent, 0, 3):
            pass
    with pytest.raises(SliceboxError) as refused:
        births.taking(parent, 0, 3).__enter__()
    assert refused.value.code == "nested_limit"
    assert refused.value.retry_after == 60
    now[0] = 61.0
    with births.taking(parent, 0, 3):
        pass


def test_the_opt_in_is_bounded_by_the_config_per_user(nest: Nest) -> None:
    assert refused_code(lambda: nest.parent(nested={"max_children": 5})) == "policy_nested"
    too_deep = {"max_children": 1, "max_depth": 3}
    assert refused_code(lambda: nest.parent(nested=too_deep)) == "policy_nested"
    bob = CreateSandbox(project="web", nested=NESTED)
    bobs = ALICE.model_copy(update={"user_name": "bob"})
    assert refused_code(lambda: nest.side.create(bobs, bob)) == "policy_nested"
    assert NestedConfig(users={"bob": {"max_depth": 0}}).bound("bob", "x").max_depth == 0


def test_a_user_without_an_account_cannot_be_nested(
    nest: Nest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(creation, "user_ids", lambda user: None)
    assert refused_code(nest.parent) == "policy_nested"


def test_a_socket_that_cannot_be_made_leaves_no_sandbox(nest: Nest) -> None:
    nest.sockets.fail = True
    with pytest.raises(OSError, match="no room"):
        nest.parent()
    assert nest.world.sandboxes.find() == []


def test_destroying_a_parent_takes_its_subtree_deepest_first(nest: Nest) -> None:
    parent = nest.parent()
    middle = nest.child(parent, nested={"max_children": 1, "max_depth": 1})
    leaf = nest.child(middle)
    nest.world.journal.entries.clear()
    assert nest.side.destroy(ALICE, parent).destroyed
    order = [
        e["SLICEBOX_SANDBOX_ID"]
        for e in nest.world.journal.entries
        if e["SLICEBOX_EVENT"] == "sandbox_destroyed"
    ]
    assert order == [leaf, middle, parent]
    assert nest.world.sandboxes.find() == []
    assert ("close", middle) in nest.sockets.events
    assert ("close", parent) in nest.sockets.events
    assert not (nest.world.sandboxes._creator._nested_root / parent).exists()


def test_an_extend_from_inside_never_passes_the_parent_s_deadline() -> None:
    deadline = NOW + timedelta(hours=1)
    check_deadline(deadline - timedelta(seconds=1), deadline)
    with pytest.raises(SliceboxError) as refused:
        check_deadline(deadline + timedelta(seconds=1), deadline)
    assert refused.value.code == "policy_nested"
    check_deadline(datetime.max.replace(tzinfo=UTC), None)


def test_a_host_caller_reaches_all_its_user_s_sandboxes_and_a_nested_one_its_subtree() -> None:
    child = nested_sandbox(ancestors="sbx-a,sbx-b")
    assert reaches(ALICE, child)
    assert reaches(ALICE.within_sandbox("sbx-a"), child)
    assert reaches(ALICE.within_sandbox("sbx-b"), child)
    assert not reaches(ALICE.within_sandbox("sbx-c"), child)
    assert not ORCH.within_sandbox("sbx-a").is_admin, "a sandbox's request is never an admin's"


def test_the_audit_names_the_calling_sandbox() -> None:
    caller = Caller(uid=1000, gid=1000, pid=7, sandbox="sbx-a")
    fields = journal_fields(AuditRecord(event=AuditEvent.SANDBOX_CREATED, caller=caller))
    assert fields["SLICEBOX_CALLER_SANDBOX"] == "sbx-a"


def test_child_request_uses_the_parent_s_current_deadline() -> None:
    parent = nested_sandbox()
    soon = NOW + timedelta(seconds=90)
    request = CreateSandbox(project="web")
    made = child_request(request, parent, soon, parse_config(""), NOW)
    assert made.ttl_seconds == 90
    gone = NOW - timedelta(seconds=1)
    with pytest.raises(SliceboxError):
        child_request(request, parent, gone, parse_config(""), NOW)


def test_a_native_nested_sandbox_sees_its_own_socket_directory_and_no_other() -> None:
    own = str(NESTED_ROOT / "sbx-000000000001")
    asked = request(mounts=(Mount(source=own, target=own, read_only=True),))
    assert refusal(asked) is None
    props = init_properties(asked, "x.slice", RunAs(), Path("/env"), Path("/run/i"))
    assert props["TemporaryFileSystem"] == [(str(NESTED_ROOT), "ro")]
    assert props["BindReadOnlyPaths"] == [(own, own, False, 16384)]
    elsewhere = request(mounts=(Mount(source=own, target="/run/slicebox", read_only=True),))
    assert refusal(elsewhere) is not None, "only at its own path"
    writable = request(mounts=(Mount(source=own, target=own),))
    assert refusal(writable) is not None
