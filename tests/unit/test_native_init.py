"""A native exec over the real wire to a real init (``sandboxinit``, run as a plain child
process: no namespace, no systemd), with the backend's systemd a fake that records each exec's
scope and kills its process at a stop. What only a real host shows (the PID namespace, the
cgroup check, the scope holding a double fork) is ``tests/host/test_native.py``'s."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from slicebox.backends.base import WORKSPACE, SandboxRequest
from slicebox.backends.native import initwire
from slicebox.backends.native.backend import NativeBackend
from slicebox.backends.native.claims import ProcClaims
from slicebox.backends.native.initwire import InitError, Order, Report
from slicebox.backends.native.names import ANCHOR_PREFIX, slice_cgroup, unit_cgroup
from slicebox.backends.native.units import INIT_SCRIPT
from slicebox.model.errors import SandboxNotRunning
from slicebox.model.exec import ExecRequest, ExecState
from slicebox.model.limits import Limits
from slicebox.model.spec import Backend
from tests.fakes.native import ChildClaims, LiveInitSystemd

MiB = 1024 * 1024
PROJECT = "slicebox-al\\x2dice-p.slice"
NAME = "sbx-000000000001"
NOBODY = 65534


class Refuses(ChildClaims):
    def claim(self, pid: int, cgroup: str) -> int:
        raise InitError(f"pid {pid} is not the sandbox's")


@pytest.fixture
def runtime() -> Iterator[Path]:
    """A short directory: a unix socket's path is at most 107 bytes."""
    made = Path(tempfile.mkdtemp(prefix="sbx"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def systemd() -> Iterator[LiveInitSystemd]:
    made = LiveInitSystemd()
    yield made
    made.close()


def backend(systemd: LiveInitSystemd, runtime: Path, claims: ChildClaims) -> NativeBackend:
    return NativeBackend(
        systemd,
        env_dir=runtime / "env",
        which=lambda name: "/bin/" + name,
        init_runtime=runtime / "init",
        claims=claims,
    )


@pytest.fixture
def claims() -> ChildClaims:
    return ChildClaims()


@pytest.fixture
def native(systemd: LiveInitSystemd, runtime: Path, claims: ChildClaims) -> NativeBackend:
    return backend(systemd, runtime, claims)


def request() -> SandboxRequest:
    return SandboxRequest(
        name=NAME,
        image="",
        command=("sleep", "infinity"),
        labels={"slicebox.sandbox_id": NAME},
        slice=PROJECT,
        limits=Limits(cpus=0.5, memory_bytes=128 * MiB, pids=64),
        backend=Backend.NATIVE,
    )


def run(
    native: NativeBackend, backend_id: str, exec_request: ExecRequest, *, kill_after: float = 0
) -> tuple[str, bytes, bytes, ExecState]:
    """An exec to its end (or killed ``kill_after`` seconds in): id, stdout, stderr, state.
    Left at its default (/workspace), in /tmp: the init runs on this host, which has no
    /workspace (a unit's bind makes one in a real sandbox)."""
    if exec_request.cwd == WORKSPACE:
        exec_request = exec_request.model_copy(update={"cwd": "/tmp"})

    async def go() -> tuple[str, bytes, bytes, ExecState]:
        exec_id = await native.exec_create(backend_id, exec_request)
        attachment = await native.exec_start(exec_id, exec_request.stdin)
        out, err = b"", b""
        began = time.monotonic()
        while (chunks := await attachment.read(0.1)) is not None:
            for chunk in chunks:
                if chunk.stream.value == "stdout":
                    out += chunk.data
                else:
                    err += chunk.data
            if kill_after and time.monotonic() - began > kill_after:
                assert await native.exec_kill(exec_id)
                break
        attachment.close()  # as the engine does, before it asks for the exit code
        state = await native.exec_inspect(exec_id)
        while state.running:  # the output may end before the report
            await asyncio.sleep(0.01)
            state = await native.exec_inspect(exec_id)
        return exec_id, out, err, state

    return asyncio.run(go())


def test_an_exec_runs_through_the_init_and_its_process_gets_a_scope_of_its_own(
    native: NativeBackend, systemd: LiveInitSystemd, claims: ChildClaims
) -> None:
    made = native.create(request())
    ran = ExecRequest(argv=("sh", "-c", 'echo "$K"; pwd; echo err >&2; exit 3'), env={"K": "v"})
    exec_id, out, err, state = run(native, made.id, ran.model_copy(update={"cwd": "/tmp"}))
    assert (out, err) == (b"v\n/tmp\n", b"err\n")
    assert (state.running, state.exit_code) == (False, 3)
    scope = systemd.services[exec_id]
    assert exec_id.endswith(".scope")
    assert scope["Slice"] == made.id
    assert (scope["KillMode"], scope["KillSignal"], scope["OOMPolicy"]) == (
        "control-group",
        9,
        "continue",
    )
    [(pid, cgroup)] = claims.claimed
    assert pid == systemd.scope_pids[exec_id]
    assert cgroup == unit_cgroup(made.id, f"{ANCHOR_PREFIX}{NAME}.service")


def test_missing_programs_and_cwds_answer_126_and_127_and_stdin_is_fed(
    native: NativeBackend,
) -> None:
    made = native.create(request())
    assert run(native, made.id, ExecRequest(argv=("no-such-program",)))[3].exit_code == 127
    nowhere = run(native, made.id, ExecRequest(argv=("true",), cwd="/no/such/dir"))
    assert nowhere[3].exit_code == 126
    assert b"/no/such/dir" in nowhere[2]
    assert run(native, made.id, ExecRequest(argv=("cat",), stdin=b"hello"))[1] == b"hello"


def test_an_exec_ends_with_its_command_and_what_it_left_running_writes_on(
    native: NativeBackend,
) -> None:
    """A background writer holds the pipes: the exec answers soon after its command exits,
    and the writer, given to the init's drain, never meets a closed pipe."""
    made = native.create(request())
    loop = "(trap '' PIPE; while echo x; do sleep 0.05; done; echo gone > /dev/null) &"
    began = time.monotonic()
    _, out, _, state = run(native, made.id, ExecRequest(argv=("sh", "-c", f"{loop} echo $!")))
    assert time.monotonic() - began < 2 + 3, "the grace for its output, and no more"
    assert state.exit_code == 0
    writer = int(out.split(b"\n")[0])
    time.sleep(0.5)
    os.kill(writer, 0)  # alive and still writing: into the init's drain
    os.kill(writer, signal.SIGKILL)


def test_a_kill_stops_the_exec_s_scope(native: NativeBackend, systemd: LiveInitSystemd) -> None:
    made = native.create(request())
    exec_id, _, _, state = run(native, made.id, ExecRequest(argv=("sleep", "60")), kill_after=0.3)
    assert (state.running, state.exit_code) == (False, 137)
    assert exec_id not in systemd.running


def test_a_hello_the_claims_refuse_runs_nothing_and_makes_no_scope(
    systemd: LiveInitSystemd, runtime: Path
) -> None:
    native = backend(systemd, runtime, Refuses())
    made = native.create(request())
    mark = runtime / "ran"
    with pytest.raises(InitError):
        run(native, made.id, ExecRequest(argv=("touch", str(mark))))
    time.sleep(0.3)
    assert not mark.exists(), "without the go the command never runs"
    assert not [unit for unit in systemd.services if unit.endswith(".scope")]


def test_a_sandbox_without_an_init_is_not_running_for_execs(
    native: NativeBackend, runtime: Path
) -> None:
    made = native.create(request())
    (runtime / "init" / NAME / "init.sock").unlink()  # as an older agent's sandbox has none
    with pytest.raises(SandboxNotRunning) as refused:
        run(native, made.id, ExecRequest(argv=("true",)))
    assert "destroy it" in refused.value.message


def test_the_claims_take_only_a_live_process_of_the_named_cgroup(tmp_path: Path) -> None:
    own = ProcClaims().cgroup_of(os.getpid())
    pidfd = ProcClaims().claim(os.getpid(), own)
    os.close(pidfd)
    with pytest.raises(InitError, match="not its own new child"):
        ProcClaims().claim(os.getpid(), own + "/elsewhere")
    with pytest.raises(InitError, match="refused"):
        ProcClaims().claim(1, own)
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    with pytest.raises(InitError, match="gone"):
        ProcClaims().claim(gone, own)


def test_a_slice_s_cgroup_nests_as_systemd_nests_it() -> None:
    assert slice_cgroup("a-b\\x2dc-d.slice") == "/a.slice/a-b\\x2dc.slice/a-b\\x2dc-d.slice"


def test_the_init_s_reports_read_as_a_shell_reports_them() -> None:
    assert initwire.report_of(b'{"exited": 3}').exit_code == 3
    assert initwire.report_of(b'{"signaled": 9}').exit_code == 137
    assert initwire.report_of(b"garbage").error is not None
    assert Report(error="x").exit_code == 137
    frame = Order(argv=("a",), cwd="/", env={}, stdin=False).frame()
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4


def spawn_init(runtime: Path, agent_uid: int, *command: str) -> subprocess.Popen[bytes]:
    path = runtime / "init.sock"
    argv = [sys.executable, "-I", "-S", "-B", str(INIT_SCRIPT), str(path), str(agent_uid), "/"]
    init = subprocess.Popen([*argv, *command])
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return init


def test_the_init_serves_the_agent_s_uid_alone(runtime: Path) -> None:
    init = spawn_init(runtime, os.getuid() + 1)  # as the sandbox's own processes are refused
    out_read, out_write = os.pipe()
    order = Order(argv=("true",), cwd="/", env={}, stdin=False)
    try:
        with pytest.raises(InitError, match="hung up"):
            asyncio.run(
                initwire.handshake(
                    runtime.parent, runtime.name, "init.sock", order, [out_write, out_write]
                )
            )
    finally:
        os.close(out_read)
        os.close(out_write)
        init.kill()
        init.wait()


def test_the_init_ends_with_the_sandbox_s_own_command(runtime: Path) -> None:
    assert spawn_init(runtime, os.getuid(), "sh", "-c", "exit 7").wait(timeout=30) == 7
    idle = spawn_init(runtime, os.getuid(), "sleep", "infinity")
    try:
        time.sleep(0.3)
        assert idle.poll() is None, "the default command is the init's own waiting"
        children = Path(f"/proc/{idle.pid}/task/{idle.pid}/children").read_text().split()
        assert children == []
    finally:
        idle.kill()
        idle.wait()


@contextmanager
def stuck_listener(where: Path) -> Iterator[socket.socket]:
    """A listener at ``where`` that never answers: what a sandbox's code puts in place."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(where))
        listener.listen()
        yield listener


def accepted_any(listener: socket.socket) -> bool:
    listener.setblocking(False)
    try:
        listener.accept()[0].close()
    except BlockingIOError:
        return False
    return True


@pytest.mark.parametrize("how", ["symlink", "hard link of another owner's", "another owner's"])
def test_an_init_socket_the_sandbox_replaced_is_refused_at_once_never_followed(
    native: NativeBackend, runtime: Path, how: str
) -> None:
    """The sandbox's code replaces its init's socket (in a directory its user may write) with
    a link to, or a hard link of, a listener that never answers (the agent's own socket, or
    one of its making): the exec is refused at once, and nothing connected to that listener
    (before: the agent followed the link as root and waited out the 10 s handshake)."""
    made = native.create(request())
    sock = runtime / "init" / NAME / "init.sock"
    with stuck_listener(runtime / "elsewhere.sock") as listener:
        sock.unlink()
        if how == "symlink":
            sock.symlink_to(runtime / "elsewhere.sock")
        else:
            os.chown(runtime / "elsewhere.sock", NOBODY, NOBODY)
            if how.startswith("hard"):
                os.link(runtime / "elsewhere.sock", sock)
            else:
                os.rename(runtime / "elsewhere.sock", sock)
        began = time.monotonic()
        with pytest.raises(InitError, match="was replaced"):
            run(native, made.id, ExecRequest(argv=("true",)))
        assert time.monotonic() - began < 2.0
        assert not accepted_any(listener), "nothing connected to the replacement"


def test_a_silent_listener_of_the_sandbox_s_own_holds_no_thread_and_stalls_no_one(
    native: NativeBackend, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sandbox's code binds a listener of its user's own, which never answers, where its
    init's socket was (it passes every check of the socket's owner): eight of its execs wait
    out the handshake on the event loop, each refused with a code at its end, while another
    sandbox's exec runs at once (before: each held one of the backend's four threads for the
    handshake, and the other sandbox's exec waited behind them)."""
    monkeypatch.setattr(initwire, "HANDSHAKE_TIMEOUT", 3.0)
    stuck = native.create(request())
    other = native.create(request().model_copy(update={"name": "sbx-000000000002"}))
    sock = runtime / "init" / NAME / "init.sock"
    sock.unlink()

    async def go() -> tuple[float, list[BaseException | tuple[str, object]]]:
        async def start(backend_id: str) -> tuple[str, object]:
            exec_id = await native.exec_create(backend_id, ExecRequest(argv=("true",), cwd="/"))
            attachment = await native.exec_start(exec_id, b"")
            while await attachment.read(0.1) is not None:
                pass
            attachment.close()
            return exec_id, attachment

        held = [asyncio.create_task(start(stuck.id)) for _ in range(8)]
        await asyncio.sleep(0.3)  # all eight waiting on the silent listener
        began = time.monotonic()
        await start(other.id)
        took = time.monotonic() - began
        return took, list(await asyncio.gather(*held, return_exceptions=True))

    with stuck_listener(sock):
        took, held = asyncio.run(go())
    assert took < 2.0, f"the other sandbox's exec waited {took:.1f} s behind the stuck ones"
    assert all(isinstance(e, InitError) and "did not answer" in str(e) for e in held), held
