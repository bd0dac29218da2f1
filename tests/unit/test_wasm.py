"""The wasm backend's logic: the worker calling real Extism plugins (the project's own, built
from WebAssembly text with wat2wasm), the plugin store, the read beneath a caller's roots, and
a wasm sandbox made through the agent's create path on a fake systemd that runs each exec's
unit command for real with the pipes it was given (the real host: ``tests/host/test_wasm.py``).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from slicebox.backends.base import Availability
from slicebox.backends.native.backend import NativeBackend
from slicebox.backends.native.names import ANCHOR_PREFIX
from slicebox.backends.native.units import WORKSPACE, run_as_described
from slicebox.backends.router import Backends
from slicebox.backends.wasm import availability, call_blocking, function_of, verdict
from slicebox.backends.wasmrun import (
    EXIT_NO_FUNCTION,
    answer_bytes,
    answer_of,
    call,
    request_bytes,
)
from slicebox.core.deadlines import Deadlines
from slicebox.core.pool import WarmPool
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.beneath import BindRoot
from slicebox.host.plugins import PluginStore, read_plugin
from slicebox.model.config import parse_config
from slicebox.model.errors import InvalidRequest, NotFound, PolicyViolation, Unavailable
from slicebox.model.exec import ExecRequest, ExecState, OutputStream
from slicebox.model.spec import Backend, SandboxSpec, parse_spec
from slicebox.model.wasm import EXIT_OOM, EXIT_TIMEOUT, WasmSpec, digest, max_pages_for
from tests.fakes.docker import FakeDocker
from tests.fakes.native import FakeNativeSystemd
from tests.fakes.threadside import created
from tests.wasm.build import TOOLKIT, build

MiB = 1024 * 1024
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build(TOOLKIT, tmp_path_factory.mktemp("wasm")).read_bytes()


def run(module: bytes, function: str, data: bytes = b"", **limits: Any) -> tuple[int, bytes, str]:
    settings: dict[str, Any] = {"max_pages": 64, "timeout_ms": 2000, "hosts": []} | limits
    return call(module, function, data, **settings)


# --- the worker, on real Extism ----------------------------------------------------------------


def test_echo_and_count_give_exact_output(toolkit: bytes) -> None:
    assert run(toolkit, "echo", b"hello \x00 world\n") == (0, b"hello \x00 world\n", "")
    assert run(toolkit, "echo") == (0, b"", "")
    assert run(toolkit, "count_vowels", b"Hello World, AEIOU") == (0, b"8", "")
    assert run(toolkit, "count_vowels", b"xyz") == (0, b"0", "")
    assert run(toolkit, "count_vowels", b"a" * 1234) == (0, b"1234", "")


def test_a_loop_is_stopped_at_its_timeout(toolkit: bytes) -> None:
    status, output, message = run(toolkit, "spin", timeout_ms=300)
    assert (status, output) == (EXIT_TIMEOUT, b"")
    assert "300 ms" in message


def test_a_memory_grower_is_stopped_at_its_pages(toolkit: bytes) -> None:
    status, _, message = run(toolkit, "grow", max_pages=32)
    assert status == EXIT_OOM
    assert "32 pages" in message


def test_a_missing_function_and_a_host_not_allowed_fail(toolkit: bytes) -> None:
    assert run(toolkit, "nope")[0] == EXIT_NO_FUNCTION
    # No host allowed: the runtime refuses the call before any connection is tried.
    status, output, message = run(toolkit, "http_get", b"http://sbx-unlisted.invalid/")
    assert (status, output) == (1, b"")
    assert message.startswith("the call failed")


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """The worker as a wasm sandbox's anchor runs it, listening on a socket of the test's;
    its socket and pid."""
    path = tmp_path / "worker.sock"
    argv = [sys.executable, "-m", "slicebox.backends.wasmrun", "--serve", str(path)]
    process = subprocess.Popen(argv)
    try:
        wait_until(path.exists)
        yield path, process.pid
    finally:
        process.kill()
        process.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def request_for(module: bytes, function: str, data: bytes = b"", timeout_ms: int = 5000) -> bytes:
    return request_bytes(
        function, module, data, sha256=digest(module), max_pages=64, timeout_ms=timeout_ms, hosts=[]
    )


def test_the_worker_answers_calls_on_its_socket_each_in_a_fresh_instance(
    worker: tuple[Path, int], toolkit: bytes
) -> None:
    path, _ = worker
    assert call_blocking(path, request_for(toolkit, "echo", b"in")) == (0, b"in", "")
    assert call_blocking(path, request_for(toolkit, "count_vowels", b"aei")) == (0, b"3", "")
    assert call_blocking(path, request_for(toolkit, "grow"))[0] == EXIT_OOM
    assert call_blocking(path, request_for(toolkit, "echo", b"after")) == (0, b"after", "")
    unsent = request_bytes(
        "echo", b"", b"x", sha256="f" * 64, max_pages=64, timeout_ms=5000, hosts=[]
    )
    assert call_blocking(path, unsent)[0] == 2, "a call names a module compiled already"
    bad = call_blocking(path, (5).to_bytes(4, "big") + b"{not}")
    assert bad[0] == 2
    assert "bad request" in bad[2]


def test_a_call_whose_caller_hangs_up_is_cancelled(
    worker: tuple[Path, int], toolkit: bytes
) -> None:
    path, pid = worker
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(path))
        conn.sendall(request_for(toolkit, "spin", timeout_ms=600_000))
        before = cpu_seconds(pid)
        wait_until(lambda: cpu_seconds(pid) - before > 0.2)  # it spins
    time.sleep(0.3)  # the worker looks at the connection every 50 ms
    before = cpu_seconds(pid)
    time.sleep(0.5)
    assert cpu_seconds(pid) - before < 0.2, "the spinning call was cancelled"
    assert call_blocking(path, request_for(toolkit, "echo", b"free")) == (0, b"free", "")


def test_an_answer_cut_short_is_an_error() -> None:
    assert answer_of(answer_bytes(3, b"out", "msg")) == (3, b"out", "msg")
    with pytest.raises(ValueError, match="ended early"):
        answer_of(answer_bytes(0, b"output", "")[:-2])


# --- the spec, the store, and a plugin read beneath a root ------------------------------------


def test_the_plugin_is_given_one_way_and_only_to_backend_wasm() -> None:
    good = {"user": "u", "project": "p", "backend": "wasm", "wasm": {"sha256": "a" * 64}}
    assert parse_spec(good).wasm == WasmSpec(sha256="a" * 64)
    for wasm in ({}, {"sha256": "a" * 64, "path": "/x.wasm"}, {"path": "rel.wasm"}):
        with pytest.raises(InvalidRequest):
            parse_spec(good | {"wasm": wasm})
    with pytest.raises(InvalidRequest, match="backend wasm"):
        parse_spec({"user": "u", "project": "p", "backend": "wasm"})
    with pytest.raises(InvalidRequest, match="backend wasm"):
        parse_spec({"user": "u", "project": "p", "wasm": {"sha256": "a" * 64}})


def test_pages_follow_the_memory_limit() -> None:
    assert max_pages_for(128 * MiB) == 1024, "64 MiB left to the worker"
    assert max_pages_for(4 * MiB) == 32, "half of a small one"
    assert max_pages_for(1000) == 1
    assert max_pages_for(None) == 65536
    assert max_pages_for(64 * 1024 * MiB) == 65536


def test_the_store_keeps_modules_by_sha_and_evicts_the_least_recent(
    tmp_path: Path, toolkit: bytes
) -> None:
    store = PluginStore(tmp_path / "store", limit=2 * (3 * len(toolkit) + 10))
    first = store.put("alice", toolkit)
    assert first == digest(toolkit)
    assert store.get("alice", first) == toolkit
    assert store.put("alice", toolkit) == first, "a second upload is the same module"
    assert (tmp_path / "store").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "store" / "alice").stat().st_mode & 0o777 == 0o700
    others = [toolkit + bytes([n]) for n in range(4)]  # trailing bytes: other modules
    os.utime(store.path("alice", first), (1, 1))
    made = [store.put("alice", module, keep={first}) for module in others]
    assert first in store.held("alice"), "one in use is never evicted"
    assert len(store.held("alice")) == 3
    assert made[-1] in store.held("alice")
    with pytest.raises(NotFound) as missing:
        store.get("alice", "b" * 64)
    assert missing.value.code == "wasm_not_found"
    with pytest.raises(InvalidRequest) as invalid:
        store.put("alice", b"#!/bin/sh\n")
    assert invalid.value.code == "wasm_invalid"


def test_a_user_s_uploads_neither_find_nor_evict_another_s_plugins(
    tmp_path: Path, toolkit: bytes
) -> None:
    """Before: one store by sha256, so bob named alice's plugin by its hash and ran it, and
    his uploads evicted hers as the least recent."""
    size = len(toolkit) + 1
    store = PluginStore(tmp_path / "store", limit=6 * size, user_limit=3 * size)
    (tmp_path / "store").mkdir()
    stray = tmp_path / "store" / f"{digest(toolkit)}.wasm"  # an older agent's flat store
    stray.write_bytes(toolkit)
    hers = store.put("alice", toolkit + b"\0")
    assert not stray.exists(), "what an older agent kept by sha256 alone is no one's: gone"
    with pytest.raises(NotFound):
        store.require("bob", hers)
    with pytest.raises(NotFound):
        store.get("bob", hers)
    for n in range(10):  # bob's many uploads: his least recent go, never hers
        store.put("bob", toolkit + bytes([n + 1]))
        assert store.held("alice") == [hers]
    assert len(store.held("bob")) == 3
    # The store full of others' plugins and hers in use: her next upload is refused, no
    # one's evicted, and nothing of it kept.
    store.put("carol", toolkit + b"\xf0")
    store.put("carol", toolkit + b"\xf1")
    before = {user: store.held(user) for user in ("alice", "bob", "carol")}
    with pytest.raises(Unavailable) as full:
        store.put("alice", toolkit + b"\xaa", keep={hers})
    assert full.value.code == "wasm_store_full"
    assert {user: store.held(user) for user in ("alice", "bob", "carol")} == before
    with pytest.raises(ValueError, match="not a user level"):
        store.path("../bob", hers)


def test_a_plugin_path_is_read_beneath_the_caller_s_root_as_they_could(
    tmp_path: Path, toolkit: bytes
) -> None:
    root = tmp_path / "ws" / "alice"
    root.mkdir(parents=True)
    plugin = root / "p.wasm"
    plugin.write_bytes(toolkit)
    plugin.chmod(0o600)
    me = os.getuid()
    roots = (BindRoot(path=PurePosixPath(root), top=str(tmp_path), trusted=me),)
    assert read_plugin(str(plugin), roots, me, set()) == toolkit
    with pytest.raises(PolicyViolation, match="not readable"):
        read_plugin(str(plugin), roots, me + 1, set())
    plugin.chmod(0o644)
    assert read_plugin(str(plugin), roots, me + 1, set()) == toolkit
    (root / "link.wasm").symlink_to(plugin)
    with pytest.raises(PolicyViolation, match="symlink"):
        read_plugin(str(root / "link.wasm"), roots, me, set())
    with pytest.raises(PolicyViolation, match="outside"):
        read_plugin(str(tmp_path / "elsewhere.wasm"), roots, me, set())
    (root / "dir.wasm").mkdir()
    with pytest.raises(InvalidRequest, match="regular file"):
        read_plugin(str(root / "dir.wasm"), roots, me, set())


# --- through the agent's create path, on a systemd that runs the exec ------------------------


class RunningSystemd(FakeNativeSystemd):
    """The fake systemd, but a wasm sandbox's anchor runs its command for real (the worker,
    with its Environment), started once it says ``READY=1`` on its notify socket (as systemd
    waits for a ``Type=notify`` unit; a socket file alone may not listen yet), and killed
    when the sandbox's slice stops."""

    def __init__(self) -> None:
        super().__init__()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start_service(self, unit: str, properties: Mapping[str, Any], *, wait: bool) -> None:
        super().start_service(unit, properties, wait=wait)
        if properties.get("Type") != "notify":
            return
        argv = properties["ExecStart"][0][1]
        path = Path(argv[argv.index("--serve") + 1])
        path.parent.mkdir(parents=True, exist_ok=True)  # its RuntimeDirectory
        workspace = path.parent / "workspace"  # what systemd binds at /workspace
        workspace.mkdir(exist_ok=True)
        argv = [str(workspace) if word == WORKSPACE else word for word in argv]
        # HOME=/workspace too: the worker's runtime caches below it, never in the host's /.
        env = {
            key: str(workspace) if value == WORKSPACE else value
            for key, value in (line.split("=", 1) for line in properties["Environment"])
        }
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(str(path.parent / "notify"))  # systemd's NOTIFY_SOCKET
            notify.settimeout(30.0)
            env["NOTIFY_SOCKET"] = str(path.parent / "notify")
            self.processes[unit] = subprocess.Popen(argv, env=env)
            while b"READY=1" not in notify.recv(4096):  # the start job ends at READY=1 only
                pass
        (path.parent / "notify").unlink()

    def stop(self, unit: str) -> None:
        super().stop(unit)
        for name, process in list(self.processes.items()):
            if name not in self.running:
                process.kill()
                process.wait()
                del self.processes[name]


class Host:
    def __init__(self, tmp_path: Path, config: str = "", *, deadlines: bool = False) -> None:
        self.systemd = RunningSystemd()
        self.native = NativeBackend(
            self.systemd,
            env_dir=tmp_path / "env",
            which=lambda name: name,
            plugins=PluginStore(tmp_path / "plugins"),
            wasm_runtime=tmp_path / "wasm",
        )
        self.backends = Backends(FakeDocker(self.systemd), self.native)
        ids = (f"sbx-{n:012x}" for n in itertools.count(1))
        self.manager = SandboxManager(
            self.backends,
            SliceManager(self.systemd),
            config=parse_config(config),
            host_memory=4096 * MiB,
            instance_id="run-1",
            clock=lambda: NOW,
            new_id=lambda: next(ids),
            deadlines=Deadlines(self.systemd) if deadlines else None,
        )

    def call(
        self, container_id: str, function: str, data: bytes = b"", timeout: float = 5.0
    ) -> tuple[ExecState, bytes, bytes, str]:
        request = ExecRequest(argv=(function,), timeout=timeout)
        native = self.native

        async def main() -> tuple[ExecState, bytes, bytes, str]:
            exec_id = await native.exec_create(container_id, request)
            attachment = await native.exec_start(exec_id, data)
            out = dict.fromkeys(OutputStream, b"")
            while (chunks := await attachment.read(5.0)) is not None:
                for chunk in chunks:
                    out[chunk.stream] += chunk.data
            for _ in range(100):
                state = await native.exec_inspect(exec_id)
                if not state.running:
                    break
                await asyncio.sleep(0.01)
            return state, out[OutputStream.STDOUT], out[OutputStream.STDERR], exec_id

        return asyncio.run(main())


def wasm_spec(**fields: object) -> SandboxSpec:
    return SandboxSpec.model_validate(
        {"user": "al-ice", "project": "p", "backend": "wasm", "memory": "128m", **fields}
    )


def test_a_wasm_sandbox_s_worker_is_its_anchor_and_answers_its_execs(
    tmp_path: Path, toolkit: bytes
) -> None:
    host = Host(tmp_path)
    module = base64.b64encode(toolkit).decode()
    made = created(host.manager, wasm_spec(wasm={"module": module}))
    assert made.backend == "wasm"
    description = host.systemd.slice_descriptions[made.container_id]
    run_as = run_as_described(description)
    assert run_as.wasm is not None
    assert run_as.jit
    assert (run_as.wasm.sha256, run_as.wasm.max_pages) == (digest(toolkit), 1024)
    assert module not in description, "the module is in the store, not the unit"
    props = host.systemd.services[f"{ANCHOR_PREFIX}{made.id}.service"]
    assert props["Slice"] == made.container_id, "the worker runs in the sandbox's slice"
    assert props["Type"] == "notify", "made once the worker listens"
    assert props["MemoryDenyWriteExecute"] is False, "Wasmtime's code pages are executable"
    assert props["PrivateNetwork"] is True, "no host allowed: no network at all"
    assert f"slicebox/wasm/{made.id}" in props["RuntimeDirectory"]
    assert props["ExecStart"][0][1][-2:] == ["--workspace", WORKSPACE], "its one WASI path"
    state, out, err, exec_id = host.call(made.container_id, "count_vowels", b"slicebox agent")
    assert (state.exit_code, out, err) == (0, b"5", b"")
    assert exec_id not in host.systemd.services, "a call is no unit of its own"
    state, out, err, _ = host.call(made.container_id, "spin", timeout=0.3)
    assert (state.exit_code, state.verdict) == (EXIT_TIMEOUT, "timeout")
    state, out, err, _ = host.call(made.container_id, "echo", b"x" * 200_000)
    assert (state.exit_code, len(out)) == (0, 200_000)
    assert host.manager.destroy(made.id) is not None


def test_a_plugin_named_by_sha_or_path_and_pages_that_stop_a_grower(
    tmp_path: Path, toolkit: bytes
) -> None:
    root = tmp_path / "ws" / "al-ice"
    root.mkdir(parents=True)
    (root / "toolkit.wasm").write_bytes(toolkit)
    host = Host(tmp_path, f'bind_roots = ["{tmp_path}/ws/{{user}}"]')
    by_path = created(
        host.manager,
        wasm_spec(wasm={"path": str(root / "toolkit.wasm")}, memory="4m"),
        owner=(os.getuid(), 0),
    )
    state, _, err, _ = host.call(by_path.container_id, "grow")
    assert (state.exit_code, state.verdict) == (EXIT_OOM, "oom")
    assert b"32 pages" in err
    by_sha = created(host.manager, wasm_spec(wasm={"sha256": digest(toolkit)}))
    assert host.call(by_sha.container_id, "echo", b"again")[1] == b"again"
    with pytest.raises(NotFound) as missing:
        created(host.manager, wasm_spec(wasm={"sha256": "c" * 64}))
    assert missing.value.code == "wasm_not_found"
    with pytest.raises(InvalidRequest) as bad:
        host.call(by_sha.container_id, "echo; id")
    assert bad.value.code == "wasm_invalid"
    for made in (by_path, by_sha):
        host.manager.destroy(made.id)
    assert not [unit for unit in host.systemd.running if "sbx" in unit], "no unit of theirs"


def test_an_allow_list_becomes_the_plugin_s_hosts_and_gives_it_the_network(
    tmp_path: Path, toolkit: bytes
) -> None:
    host = Host(tmp_path, "[[egress.rule]]\n")  # egress is closed by default
    module = base64.b64encode(toolkit).decode()
    allow = {"egress": {"allow": ["api.example.org", "*.example.net", "10.1.2.3"]}}
    made = created(host.manager, wasm_spec(wasm={"module": module}, network=allow))
    run_as = run_as_described(host.systemd.slice_descriptions[made.container_id])
    assert run_as.wasm is not None
    assert run_as.wasm.allowed_hosts == ("api.example.org", "*.example.net", "10.1.2.3")
    props = host.systemd.services[f"{ANCHOR_PREFIX}{made.id}.service"]
    assert "PrivateNetwork" not in props
    assert props["RestrictAddressFamilies"] == (True, ["AF_UNIX", "AF_INET", "AF_INET6"])
    for entries, said in ((["api.example.org:443"], "no port"), (["10.20.0.0/16"], "networks")):
        with pytest.raises(InvalidRequest, match=said):
            created(
                host.manager,
                wasm_spec(wasm={"module": module}, network={"egress": {"allow": entries}}),
            )
    host.manager.destroy(made.id)


def test_what_a_wasm_sandbox_cannot_give_is_refused_before_anything_is_made(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    for extra in ({"cap_add": ["NET_ADMIN"]}, {"network": "bridge"}, {"run_as": "0:0"}):
        with pytest.raises(InvalidRequest) as refused:
            created(host.manager, wasm_spec(wasm={"sha256": "a" * 64}, **extra))
        assert refused.value.code == "backend_unsupported"
        assert "wasm sandbox" in refused.value.message
    assert not host.systemd.services


def test_exit_statuses_are_verdicts_and_availability_needs_the_sdk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert (verdict(EXIT_TIMEOUT), verdict(EXIT_OOM), verdict(1)) == ("timeout", "oom", None)
    with pytest.raises(InvalidRequest):
        function_of(ExecRequest(argv=("sh", "-c", "id")))
    up = Availability(kind=Backend.NATIVE, available=True, detail="ok")
    assert availability(up).available
    assert availability(up).kind is Backend.WASM
    down = Availability(kind=Backend.NATIVE, available=False, detail="no systemd")
    assert availability(down).detail == "no systemd"
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "slicebox[wasm]" in availability(up).detail


def test_the_cli_uploads_a_plugin_and_passes_the_words_as_input(
    tmp_path: Path, toolkit: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slicebox.cli import main as cli

    plugin = tmp_path / "toolkit.wasm"
    plugin.write_bytes(toolkit)
    argv = ["run", "--plugin", str(plugin), "--function", "count_vowels", "--", "hello", "world"]
    options = cli.build_parser().parse_args(argv)
    spec, request = cli._spec(options), cli._exec_request(options)
    assert spec.backend is Backend.WASM
    assert spec.wasm is not None
    assert spec.wasm.module_bytes() == toolkit
    assert (request.argv, request.stdin) == (("count_vowels",), b"hello world")
    by_path = cli.build_parser().parse_args(["create", "--plugin-path", "/srv/ws/u/p.wasm"])
    assert cli._spec(by_path).wasm == WasmSpec(path="/srv/ws/u/p.wasm")
    missing = cli.build_parser().parse_args(["create", "--plugin", str(tmp_path / "none")])
    with pytest.raises(InvalidRequest, match="--plugin"):
        cli._spec(missing)


def test_concurrent_calls_into_one_sandbox_each_get_their_own_answer(
    tmp_path: Path, toolkit: bytes
) -> None:
    host = Host(tmp_path)
    made = created(host.manager, wasm_spec(wasm={"module": base64.b64encode(toolkit).decode()}))

    async def one(n: int) -> tuple[int | None, bytes]:
        request = ExecRequest(argv=("echo",), timeout=30)
        exec_id = await host.native.exec_create(made.container_id, request)
        attachment = await host.native.exec_start(exec_id, b"call %d" % n)
        out = b""
        while (chunks := await attachment.read(5.0)) is not None:
            out += b"".join(c.data for c in chunks if c.stream is OutputStream.STDOUT)
        return (await host.native.exec_inspect(exec_id)).exit_code, out

    async def many() -> list[tuple[int | None, bytes]]:
        spinning = ExecRequest(argv=("spin",), timeout=30)
        spin_id = await host.native.exec_create(made.container_id, spinning)
        spin = await host.native.exec_start(spin_id, b"")
        answers = await asyncio.gather(*(one(n) for n in range(16)))
        assert await host.native.exec_kill(spin_id), "a call is killed by hanging up"
        while await spin.read(1.0) is not None:  # its connection closed: the read ends
            pass
        assert (await host.native.exec_inspect(spin_id)).exit_code == 137
        return answers

    answers = asyncio.run(many())
    assert answers == [(0, b"call %d" % n) for n in range(16)], "a spinning call holds no one"
    host.manager.destroy(made.id)


def test_a_wasm_pool_keeps_workers_ready_for_its_plugin_and_learns_one_from_demand(
    tmp_path: Path, toolkit: bytes
) -> None:
    sha = digest(toolkit)
    table = (
        f'[[pool]]\nuser = "al-ice"\nproject = "p"\nsize = 1\nmemory = "128m"\n'
        f'backend = "wasm"\nwasm_sha256 = "{sha}"\n'
        "[pool_learning]\nenabled = true\nuses = 2\n"
    )
    host = Host(tmp_path, table, deadlines=True)
    host.native.plugins.put("al-ice", toolkit)  # a declared pool's plugin: its user's
    pool = WarmPool(host.manager, executor=ThreadPoolExecutor(2), now=lambda: NOW)
    try:
        pool.configure(host.manager.config)
        pool.refill()
        wait_until(lambda: pool.stats().pools[0].ready == 1)
        [ready] = host.manager.find(pool="true")
        member = pool.acquire(wasm_spec(wasm={"sha256": sha}))
        assert member is not None, "a worker ready for the plugin"
        assert member.id == ready.id
        assert host.call(member.container_id, "echo", b"pooled")[1] == b"pooled"
        # Another plugin (uploaded) has no pool: cold twice, then one is learned for it.
        other = toolkit + b"\0\x05\x04name"  # a custom section: another sha256
        upload = {"module": base64.b64encode(other).decode()}
        for _ in range(2):
            assert pool.acquire(wasm_spec(wasm=upload, memory="64m")) is None
            created(host.manager, wasm_spec(wasm=upload, memory="64m"))  # what a miss does
        learned = [p for p in pool.stats().pools if p.learned]
        assert [p.key.plugin for p in learned] == [digest(other)]
        pool.refill()
        wait_until(lambda: next(p for p in pool.stats().pools if p.learned).ready == 1)
        assert pool.acquire(wasm_spec(wasm=upload, memory="64m")) is not None
        # A plugin named by path is read at create: no key, no pool.
        assert pool.acquire(wasm_spec(wasm={"path": "/srv/x.wasm"})) is None
    finally:
        pool.shutdown()
        for made in host.manager.find(user="al-ice"):
            host.manager.destroy(made.id)


def test_a_module_the_runtime_refuses_fails_the_create_and_leaves_nothing(tmp_path: Path) -> None:
    host = Host(tmp_path)
    broken = b"\0asm\x01\0\0\0\xff\xff\xff"  # the magic, then no valid section
    with pytest.raises(InvalidRequest) as refused:
        created(host.manager, wasm_spec(wasm={"module": base64.b64encode(broken).decode()}))
    assert refused.value.code == "wasm_invalid"
    assert "cannot be run" in refused.value.message
    assert not [unit for unit in host.systemd.running if "sbx" in unit]
    assert not host.systemd.processes, "its worker is gone with it"
