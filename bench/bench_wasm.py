"""Bench: a WebAssembly plugin run against a native exec and a pooled Docker run, one guest run.

    tests/guest/run python3 -m bench.bench_wasm [--rounds N]

The agent is the real service (the checkout's units) with one ``[[pool]]`` of size 2, so its
Docker one-shots come from the warm pool; every call goes through its socket with the
project's client. The plugin is the project's test plugin (``tests/wasm/toolkit.wat``),
its ``echo`` given ``hi``. Per round, interleaved:

- ``wasm-cold``: a one-shot run (``POST /v1/run``, backend wasm) of a plugin the agent has not
  seen (the module with a custom section of its own, so another sha256): upload, store,
  create, call, destroy;
- ``wasm-cached``: the same run of the plugin by its sha256 (held by the agent already);
- ``wasm-pooled``: the same run from a ``[[pool]]`` of wasm workers for that plugin (each
  pooled run waits until the pool has a member ready, as the Docker side does);
- ``docker-pooled``: the one-shot ``echo hi`` from the warm pool;
- ``wasm-call`` and ``native-exec``: one call in a wasm sandbox that lives across the rounds,
  and one ``echo hi`` exec in a native sandbox alike: the cost of a call itself.

The ratios (medians) are the result: the guest is emulated, so the absolute times (printed
too) are many times a real host's. The seeds' target is a cold plugin start under 50 ms.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import subprocess
import tempfile
from pathlib import Path

from tests.host.agentunits import SOCKET, agent_config, installed_agent
from tests.host.helpers import wait_for
from tests.host.sliceboxhost import cleanup_slices
from tests.wasm.build import TOOLKIT, build

from bench.bench_pool import POOL, PROJECT, USER, run_request, timed
from slicebox.client import Client
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.exec import ExecRequest
from slicebox.model.names import slice_names
from slicebox.model.wasm import digest

WASM_PROJECT = "wasm"
CALL = ExecRequest(argv=("echo",), stdin=b"hi")
ECHO = ExecRequest(argv=("echo", "hi"))


def with_section(module: bytes, payload: bytes) -> bytes:
    """``module`` with a custom section appended: the same code, another sha256."""
    name = b"slicebox-bench"
    body = bytes([len(name)]) + name + payload
    assert len(body) < 128, "one-byte LEB128 sizes"
    return module + bytes([0, len(body)]) + body


class Sides:
    def __init__(self, client: Client, module: bytes) -> None:
        self.client = client
        self.module = module
        self.sha = digest(module)
        self.times: dict[str, list[float]] = {}
        self.serial = 0

    def record(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def wasm_run(self, plugin: dict[str, str], memory: str = "64MB") -> None:
        """A one-shot wasm run; 64MB is the pool's key, any other memory limit is cold."""
        spec = CreateSandbox(
            user=USER, project=WASM_PROJECT, backend="wasm", wasm=plugin, memory=memory
        )
        ran = self.client.run(RunRequest(sandbox=spec, exec=CALL))
        assert (ran.result.exit_code, ran.result.stdout) == (0, b"hi"), ran

    def round(self, wasm_box: str, native_box: str) -> None:
        self.serial += 1
        fresh = with_section(self.module, str(self.serial).encode())
        upload = {"module": base64.b64encode(fresh).decode()}
        self.record("wasm-cold", timed(lambda: self.wasm_run(upload, "96MB")))
        self.record("wasm-cached", timed(lambda: self.wasm_run({"sha256": self.sha}, "96MB")))
        wait_for(lambda: self.ready("wasm"), timeout=300, step=0.5)
        self.record("wasm-pooled", timed(lambda: self.wasm_run({"sha256": self.sha})))
        wait_for(lambda: self.ready("docker"), timeout=300, step=0.5)
        self.record("docker-pooled", timed(self.pooled))
        self.record("wasm-call", timed(lambda: self.call(wasm_box, CALL, b"hi")))
        self.record("native-exec", timed(lambda: self.call(native_box, ECHO, b"hi\n")))

    def ready(self, backend: str) -> bool:
        return any(p.ready > 0 and p.key.backend == backend for p in self.client.pools().pools)

    def pooled(self) -> None:
        ran = self.client.run(run_request("64MB"))
        assert ran.result.stdout == b"hi\n", ran

    def call(self, sandbox: str, request: ExecRequest, expected: bytes) -> None:
        result = self.client.exec(sandbox, request)
        assert (result.exit_code, result.stdout) == (0, expected), result


def report(times: dict[str, list[float]]) -> None:
    p50 = {name: statistics.median(samples) for name, samples in times.items()}
    for name, samples in times.items():
        print(f"{name:14} p50 {p50[name] * 1000:7.0f} ms  ({len(samples)} runs)")
    print(f"RATIO wasm-cold/docker-pooled {p50['wasm-cold'] / p50['docker-pooled']:.2f}")
    print(f"RATIO wasm-cached/docker-pooled {p50['wasm-cached'] / p50['docker-pooled']:.2f}")
    print(f"RATIO wasm-pooled/docker-pooled {p50['wasm-pooled'] / p50['docker-pooled']:.2f}")
    print(f"RATIO wasm-cold/wasm-cached {p50['wasm-cold'] / p50['wasm-cached']:.2f}")
    print(f"RATIO wasm-call/native-exec {p50['wasm-call'] / p50['native-exec']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        module = build(TOOLKIT, Path(scratch)).read_bytes()
    store = Path("/var/cache/slicebox/wasm")
    wasm_pool = (
        f'[[pool]]\nuser = "{USER}"\nproject = "{WASM_PROJECT}"\nsize = 2\nmemory = "64MB"\n'
        f'backend = "wasm"\nwasm_sha256 = "{digest(module)}"\n'
    )
    with installed_agent(agent_config() + POOL + wasm_pool):
        subprocess.run(["systemctl", "start", "slicebox.service"], check=True)
        client = Client(str(SOCKET))
        sides = Sides(client, module)
        plugin = {"module": base64.b64encode(module).decode()}
        wasm_box = client.create(
            CreateSandbox(user=USER, project=WASM_PROJECT, backend="wasm", wasm=plugin)
        ).id
        native_box = client.create(
            CreateSandbox(user=USER, project=WASM_PROJECT, backend="native")
        ).id
        try:
            sides.round(wasm_box, native_box)  # warm-up: slices, imports, page cache
            sides.times.clear()
            for _ in range(args.rounds):
                sides.round(wasm_box, native_box)
        finally:
            for sandbox in (wasm_box, native_box):
                client.destroy(sandbox)
            for name in (WASM_PROJECT, PROJECT):
                names = slice_names(USER, name)
                cleanup_slices(names.project)
            cleanup_slices(slice_names(USER, PROJECT).user)
            for held in store.glob("*.wasm"):  # what this bench uploaded
                held.unlink()
    report(sides.times)


if __name__ == "__main__":
    main()
