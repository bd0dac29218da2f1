"""Nested sandboxes through the installed agent (issue 44): a sandbox that opted in runs the
slicebox client and CLI inside (tests/host/nesteddriver.py, in an image of the guest's own
python and the checkout: tests/host/nestedimage.py) and makes children on its own socket,
whose lineage the agent takes from which socket accepted the request. What that socket
reaches is its subtree and nothing else (a snapshot of another sandbox of its user's and a
paused sibling or parent included); its limits are refused with codes; the children's
memory sums under the project's ceiling; a path to it learned by anyone else leads nowhere;
a ``kill -9`` of the agent re-makes it; destroying the parent takes the subtree.

One agent, one parent ``P`` of user ``sbxnest`` (2 children, 2 levels), its children ``C1`` (itself
nested, 1 child, 1 level) and ``C2``, ``C1``'s child ``G``; beside them ``S`` (``sbxnest``'s, same
project, not nested, sharing a volume with ``P``) and ``Q`` (another user's). The tests run in
order on that one tree."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from slicebox.model.api import CreateSandbox
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecRequest
from slicebox.model.names import slice_names
from slicebox.model.paths import NESTED_ROOT
from tests.host import nestedimage
from tests.host.agentunits import admin, agent_config, installed_agent, prop
from tests.host.helpers import (
    CGROUP_ROOT,
    journal_records,
    memory_events,
    ordinary_user,
    sh,
    wait_for,
)
from tests.host.test_snapshots import ask

pytestmark = pytest.mark.host

USER, OTHER = "sbxnest", "sbxnestother"
PROJECT = "nest"
DRIVER = (Path(__file__).parent / "nesteddriver.py").read_bytes()
CONFIG = agent_config() + (
    f'[nested]\nmax_children = 4\nmax_depth = 2\n[projects."{USER}/{PROJECT}"]\nmemory = "320MB"\n'
)
LOCAL = "memory.events.local"  # the cgroup's own events: its own limit was what was reached
HOLD = "import time; b = b'x' * ({mib} << 20); open('/tmp/held', 'w').write('1'); time.sleep(900)"


def inside(sandbox_id: str, *steps: list[Any]) -> list[dict[str, Any]]:
    """The driver's answers to ``steps``, run in the sandbox through the agent (as root on
    the host asks: the sandbox's own socket is what the driver uses inside)."""
    request = ExecRequest(argv=("python3", "-", json.dumps(steps)), stdin=DRIVER, timeout=600)
    ran = admin().exec(sandbox_id, request)
    assert ran.exit_code == 0, ran.stderr.decode(errors="replace")
    answers: list[dict[str, Any]] = json.loads(ran.stdout)
    return answers


def ok(answer: dict[str, Any]) -> Any:
    assert "ok" in answer, answer
    return answer["ok"]


def labels(sandbox_id: str) -> dict[str, str]:
    out = sh("docker", "inspect", "-f", "{{json .Config.Labels}}", sandbox_id).stdout
    found: dict[str, str] = json.loads(out)
    return found


def running(sandbox_id: str) -> bool:
    return sh("docker", "inspect", sandbox_id, check=False).returncode == 0


@pytest.fixture(scope="module")
def tree() -> Iterator[dict[str, str]]:
    with installed_agent(CONFIG, start_limit=False), ordinary_user(USER), ordinary_user(OTHER):
        sh("systemctl", "start", "slicebox.socket")
        image = nestedimage.build()
        client = admin()
        made: dict[str, str] = {"image": image}
        try:
            shared = {"kind": "volume", "name": "shared"}
            made["P"] = client.create(
                CreateSandbox(
                    user=USER,
                    project=PROJECT,
                    image=image,
                    memory="200MB",
                    nested={"max_children": 2, "max_depth": 2},
                    workspace=shared,
                )
            ).id
            made["S"] = client.create(
                CreateSandbox(user=USER, project=PROJECT, image=image, workspace=shared)
            ).id
            made["Q"] = client.create(CreateSandbox(user=OTHER, project="other")).id
            yield made
        finally:
            for sandbox in client.list_sandboxes():
                if sandbox.user in (USER, OTHER):
                    with contextlib.suppress(SliceboxError):
                        client.destroy(sandbox.id)
            sh("docker", "volume", "rm", f"slicebox-{USER}-shared", check=False)
            nestedimage.remove()


def test_a_nested_sandbox_makes_children_and_acts_on_them_with_the_client_and_cli(
    tree: dict[str, str],
) -> None:
    p, image = tree["P"], tree["image"]
    first = inside(
        p,
        ["env", "SLICEBOX_SOCKET"],
        ["cli", ["create", "--image", image, "--memory", "100MB", "--nested", "1:1"]],
        ["create", {"image": image, "memory": "100MB"}],
    )
    assert ok(first[0]) == "/run/slicebox/slicebox.sock"
    made = ok(first[1])
    assert made["rc"] == 0, made["stderr"]
    c1, c2 = made["stdout"], ok(first[2])
    tree.update(C1=c1, C2=c2)
    answers = inside(
        p,
        ["exec", c1, ["echo", "hello from c1"]],
        ["exec", c2, ["sh", "-c", "echo hello from c2"]],
        ["usage", c1],
        ["list"],
        ["cli", ["--json", "ps"]],
    )
    assert ok(answers[0]) == {"exit_code": 0, "stdout": "hello from c1\n"}
    assert ok(answers[1]) == {"exit_code": 0, "stdout": "hello from c2\n"}
    assert ok(answers[2])["memory_bytes"]["project"] > 0
    assert ok(answers[3]) == sorted([c1, c2]), "its subtree: neither itself nor its sibling"
    listed = ok(answers[4])
    assert listed["rc"] == 0
    assert {s["id"] for s in json.loads(listed["stdout"])} == {c1, c2}
    parent = labels(p)
    for child in (c1, c2):
        found = labels(child)
        assert found["slicebox.parent_id"] == p
        assert found["slicebox.root_task_id"] == parent["slicebox.root_task_id"]
        assert (found["slicebox.depth"], found["slicebox.ancestors"]) == ("1", p)
        assert (found["slicebox.user"], found["slicebox.project"]) == (USER, PROJECT)
    assert labels(c1)["slicebox.nested"] == "true"
    assert labels(c2)["slicebox.nested"] == "false"
    created = journal_records(SLICEBOX_EVENT="sandbox_created", SLICEBOX_SANDBOX_ID=c1)
    assert created
    assert created[-1]["SLICEBOX_CALLER_SANDBOX"] == p
    assert created[-1]["SLICEBOX_USER"] == USER


def test_the_inner_socket_reaches_its_subtree_and_nothing_else(tree: dict[str, str]) -> None:
    p, c1, c2, s, q = (tree[k] for k in ("P", "C1", "C2", "S", "Q"))
    acts: list[list[Any]] = [["exec", ["true"]], ["usage"], ["destroy"], ["extend", 60]]
    touch = [[act[0], target, *act[1:]] for target in (p, c2, s, q) for act in acts]
    answers = inside(c1, ["list"], *touch, ["tree"], ["capacity"], ["pools"], ["reap"])
    assert ok(answers[0]) == [], "no children yet; not its parent, sibling or cousin"
    for answer, step in zip(answers[1:-4], touch, strict=True):
        if step[0] == "destroy":
            assert ok(answer) is False, f"{step}: destroyed nothing"
        else:
            assert answer.get("code") == "not_found", f"{step}: {answer}"
    assert [a.get("code") for a in answers[-4:]] == ["nested_refused"] * 4
    for target in (p, c2, s, q):
        assert running(target), f"{target} untouched"
    # Many connections at once: the socket's own cap answers the one past it, and the host's
    # socket is answered meanwhile.
    flood = inside(c1, ["flood", "/run/slicebox/slicebox.sock", 16])
    over, after = ok(flood[0])
    assert over.startswith("HTTP/1.1 429"), over
    assert after.startswith("HTTP/1.1 200"), after
    assert admin().health().status == "ok"


def test_no_snapshot_outside_its_subtree_is_forked_and_no_paused_neighbour_is_told(
    tree: dict[str, str],
) -> None:
    """Issue 59: a child forked from a snapshot only of the asking sandbox's own subtree; a
    snapshot of its user's other sandbox is ``not_found`` as a missing one, and nothing is
    made. An exec on a paused sandbox it does not reach (a sibling of its user's, its own
    parent) is ``not_found`` as for one that does not exist, never ``sandbox_paused``."""
    p, c1 = tree["P"], tree["C1"]
    other = ask(USER, "POST", "/sandboxes", {"project": "nestx"})  # USER's, outside P's tree
    x = str(other["id"])
    try:
        taken = ask(USER, "POST", f"/sandboxes/{x}/snapshots", {"name": "outside"})
        assert taken.get("name") == "outside", taken
        for paused in (x, p):
            assert ask(USER, "POST", f"/sandboxes/{paused}/pause").get("paused") is True
        before = {v.id for v in admin().list_sandboxes()}
        answers = inside(
            c1,
            ["exec", x, ["true"]],
            ["exec", p, ["true"]],
            ["exec", "sbx-0000000fffff", ["true"]],
            ["create", {"from_snapshot": "outside"}],
            ["create", {"from_snapshot": "missing"}],
        )
        assert [a.get("code") for a in answers] == ["not_found"] * 5, answers
        assert answers[3]["message"] == answers[4]["message"].replace("missing", "outside")
        assert {v.id for v in admin().list_sandboxes()} == before, "nothing made"
    finally:
        for paused in (x, p):
            ask(USER, "POST", f"/sandboxes/{paused}/resume")
        ask(USER, "DELETE", "/snapshots/outside")
        admin().destroy(x)


def test_depth_count_and_width_are_refused_with_codes_before_anything_is_made(
    tree: dict[str, str],
) -> None:
    p, c1, image = tree["P"], tree["C1"], tree["image"]
    before = {v.id for v in admin().list_sandboxes()}
    at_c1 = inside(
        c1,
        ["create", {"image": image, "nested": {"max_children": 1}}],
        ["create", {"image": image, "memory": "150MB"}],
        ["create", {"image": image, "network": "bridge"}],
        ["create", {"image": image, "project": "elsewhere"}],
        ["create", {"image": image, "ttl_seconds": 10**6}],
        ["create", {"image": image, "workspace": {"kind": "volume", "name": "other"}}],
        ["create", {"image": image, "cap_add": ["NET_RAW"]}],
        ["create", {"image": image, "memory": "50MB"}],
        ["create", {"image": image, "memory": "50MB"}],
    )
    assert [a.get("code") for a in at_c1[:7]] == ["policy_nested"] * 7, at_c1
    assert "1 level(s) below it" in at_c1[0]["message"]
    grandchild = ok(at_c1[7])
    assert at_c1[8]["code"] == "nested_limit", "C1 may have one child alive"
    tree["G"] = grandchild
    assert labels(grandchild)["slicebox.ancestors"] == f"{p},{c1}"
    assert labels(grandchild)["slicebox.depth"] == "2"
    at_p = inside(p, ["create", {"image": image}], ["list"])
    assert at_p[0]["code"] == "nested_limit", "P has its two children"
    assert ok(at_p[1]) == sorted([c1, tree["C2"], grandchild]), "its whole subtree"
    client = admin()
    over = (
        ({"max_children": 5}, "max_children"),
        ({"max_children": 1, "max_depth": 3}, "max_depth"),
    )
    for nested, field in over:
        with pytest.raises(SliceboxError) as refused:
            client.create(CreateSandbox(user=USER, project=PROJECT, image=image, nested=nested))
        assert (refused.value.code, refused.value.field) == ("policy_nested", f"nested.{field}")
    wasm = {"sha256": "0" * 64}
    with pytest.raises(SliceboxError) as unsupported:
        client.create(
            CreateSandbox(
                user=USER, project="n", backend="wasm", wasm=wasm, nested={"max_children": 1}
            )
        )
    assert unsupported.value.code == "backend_unsupported"
    assert {v.id for v in admin().list_sandboxes()} == before | {grandchild}


def test_a_sandbox_without_nesting_has_no_socket_and_a_learned_path_leads_nowhere(
    tree: dict[str, str],
) -> None:
    p, s = tree["P"], tree["S"]
    bare = admin().exec(s, ExecRequest(argv=("ls", "/run/slicebox"), timeout=60))
    assert bare.exit_code != 0, "no socket directory in a sandbox without nesting"
    # P leaves a link to its socket in the volume it shares with S: in S it names nothing.
    linked = admin().exec(
        p, ExecRequest(argv=("ln", "-sf", "/run/slicebox/slicebox.sock", "/workspace/sock"))
    )
    assert linked.exit_code == 0
    through = inside(s, ["raw", "/workspace/sock"], ["raw", f"{NESTED_ROOT}/{p}/slicebox.sock"])
    assert [ok(a) for a in through] == ["FileNotFoundError", "FileNotFoundError"]
    # On the host the path is there, and anyone may open it: the kernel says who is calling,
    # and no process outside P's cgroup is served, its user's own, nobody's or root's.
    path = f"{NESTED_ROOT}/{p}/slicebox.sock"
    curl = ("curl", "-s", "-m", "30", "--unix-socket", path, "http://x/v1/sandboxes")
    for user in (USER, OTHER, "nobody", "root"):
        answer = sh("runuser", "-u", user, "--", *curl, check=False).stdout
        assert json.loads(answer)["code"] == "nested_refused", (user, answer)


def test_the_agent_killed_re_makes_the_socket_and_the_reaper_keeps_the_tree(
    tree: dict[str, str],
) -> None:
    p, c1 = tree["P"], tree["C1"]
    pid = prop("slicebox.service", "MainPID")
    sh("systemctl", "kill", "--signal=SIGKILL", "slicebox.service")
    wait_for(lambda: prop("slicebox.service", "MainPID") not in ("0", pid), timeout=120)
    wait_for(lambda: prop("slicebox.service", "ActiveState") == "active", timeout=180)
    assert admin().health().status == "ok"
    again = inside(p, ["exec", c1, ["echo", "back"]], ["list"])
    assert ok(again[0]) == {"exit_code": 0, "stdout": "back\n"}
    assert ok(again[1]) == sorted([c1, tree["C2"], tree["G"]])
    report = admin().reap()
    touched = {action.sandbox_id for action in report.plan}
    assert not touched & {p, c1, tree["C2"], tree["G"]}, report.plan
    assert all(running(tree[k]) for k in ("P", "C1", "C2", "G"))


def test_the_children_s_memory_sums_under_the_project_s_ceiling(tree: dict[str, str]) -> None:
    """Each within its own limit, together past the project's 320 MB: a hog child makes the
    kernel kill in the project, and another user's project is untouched."""
    project = Path(slice_names(USER, PROJECT).cgroups(PurePosixPath(CGROUP_ROOT)).project)
    other = Path(slice_names(OTHER, "other").cgroups(PurePosixPath(CGROUP_ROOT)).project)
    before = memory_events(project)["oom_kill"], memory_events(project, LOCAL)["oom"]
    # Each well within its own limit (P 200 MB, C1 and C2 100 MB, G 50 MB), so that what the
    # kernel meets is the project's 320 MB: about 250 MB held, then C2 asks 70 more.
    for name, mib in (("P", 150), ("C1", 70), ("G", 30)):
        code = HOLD.format(mib=mib)
        holder = admin().exec(
            tree[name],
            ExecRequest(argv=("sh", "-c", f'python3 -c "{code}" >/dev/null 2>&1 &'), timeout=60),
        )
        assert holder.exit_code == 0
    time.sleep(1)
    hog = admin().exec(  # within its own 100 MB, past the project's 320 MB with the rest
        tree["C2"], ExecRequest(argv=("python3", "-c", "b = b'x' * (70 << 20)"), timeout=300)
    )
    assert memory_events(project)["oom_kill"] > before[0], hog
    assert memory_events(project, LOCAL)["oom"] > before[1], "the project's own ceiling was hit"
    assert memory_events(other)["oom_kill"] == 0
    assert admin().exec(tree["Q"], ExecRequest(argv=("true",))).exit_code == 0


def _events(path: Path) -> dict[str, int]:
    return {
        key: int(value) for key, value in (line.split() for line in path.read_text().splitlines())
    }


def test_destroying_the_parent_removes_its_subtree_and_its_sockets(tree: dict[str, str]) -> None:
    p = tree["P"]
    subtree = [tree[k] for k in ("C1", "C2", "G")]
    assert Path(f"{NESTED_ROOT}/{tree['C1']}/slicebox.sock").exists()
    gone = admin().destroy(p)
    assert gone.destroyed
    for sandbox_id in (p, *subtree):
        assert not running(sandbox_id), f"{sandbox_id} is left"
        assert not Path(f"{NESTED_ROOT}/{sandbox_id}").exists()
    assert running(tree["S"])
    assert running(tree["Q"])
    destroyed = journal_records(SLICEBOX_EVENT="sandbox_destroyed", SLICEBOX_SANDBOX_ID=tree["G"])
    assert destroyed, "each child's removal audited"


def test_a_native_sandbox_is_nested_too(tree: dict[str, str]) -> None:
    """The host's own python and CLI in a native sandbox: its socket at its own path, the one
    socket directory it sees; its child native as it is."""
    client = admin()
    spec = {"user": USER, "project": "nnest", "backend": "native", "nested": {"max_children": 1}}
    parent = client.create(CreateSandbox.model_validate(spec)).id
    try:
        first = inside(parent, ["env", "SLICEBOX_SOCKET"], ["cli", ["create"]])
        assert ok(first[0]) == f"{NESTED_ROOT}/{parent}/slicebox.sock"
        made = ok(first[1])
        assert made["rc"] == 0, made["stderr"]
        child = made["stdout"]
        seen = admin().exec(parent, ExecRequest(argv=("ls", str(NESTED_ROOT)), timeout=60))
        assert seen.stdout.split() == [parent.encode()], "no other sandbox's socket directory"
        answers = inside(parent, ["exec", child, ["echo", "native child"]], ["list"])
        assert ok(answers[0]) == {"exit_code": 0, "stdout": "native child\n"}
        assert ok(answers[1]) == [child]
        view = client.get(child)
        assert (view.parent_id, view.backend, view.depth) == (parent, "native", 1)
    finally:
        client.destroy(parent)
    assert child not in {v.id for v in client.list_sandboxes()}, "its subtree went with it"
