"""The native backend on a real host (issues 16 and 43): a sandbox that systemd isolates, in
the same slice tree, under the same ceilings, through the agent's own create path, and one
machine: every exec a fork of its init, in the sandbox's one process space.

One native sandbox (128 MB, 64 pids) serves most of the module: each exec's processes are a
scope in its slice, so each test also checks that nothing of its execs is left in the slice
but the sandbox's anchor (its init). The fallback test stops the guest's Docker for real; the
last tests run the installed agent (one kills it with ``kill -9`` while native sandboxes run).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from slicebox.backends.docker import DockerBackend
from slicebox.backends.native.backend import NativeBackend
from slicebox.backends.native.names import ANCHOR_PREFIX, EXEC_PREFIX, slice_cgroup
from slicebox.backends.native.units import hardening
from slicebox.backends.router import Backends
from slicebox.client import Client
from slicebox.core.blocking import Blocking, from_thread
from slicebox.core.deadlines import Deadlines
from slicebox.core.execution import ExecEngine
from slicebox.core.sandbox import Sandbox
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.service import Service
from slicebox.core.slices import SliceManager
from slicebox.core.telemetry import MemoryIntegrator, TreeReader, UsageReader
from slicebox.host.cgroupfs import CgroupFS
from slicebox.host.identity import Identity
from slicebox.host.journal import Auditor
from slicebox.host.procs import CgroupHost
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.config import parse_config, read_host_memory
from slicebox.model.errors import HostError, InvalidRequest, SandboxNotRunning, Unavailable
from slicebox.model.exec import ExecRequest, ExecResult
from slicebox.model.names import MANAGED_SLICE, slice_names
from slicebox.model.paths import CGROUP_ROOT as PURE_ROOT
from slicebox.model.spec import SandboxSpec
from slicebox.server.runtime import decode_unit
from tests.fakes.journal import ListJournal
from tests.fakes.threadside import ThreadSide, created
from tests.host.agentunits import SOCKET, agent_config, installed_agent
from tests.host.helpers import CGROUP_ROOT, journal_records, sh, unique, wait_for
from tests.host.sliceboxhost import active, cleanup_slices, reap_empty_slices, slicebox_units
from tests.host.test_engines import doctor_checks

pytestmark = pytest.mark.host

MB = 1024 * 1024


class Native:
    """The agent's parts over the real host with both backends, as ``server.runtime``."""

    def __init__(self, config: str = "") -> None:
        systemd = PystemdSystemd()
        self.user = unique("nat-")
        self.docker = DockerBackend.from_env()
        self.backends = Backends(self.docker, NativeBackend(systemd))
        self.engine = ExecEngine(self.backends, CgroupHost())
        self.manager = SandboxManager(
            self.backends,
            SliceManager(systemd),
            config=parse_config(config),
            host_memory=read_host_memory(),
            instance_id=unique("test-"),
            deadlines=Deadlines(systemd),
        )
        self.journal = ListJournal()
        self.service = Service(
            self.manager,
            self.engine,
            usage=UsageReader(CgroupFS(), integrator=MemoryIntegrator(time.monotonic)),
            tree=TreeReader(CgroupFS(), decode=decode_unit),
            auditor=Auditor(self.journal),
            pid_of=lambda sandbox: None,
        )
        self.who = Identity(uid=0, gid=0, pid=os.getpid(), user_name=self.user, is_admin=False)

    def spec(self, project: str, **fields: object) -> SandboxSpec:
        base = {"user": self.user, "project": project, "backend": "native"}
        return SandboxSpec.model_validate(base | fields)

    def run(self, sandbox: Sandbox, **fields: object) -> ExecResult:
        request = ExecRequest.parse(fields)
        return self.engine.run(sandbox.container_id, request, sandbox.running_scope())

    def cleanup(self) -> None:
        for leftover in self.manager.find(user=self.user):
            self.manager.destroy(leftover.id)
        reap_empty_slices(self.manager, self.user)
        cleanup_slices(*slicebox_units(slice_names(self.user, "x").user[:-6] + "*"))


def slice_dir(sandbox: Sandbox) -> Path:
    return CGROUP_ROOT / str(sandbox.scope_cgroup()).removeprefix(str(PURE_ROOT)).lstrip("/")


def processes(directory: Path) -> dict[str, list[int]]:
    """Every process below ``directory``, by the unit (cgroup) it is in."""
    found: dict[str, list[int]] = {}
    for procs in directory.rglob("cgroup.procs"):
        pids = [int(pid) for pid in procs.read_text().split()]
        if pids:
            found[procs.parent.name] = pids
    return found


def only_the_anchor(sandbox: Sandbox) -> bool:
    """Nothing runs in the sandbox but its init (the anchor's one process)."""
    units = processes(slice_dir(sandbox))
    return (
        list(units) == [f"{ANCHOR_PREFIX}{sandbox.id}.service"]
        and len(units[f"{ANCHOR_PREFIX}{sandbox.id}.service"]) == 1
    )


@pytest.fixture(scope="module")
def native() -> Iterator[Native]:
    managed_was_active = active(MANAGED_SLICE)
    made = Native()
    yield made
    made.cleanup()
    if not managed_was_active:
        cleanup_slices(MANAGED_SLICE)


@pytest.fixture(scope="module")
def box(native: Native) -> Iterator[Sandbox]:
    made = created(native.manager, native.spec("shared", memory="128MB", pids=64, cpus=1))
    try:
        yield made
    finally:
        assert native.manager.destroy(made.id) is not None


@pytest.fixture
def clean_box(box: Sandbox) -> Iterator[Sandbox]:
    """The test's execs leave nothing in the sandbox's slice but its anchor."""
    yield box
    wait_for(lambda: only_the_anchor(box), timeout=30, step=0.2)


def test_a_native_sandbox_is_a_slice_of_its_project_with_its_limits(
    native: Native, box: Sandbox
) -> None:
    assert box.backend == "native"
    directory = slice_dir(box)
    project = CGROUP_ROOT / MANAGED_SLICE / slice_names(native.user, "shared").user
    assert directory.parent == project / slice_names(native.user, "shared").project
    assert (directory / "memory.max").read_text().strip() == str(128 * MB)
    assert (directory / "memory.swap.max").read_text().strip() == "0"
    assert (directory / "pids.max").read_text().strip() == "64"
    assert (directory / "cpu.max").read_text().split()[0] == "100000"
    assert only_the_anchor(box)
    # Lineage lives in systemd: the listing finds it with its labels, by any of them.
    [found] = native.manager.find(user=native.user, project="shared")
    assert found.id == box.id
    assert found.lineage.root_task_id == box.id
    assert native.manager.get(box.id).container_id == box.container_id


def test_an_exec_runs_as_the_sandbox_s_own_user_in_its_workspace(
    native: Native, clean_box: Sandbox
) -> None:
    who = native.run(clean_box, argv=["id", "-u"])
    uid = int(who.stdout)
    assert uid not in (0, os.getuid())
    assert 61184 <= uid <= 65519, "a dynamic user's range"
    wrote = native.run(clean_box, argv="pwd; echo kept > note; echo tmp > /tmp/t", shell=True)
    assert wrote.exit_code == 0
    assert wrote.stdout == b"/workspace\n"
    read = native.run(clean_box, argv="cat note /tmp/t; stat -c %u note", shell=True)
    assert read.stdout == f"kept\ntmp\n{uid}\n".encode(), "the workspace and /tmp persist"
    env = native.run(clean_box, argv=["sh", "-c", 'echo "$A|$HOME"'], env={"A": 'x "y" $z'})
    assert env.stdout == b'x "y" $z|/workspace\n'


def test_the_host_is_read_only_and_its_secrets_unreadable(
    native: Native, clean_box: Sandbox
) -> None:
    shadow = native.run(clean_box, argv=["cat", "/etc/shadow"])
    assert shadow.exit_code != 0
    assert b"Permission denied" in shadow.stderr
    for path in ("/etc/slicebox-x", "/usr/slicebox-x", "/var/lib/slicebox-x", "/srv/x"):
        wrote = native.run(clean_box, argv=["touch", path])
        assert wrote.exit_code != 0, path
        assert not Path(path).exists(), path
    home = native.run(clean_box, argv=["ls", "/root"])
    assert home.exit_code != 0


def test_a_native_sandbox_has_its_own_loopback_and_no_other_network(
    native: Native, clean_box: Sandbox
) -> None:
    code = (
        "import socket\n"
        "try:\n"
        "    socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM)\n"
        "except OSError as e:\n"
        "    print('netlink refused', e.errno)\n"
        "server = socket.create_server(('127.0.0.1', 0))\n"
        "client = socket.create_connection(server.getsockname())\n"
        "print('loopback', server.accept()[0].send(b'x'), client.recv(1))\n"
        "for where in (('10.0.2.2', 22), ('1.1.1.1', 53)):\n"
        "    try:\n"
        "        socket.create_connection(where, timeout=2)\n"
        "        print('reached', where)\n"
        "    except OSError as e:\n"
        "        print('unreachable', e.errno)\n"
    )
    result = native.run(clean_box, argv=["python3", "-c", code])
    assert result.stdout == (
        b"netlink refused 97\nloopback 1 b'x'\nunreachable 101\nunreachable 101\n"
    ), result


def test_a_fork_bomb_is_held_by_the_sandbox_s_tasks_max(native: Native, clean_box: Sandbox) -> None:
    before = _events(slice_dir(clean_box) / "pids.events").get("max", 0)
    # The shell becomes sleep (no fork, which the bomb leaves none of): it runs to the timeout,
    # whose stop of the exec's scope takes the bomb. A shell that ended first would leave the
    # bomb in the background, where what an exec starts lives on.
    bomb = "b() { b | b & }; b; exec sleep 30"
    result = native.run(clean_box, argv=bomb, shell=True, timeout=4)
    assert result.timed_out
    assert result.exit_code == 124
    assert _events(slice_dir(clean_box) / "pids.events")["max"] > before, "TasksMax hit"
    assert result.duration < 20
    assert native.run(clean_box, argv=["echo", "alive"]).stdout == b"alive\n"


def test_memory_past_the_limit_is_oom_killed(native: Native, clean_box: Sandbox) -> None:
    hog = "b = bytearray(200 * 1024 * 1024); print(len(b))"
    result = native.run(clean_box, argv=["python3", "-c", hog])
    assert result.oom_killed, result
    assert result.exit_code == 137
    assert native.run(clean_box, argv=["echo", "alive"]).stdout == b"alive\n"


def test_a_timeout_answers_124_and_leaves_no_process(native: Native, clean_box: Sandbox) -> None:
    started = time.monotonic()
    command = "sleep 60 & setsid sleep 60 & sleep 60"
    result = native.run(clean_box, argv=command, shell=True, timeout=1)
    assert result.timed_out
    assert result.exit_code == 124
    assert time.monotonic() - started < 15
    assert only_the_anchor(clean_box), processes(slice_dir(clean_box))


def test_missing_programs_and_cwds_answer_as_docker_s_exec(
    native: Native, clean_box: Sandbox
) -> None:
    missing = native.run(clean_box, argv=["no-such-program"])
    assert missing.exit_code == 127
    assert b"not found" in missing.stderr
    nowhere = native.run(clean_box, argv=["true"], cwd="/no/such/dir")
    assert nowhere.exit_code == 126
    assert b"/no/such/dir" in nowhere.stderr
    assert native.run(clean_box, argv=["cat"], stdin="aGVsbG8=").stdout == b"hello"


def test_its_usage_reads_like_a_docker_sandbox_s(native: Native, clean_box: Sandbox) -> None:
    native.run(clean_box, argv="i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done", shell=True)
    usage = ThreadSide(native.service).usage(native.who, clean_box.id).to_wire()
    assert usage["cpu_seconds"] > 0
    assert usage["memory_bytes"]["project"] > 0
    assert usage["disk_bytes_written"] >= 0
    assert usage["sandbox"]["backend"] == "native"
    assert usage["sandbox"]["provisioned"]["memory_bytes"] == 128 * MB
    tree = ThreadSide(native.service).level_tree(native.who).model_dump()
    names = [sandbox["unit"] for project in tree["children"] for sandbox in project["children"]]
    assert clean_box.container_id in names


def test_what_runs_the_sandbox_s_processes_is_exposed_at_most_2(
    native: Native, box: Sandbox
) -> None:
    """``systemd-analyze security`` of the anchor, whose init every process of the sandbox is
    forked from (an exec's scope runs nothing of its own: it only holds the processes)."""
    anchor = f"{ANCHOR_PREFIX}{box.id}.service"
    said = sh("systemd-analyze", "security", "--no-pager", anchor).stdout
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", said)
    assert match is not None, said
    print(f"exposure of {anchor}: {match.group(1)}")
    assert float(match.group(1)) <= 2.0, said


def test_what_a_native_sandbox_cannot_give_is_refused_before_anything_is_made(
    native: Native,
) -> None:
    for fields in (
        {"network": "bridge"},
        {"cap_add": ["NET_RAW"]},
        {"workspace": {"kind": "volume"}},
    ):
        with pytest.raises(InvalidRequest) as refused:
            created(native.manager, native.spec("refused", **fields))
        assert refused.value.code == "backend_unsupported"
    assert not slicebox_units(slice_names(native.user, "refused").project)


WX = (
    "import mmap\n"
    "try:\n"
    "    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
    "    print('mapped')\n"
    "except OSError as e:\n"
    "    print('refused', e.errno)\n"
)


def test_writable_executable_memory_only_where_the_operator_allows_jit(
    native: Native, clean_box: Sandbox
) -> None:
    # Refused EACCES by the kernel's own MDWE (systemd's prctl), EPERM by its seccomp filter.
    assert native.run(clean_box, argv=["python3", "-c", WX]).stdout in (
        b"refused 13\n",
        b"refused 1\n",
    )
    jit = Native("native_allow_jit = true\n")
    try:
        made = created(jit.manager, jit.spec("jit"))
        assert jit.run(made, argv=["python3", "-c", WX]).stdout == b"mapped\n"
    finally:
        jit.cleanup()


def test_a_host_workspace_runs_as_the_caller_with_their_directory() -> None:
    """As a real user of the host's (systemd looks the uid up), as the agent would for the
    caller the kernel names."""
    native = Native('bind_roots = ["/srv/sbx-native/{user}"]\n')
    root = Path("/srv/sbx-native") / native.user
    sh("groupadd", "--gid", "4321", "sbxnative")
    sh("useradd", "--no-create-home", "--uid", "4321", "--gid", "4321", "sbxnative")
    try:
        (root / "w").mkdir(parents=True)
        os.chown(root, 4321, 4321)  # the user's own directory of the root is theirs
        os.chown(root / "w", 4321, 4321)
        spec = native.spec("hw", workspace={"kind": "host", "path": str(root / "w")})
        made = created(native.manager, spec, owner=(4321, 4321))
        ran = native.run(made, argv="id -u; pwd; echo mine > out; touch /srv/x", shell=True)
        assert ran.stdout == b"4321\n/workspace\n"
        assert b"Read-only file system" in ran.stderr
        written = root / "w" / "out"
        assert written.read_text() == "mine\n"
        assert written.stat().st_uid == 4321
        assert not Path("/srv/x").exists()
        assert native.manager.destroy(made.id) is not None
        assert written.exists(), "the caller's directory outlives the sandbox"
    finally:
        native.cleanup()
        shutil.rmtree("/srv/sbx-native", ignore_errors=True)
        sh("userdel", "sbxnative")
        sh("groupdel", "sbxnative", check=False)


def test_a_task_tree_is_destroyed_whole_and_leaves_nothing(native: Native) -> None:
    """The cascade: a child sandbox with a process left running, destroyed with its parent."""
    made = created(native.manager, native.spec("gone"))
    child = created(native.manager, native.spec("gone", parent_id=made.id))
    assert child.lineage.root_task_id == made.lineage.root_task_id
    assert native.run(child, argv="echo x > f; sleep 60 &", shell=True).exit_code == 0
    gone = native.manager.destroy_tree(made.lineage.root_task_id)
    assert [s.id for s in gone] == [child.id, made.id], "deepest first"
    for each in (made, child):
        assert not slicebox_units(f"*{each.id}*")
        assert not slicebox_units(each.container_id)
        assert not Path(f"/run/slicebox/native/{each.id}").exists()
        assert not Path(f"/run/private/slicebox/native/{each.id}").exists()
        assert not list(Path("/run/slicebox/native-env").glob(f"*{each.id}*"))
    assert native.manager.find(user=native.user, project="gone") == []


def test_with_docker_stopped_a_create_falls_back_to_native_unless_the_config_says_not() -> None:
    with docker_stopped():
        falls = Native()
        refuses = Native("allow_native_fallback = false\n")
        try:
            made = created(falls.manager, SandboxSpec(user=falls.user, project="fb"))
            assert made.backend == "native"
            assert falls.run(made, argv=["echo", "native"]).stdout == b"native\n"
            with pytest.raises(Unavailable) as refused:
                created(refuses.manager, SandboxSpec(user=refuses.user, project="fb"))
            assert refused.value.code == "backend_unavailable"
            assert "allow_native_fallback" in refused.value.message
        finally:
            falls.cleanup()
            refuses.cleanup()


def test_doctor_reports_each_backend() -> None:
    checks = doctor_checks([], dict(os.environ))
    assert checks["native backend"]["ok"] is True, checks["native backend"]
    assert "DynamicUser" in str(checks["native backend"]["detail"])
    assert checks["docker"]["ok"] is True
    with docker_stopped():
        down = doctor_checks([], dict(os.environ))
    assert down["docker"]["ok"] is False
    assert down["native backend"]["ok"] is True


@contextlib.contextmanager
def docker_stopped() -> Iterator[None]:
    sh("systemctl", "stop", "docker.socket", "docker.service")
    try:
        yield
    finally:
        sh("systemctl", "start", "docker.socket", "docker.service")
        wait_for(lambda: sh("docker", "info", check=False).returncode == 0, timeout=120, step=1)


def test_native_sandboxes_outlive_a_killed_agent_and_still_expire() -> None:
    """``kill -9`` of the installed agent: its native sandboxes keep running, the restarted
    agent's reaper finds them by what systemd holds, and a deadline ends one with its
    ``expired`` record and final usage, by the timer's own ``sliceboxd expire``."""
    with installed_agent(agent_config(), start_limit=False):
        sh("systemctl", "start", "slicebox.socket")
        client = Client(str(SOCKET), timeout=120)
        doomed = create(client, "kill", ttl_seconds=45)
        kept = create(client, "kill2", ttl_seconds=3600)
        try:
            burnt = client.request(
                "POST",
                f"/sandboxes/{doomed['id']}/exec",
                {"argv": ["sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"]},
            )
            assert burnt["exit_code"] == 0
            sh("systemctl", "kill", "--signal=SIGKILL", "slicebox.service")
            assert active(f"{ANCHOR_PREFIX}{doomed['id']}.service")
            assert active(f"{ANCHOR_PREFIX}{kept['id']}.service")
            listed = {s["id"]: s for s in client.request("GET", "/sandboxes")}  # restarted
            assert set(listed) >= {doomed["id"], kept["id"]}
            assert listed[kept["id"]]["backend"] == "native"
            expires = datetime.fromisoformat(doomed["expires_at"])
            assert datetime.now(UTC) < expires, "the kill must come before the deadline"
            ran = client.request("POST", f"/sandboxes/{kept['id']}/exec", {"argv": ["id", "-u"]})
            assert ran["exit_code"] == 0
            # Files in and out (execs of tar and cat in the sandbox), and a native one-shot.
            source = Path("/tmp/slicebox-native-in.txt")
            source.write_text("hello native\n")
            try:
                sh("slicebox", "cp", str(source), f"{kept['id']}:/workspace/in.txt")
                sh("slicebox", "cp", f"{kept['id']}:/workspace/in.txt", "-")  # a tar out
                out = sh("slicebox", "exec", kept["id"], "--", "cat", "/workspace/in.txt")
                assert out.stdout == "hello native\n"
            finally:
                source.unlink()
            once = sh("slicebox", "run", "--backend", "native", "--project", "k3", "--", "id", "-u")
            assert int(once.stdout) >= 61184, "its own dynamic user"
            # Agents at once: six native one-shots in a new project, through the socket.
            run = ("slicebox", "run", "--backend", "native", "--project", "k4", "--", "id", "-u")
            with ThreadPoolExecutor(6) as pool:
                uids = list(pool.map(lambda _: int(sh(*run).stdout), range(6)))
            assert len(set(uids)) == 6, "each its own dynamic user"
            # A run answers ahead of its removal: each sandbox's slice goes soon after.
            k4 = slice_names("root", "k4").project.removesuffix(".slice") + "-*.slice"
            wait_for(lambda: not slicebox_units(k4), timeout=120, step=1)
            # Meanwhile (the work above takes about the deadline's time under emulation, which
            # the test need not wait for twice) the deadline came: its timer's expire took it.
            wait_for(lambda: not active(doomed["container_id"]), timeout=240, step=1)
            wait_for(lambda: bool(records(doomed["id"])), timeout=30)
            # The restarted agent's start-up pass adopted both (this run's now), by their labels.
            assert {r["SLICEBOX_REAPER_RULE"] for r in records(kept["id"])} == {"adopt"}
            [record] = [r for r in records(doomed["id"]) if r["SLICEBOX_REAPER_RULE"] != "adopt"]
            assert record["SLICEBOX_REAPER_RULE"] == "expired"
            assert "deadline timer" in record["SLICEBOX_DETAIL"]
            assert float(record["SLICEBOX_USAGE_CPU_SECONDS"]) > 0
        finally:
            for sandbox in client.request("GET", "/sandboxes"):  # an admin's: everyone's
                if sandbox["id"] in (doomed["id"], kept["id"]):
                    client.request("DELETE", f"/sandboxes/{sandbox['id']}")
            client.request("POST", "/reaper", {})
        for made in (doomed, kept):
            assert not slicebox_units(f"*{made['id']}*")


def create(client: Client, project: str, **fields: object) -> dict[str, Any]:
    body = {"project": project, "backend": "native", **fields}
    made: dict[str, Any] = client.request("POST", "/sandboxes", body)
    assert made["backend"] == "native"
    return made


def records(sandbox_id: str) -> list[dict[str, Any]]:
    return journal_records(SLICEBOX_EVENT="reaper_action", SLICEBOX_SANDBOX_ID=sandbox_id)


def _events(path: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


FETCH = (
    "import time, urllib.request\n"
    "for _ in range(150):\n"
    "    try:\n"
    "        answer = urllib.request.urlopen('http://127.0.0.1:8123/hello.txt')\n"
    "        print(answer.read().decode(), end='')\n"
    "        break\n"
    "    except OSError:\n"
    "        time.sleep(0.2)\n"
)


def test_a_native_sandbox_is_one_machine_through_the_agent() -> None:
    """Issue 43, through the installed agent: what one exec leaves running, the next sees,
    reaches and kills; a timed-out exec's fork bomb goes alone; another user's sandbox sees
    none of it; the destroy leaves no process."""
    with installed_agent(agent_config()):
        sh("systemctl", "start", "slicebox.socket")
        client = Client(str(SOCKET), timeout=120)
        made = create(client, "one")
        theirs = create(client, "one", user=unique("nat-"))
        sid = made["id"]

        def ex(sandbox: str, argv: list[str], **fields: object) -> ExecResult:
            body = {"argv": argv, **fields}
            answer = client.request("POST", f"/sandboxes/{sandbox}/exec", body)
            return ExecResult.model_validate(answer)

        try:
            assert ex(sid, ["sh", "-c", "echo hello > hello.txt"]).exit_code == 0
            server = "python3 -m http.server 8123 --bind 127.0.0.1 & echo $!"
            started = ex(sid, ["sh", "-c", server])
            assert started.exit_code == 0
            assert started.duration < 10, "the exec answers at its command's exit"
            assert ex(sid, ["python3", "-c", FETCH], timeout=60).stdout == b"hello\n"
            assert ex(sid, ["sh", "-c", "sleep 4242 &"]).exit_code == 0
            listed = ex(sid, ["ps", "-eo", "pid,args"]).stdout.decode()
            [pid] = [line.split()[0] for line in listed.splitlines() if "sleep 4242" in line]
            assert "http.server 8123" in listed
            assert ex(sid, ["kill", pid]).exit_code == 0
            assert "sleep 4242" not in ex(sid, ["ps", "-eo", "args"]).stdout.decode()
            bomb = ex(sid, ["sh", "-c", "b() { b | b & }; b; exec sleep 30"], timeout=4)
            assert (bomb.timed_out, bomb.exit_code) == (True, 124)
            directory = CGROUP_ROOT / slice_cgroup(made["container_id"]).lstrip("/")
            anchor = f"{ANCHOR_PREFIX}{sid}.service"

            def only_the_server_is_left() -> bool:
                units = processes(directory)
                scopes = [unit for unit in units if unit.endswith(".scope")]
                return set(units) == {anchor, *scopes} and len(scopes) == 1

            wait_for(only_the_server_is_left, timeout=30)
            assert ex(sid, ["python3", "-c", FETCH], timeout=60).stdout == b"hello\n"
            seen = ex(theirs["id"], ["ps", "-eo", "args"]).stdout.decode()
            assert "http.server" not in seen, seen
            assert "sleep 4242" not in seen, seen
            assert len(seen.splitlines()) == 3, f"a header, its init and ps: {seen}"
        finally:
            for sandbox in (made, theirs):
                client.request("DELETE", f"/sandboxes/{sandbox['id']}")
        assert not directory.exists()
        left = sh("pgrep", "-f", "http.server 8123", check=False)
        assert left.returncode == 1, left.stdout


HOSTILE = (
    "import os, socket, struct, sys, time\n"
    "path = sys.argv[1]\n"
    "os.unlink(path)\n"
    "server = socket.socket(socket.AF_UNIX)\n"
    "server.bind(path)\n"
    "server.listen(1)\n"
    "print('listening', flush=True)\n"
    "conn, _ = server.accept()\n"
    "conn.recv(65536)\n"
    "forged = struct.pack('3i', 1, os.getuid(), os.getgid())\n"
    "try:\n"
    "    conn.sendmsg([b'C'], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, forged)])\n"
    "    print('forged pid 1 sent', flush=True)\n"
    "except OSError as e:\n"
    "    print('forged pid 1 refused', e.errno, flush=True)\n"
    "    conn.sendmsg([b'C'])\n"
    "print('answer', conn.recv(1), flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_hostile_init_cannot_have_the_agent_move_another_process(native: Native) -> None:
    """The sandbox's code takes the init's socket and answers the agent's next exec: it can
    only claim a pid the kernel vouches for, its own, which is no new child of the init in the
    anchor's cgroup. The exec is refused, and no process outside moves."""
    made = created(native.manager, native.spec("hostile"))
    try:
        log = Path(f"/run/slicebox/native/{made.id}/hostile.log")
        takeover = 'python3 -c "$HOSTILE" "$0" > hostile.log 2>&1 &'
        path = f"/run/slicebox/init/{made.id}/init.sock"
        taken = native.run(made, argv=["sh", "-c", takeover, path], env={"HOSTILE": HOSTILE})
        assert taken.exit_code == 0, taken
        wait_for(lambda: log.exists() and "listening" in log.read_text(), timeout=60)
        sshd = sh("pgrep", "-o", "sshd").stdout.strip()
        outside = {pid: Path(f"/proc/{pid}/cgroup").read_text() for pid in (sshd, "1")}
        outside[str(os.getpid())] = Path("/proc/self/cgroup").read_text()
        with pytest.raises(HostError) as refused:
            native.run(made, argv=["touch", "/workspace/ran"])
        assert "not its own new child" in refused.value.message, refused.value.message
        wait_for(lambda: "answer" in log.read_text(), timeout=30)
        assert "forged pid 1 refused 1" in log.read_text(), "EPERM: the kernel's own check"
        assert not Path(f"/run/slicebox/native/{made.id}/ran").exists()
        for pid, cgroup in outside.items():
            assert Path(f"/proc/{pid}/cgroup").read_text() == cgroup
        scopes = slicebox_units(f"{EXEC_PREFIX}{made.id}-*.scope")
        assert len(scopes) == 1, f"the hostile exec's own scope alone: {scopes}"
    finally:
        assert native.manager.destroy(made.id) is not None


def test_a_sandbox_from_before_the_init_is_listed_refused_execs_and_destroyed(
    native: Native,
) -> None:
    """A native sandbox an older agent made: its anchor the plain command, no init. Its slice's
    labels still list it; an exec is refused, saying what to do; its destroy leaves nothing."""
    made = created(native.manager, native.spec("old"))
    systemd = PystemdSystemd()
    anchor = f"{ANCHOR_PREFIX}{made.id}.service"
    systemd.stop(anchor)
    systemd.reset_failed(anchor)  # its SIGKILL'd init left it failed, and loaded
    old = ("/bin/sh", "-c", 'cd -- "$1" || exit 126; shift; exec "$@"', "sh", "/workspace")
    systemd.start_service(
        anchor,
        {
            **hardening(made.id, anchor=True),
            "Slice": made.container_id,
            "Type": "exec",
            "ExecStart": [(old[0], [*old, "sleep", "infinity"], False)],
        },
        wait=True,
    )
    try:
        [found] = native.manager.find(user=native.user, project="old")
        assert found.id == made.id
        with pytest.raises(SandboxNotRunning) as refused:
            native.run(found, argv=["true"])
        assert "destroy it and create another" in refused.value.message
    finally:
        assert native.manager.destroy(made.id) is not None
    assert not slicebox_units(f"*{made.id}*")
    assert not Path(f"/run/slicebox/native/{made.id}").exists()


def test_an_abandoned_exec_takes_what_it_started_and_nothing_else(
    native: Native, clean_box: Sandbox
) -> None:
    """A caller that goes away mid-exec: its processes go, a double fork's included; what an
    earlier exec left in the background lives on, until a later exec kills it."""
    kept = native.run(clean_box, argv="sleep 4343 > /dev/null 2>&1 & echo $!", shell=True)
    request = ExecRequest.parse(
        {"argv": "setsid sh -c 'sleep 4444' & echo started; exec sleep 4445", "shell": True}
    )
    scope = clean_box.running_scope()

    async def abandon(blocking: Blocking) -> None:
        events = native.engine.stream(clean_box.container_id, request, blocking, scope)
        async with contextlib.aclosing(events):
            async for _ in events:  # its first output: it runs; then the caller is gone
                break

    from_thread(abandon)
    listed = native.run(clean_box, argv=["ps", "-eo", "args"]).stdout.decode()
    assert "sleep 4343" in listed
    assert "sleep 4444" not in listed
    assert "sleep 4445" not in listed
    assert native.run(clean_box, argv=["kill", kept.stdout.decode().strip()]).exit_code == 0
