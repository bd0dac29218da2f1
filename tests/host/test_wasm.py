"""The wasm backend on a real host (issue 17): Extism plugins called in a sandbox slice of
the tree, bounded by the kernel there and by Extism inside, through the agent's create path.

The plugin is the project's own (``tests/wasm/toolkit.wat``, compiled here with wabt). One wasm
sandbox (128 MB), whose anchor is the worker that answers every call, serves most of the
module; the HTTP test adds one whose allow-list names the guest's loopback address, where a
server of the test's answers; the last test goes through the installed agent and the
``slicebox`` command, as a user would.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slicebox.backends.native.names import ANCHOR_PREFIX
from slicebox.backends.wasmrun import EXIT_NO_FUNCTION
from slicebox.client import Client
from slicebox.core.sandbox import Sandbox
from slicebox.host.plugins import PluginStore
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.exec import ExecRequest
from slicebox.model.names import MANAGED_SLICE, slice_names
from slicebox.model.spec import SandboxSpec
from slicebox.model.wasm import digest
from tests.fakes.threadside import ThreadSide, created
from tests.host.agentunits import SOCKET, agent_config, installed_agent
from tests.host.helpers import CGROUP_ROOT, sh, wait_for
from tests.host.sliceboxhost import active, cleanup_slices
from tests.host.test_native import Native, only_the_anchor, processes, slice_dir
from tests.wasm.build import TOOLKIT, build

pytestmark = pytest.mark.host

MB = 1024 * 1024


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(TOOLKIT, tmp_path_factory.mktemp("wasm"))


class Wasm(Native):
    def spec(self, project: str, **fields: object) -> SandboxSpec:
        base = {"user": self.user, "project": project, "backend": "wasm"}
        return SandboxSpec.model_validate(base | fields)


@pytest.fixture(scope="module")
def wasm(toolkit: Path) -> Iterator[Wasm]:
    managed_was_active = active(MANAGED_SLICE)
    # Egress is closed by default, and loopback refused unless the operator names it internal:
    # this operator lets a plugin reach the test's server on 127.0.0.1.
    made = Wasm('[egress]\ninternal_networks = ["127.0.0.1/32"]\n[[egress.rule]]\n')
    yield made
    made.cleanup()
    PluginStore().path(made.user, digest(toolkit.read_bytes())).unlink(missing_ok=True)
    if not managed_was_active:
        cleanup_slices(MANAGED_SLICE)


def module_of(path: Path) -> dict[str, str]:
    return {"module": b64(path.read_bytes())}


def b64(data: bytes) -> str:
    """An exec's stdin as the wire carries it."""
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def box(wasm: Wasm, toolkit: Path) -> Iterator[Sandbox]:
    made = created(wasm.manager, wasm.spec("plugins", memory="128MB", wasm=module_of(toolkit)))
    try:
        yield made
    finally:
        assert wasm.manager.destroy(made.id) is not None


@pytest.fixture
def clean_box(box: Sandbox) -> Iterator[Sandbox]:
    """Each call's unit is gone after it: nothing in the slice but the sandbox's anchor."""
    yield box
    wait_for(lambda: only_the_anchor(box), timeout=30, step=0.2)


def test_echo_and_count_give_exact_output(wasm: Wasm, clean_box: Sandbox) -> None:
    data = bytes(range(256)) * 64
    echoed = wasm.run(clean_box, argv=["echo"], stdin=b64(data))
    assert (echoed.exit_code, echoed.stdout, echoed.stderr) == (0, data, b"")
    counted = wasm.run(clean_box, argv=["count_vowels"], stdin=b64(b"slicebox wasm"))
    assert (counted.exit_code, counted.stdout) == (0, b"4")
    missing = wasm.run(clean_box, argv=["no_such_function"])
    assert missing.exit_code == EXIT_NO_FUNCTION
    assert b"no function" in missing.stderr


def test_a_loop_times_out_at_the_requested_time_with_124(wasm: Wasm, clean_box: Sandbox) -> None:
    started = time.monotonic()
    result = wasm.run(clean_box, argv=["spin"], timeout=2)
    took = time.monotonic() - started
    assert (result.exit_code, result.timed_out) == (124, True), result
    assert 1.5 <= result.duration <= 15, result.duration
    assert took < 30


def test_a_memory_grower_is_stopped_by_its_pages(wasm: Wasm, clean_box: Sandbox) -> None:
    result = wasm.run(clean_box, argv=["grow"], timeout=60)
    assert result.oom_killed, result
    assert result.exit_code == 137
    assert b"1024 pages" in result.stderr, "128 MB less the worker's 64 MB, in 64 KiB pages"
    assert wasm.run(clean_box, argv=["echo"], stdin=b64(b"alive")).stdout == b"alive"


def test_the_worker_runs_in_the_sandbox_slice_under_the_project_and_is_counted_there(
    wasm: Wasm, clean_box: Sandbox
) -> None:
    directory = slice_dir(clean_box)
    project = CGROUP_ROOT / MANAGED_SLICE / slice_names(wasm.user, "plugins").user
    assert directory.parent == project / slice_names(wasm.user, "plugins").project
    assert (directory / "memory.max").read_text().strip() == str(128 * MB)
    # Its one process is the worker, the sandbox's anchor: Python and Extism, loaded once.
    [(unit, [pid])] = processes(directory).items()
    assert unit == f"{ANCHOR_PREFIX}{clean_box.id}.service"
    assert b"slicebox.backends.wasmrun" in Path(f"/proc/{pid}/cmdline").read_bytes()
    echoed = wasm.run(clean_box, argv=["echo"], stdin=b64(b"x" * MB), output_cap=2 * MB)
    assert echoed.stdout == b"x" * MB
    tree = ThreadSide(wasm.service).level_tree(wasm.who).model_dump()
    unit = clean_box.container_id
    nodes = [s for p in tree["children"] for s in p["children"] if s["unit"] == unit]
    assert nodes, tree
    assert nodes[0]["memory_peak"] > 4 * MB, "the worker's memory is the sandbox's"


@contextlib.contextmanager
def web_server(root: Path) -> Iterator[int]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_plugin_reaches_an_allowed_host_and_no_other(
    wasm: Wasm, box: Sandbox, toolkit: Path, tmp_path: Path
) -> None:
    (tmp_path / "hello.txt").write_text("hello from the guest\n")
    allow = {"egress": {"allow": ["127.0.0.1"]}}
    made = created(wasm.manager, wasm.spec("http", wasm=module_of(toolkit), network=allow))
    try:
        with web_server(tmp_path) as port:
            url = f"http://127.0.0.1:{port}/hello.txt"
            allowed = wasm.run(made, argv=["http_get"], stdin=b64(url.encode()))
            assert (allowed.exit_code, allowed.stdout) == (0, b"hello from the guest\n"), allowed
            other = f"http://localhost:{port}/hello.txt"  # the same server, a host not allowed
            refused = wasm.run(made, argv=["http_get"], stdin=b64(other.encode()))
            assert refused.exit_code == 1, refused
            assert refused.stdout == b""
            # No host allowed (and no network): the same URL fails in the first sandbox.
            none = wasm.run(box, argv=["http_get"], stdin=b64(url.encode()))
            assert none.exit_code == 1, none
    finally:
        wasm.manager.destroy(made.id)


def test_the_installed_agent_runs_a_plugin_from_the_command_line(toolkit: Path) -> None:
    with installed_agent():
        sh("systemctl", "start", "slicebox.socket")
        argv = ["slicebox", "run", "--project", "wasm-cli", "--plugin", str(toolkit)]
        ran = subprocess.run(
            [*argv, "--function", "count_vowels", "--", "hello", "world"],
            capture_output=True,
            check=False,
            timeout=600,
        )
        assert (ran.returncode, ran.stdout) == (0, b"3"), ran.stderr
        doctor = json.loads(sh("slicebox", "--json", "doctor").stdout)
        checks = {check["name"]: check for check in doctor}
        assert checks["wasm backend"]["state"] == "ok", checks["wasm backend"]
        wait_for(lambda: not cli_sandboxes(), timeout=60)
        # Many agents calling one wasm sandbox at once through the socket: each its own answer.
        box = Client(str(SOCKET)).create(
            CreateSandbox(project="wasm-cli", backend="wasm", wasm=module_of(toolkit))
        )

        def call(n: int) -> bytes:
            request = ExecRequest(argv=("echo",), stdin=b"call %d" % n)
            return Client(str(SOCKET)).exec(box.id, request).stdout

        try:
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(call, range(16)))
        finally:
            Client(str(SOCKET)).destroy(box.id)
        assert answers == [b"call %d" % n for n in range(16)]
        held = PluginStore().path("root", digest(toolkit.read_bytes()))
        assert held.exists(), "the agent holds the plugin as its caller's, by its sha256"
        held.unlink()


def cli_sandboxes() -> list[object]:
    """The sandboxes of the command line's project: its one-shot's is removed after it."""
    listed = json.loads(sh("slicebox", "--json", "ps").stdout)
    return [view for view in listed if view["project"] == "wasm-cli"]


def test_a_plugin_run_again_and_again_gets_a_pool_of_ready_workers(toolkit: Path) -> None:
    """Pools learned from demand serve wasm one-shots too: the key is the plugin's sha256 with
    the sandbox's owner and limits, and a member is a worker with Extism loaded, ready."""
    config = agent_config() + "[pool_learning]\nenabled = true\nuses = 2\n"
    with installed_agent(config):
        sh("systemctl", "start", "slicebox.service")
        client = Client(str(SOCKET))
        spec = CreateSandbox(project="wasm-pool", backend="wasm", wasm=module_of(toolkit))
        run = RunRequest(sandbox=spec, exec=ExecRequest(argv=("echo",), stdin=b"again"))
        try:
            for _ in range(2):  # cold: the second one teaches the pool
                assert client.run(run).result.stdout == b"again"
            wait_for(lambda: any(p.ready for p in client.pools().pools), timeout=120, step=0.5)
            [learned] = client.pools().pools
            assert (learned.key.backend, learned.key.plugin) == (
                "wasm",
                digest(toolkit.read_bytes()),
            )
            started = time.monotonic()
            pooled = client.run(run)
            took = time.monotonic() - started
            assert pooled.result.stdout == b"again"
            assert client.pools().pools[0].hits == 1, "the third run came from the pool"
            print(f"pooled wasm one-shot: {took * 1000:.0f} ms")
        finally:
            for view in client.list_sandboxes():
                if view.project == "wasm-pool":
                    client.destroy(view.id)
