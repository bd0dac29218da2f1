"""Long work shows its progress (issue 46), on a real host: a local registry (Debian's
``docker-registry``, started here on the guest's loopback) holds images slicebox has not seen,
each with a layer of random bytes of its own.

Four concurrent creates of one image make one pull (the registry's log counts its manifest
requests), all four succeed, the streamed create among them is told each layer's bytes up to
its total, and the agent's thread count stays where it was while the pull runs. A registry
stopped mid-pull (SIGSTOP) ends the create as ``image_pull_failed`` at the configured timeout,
with nothing left behind. ``slicebox create`` on a terminal draws a bar and in a pipe writes
plain lines; ``slicebox cp`` of 200 MiB shows its bytes as they go.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import tempfile
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slicebox.client import Client
from slicebox.model.api import CreateSandbox
from slicebox.model.errors import ImagePullFailed
from slicebox.model.progress import Phase, ProgressEvent
from tests.host.agentunits import SOCKET, admin, agent_config, installed_agent, remove_sandboxes
from tests.host.helpers import TEST_IMAGE, ordinary_user, sh, slicebox_as, wait_for

pytestmark = pytest.mark.host

PORT = 5046
REGISTRY = f"127.0.0.1:{PORT}"
PULL_TIMEOUT = 25
USER = "sbxpull"  # an ordinary user in group slicebox, for the CLI
MiB = 1 << 20
PROJECT = "pulls"


@dataclass
class Registry:
    process: subprocess.Popen[bytes]
    log: Path

    def manifest_gets(self, repository: str) -> int:
        """GETs of ``repository``'s manifests the registry answered (its access log): one a
        pull (a push only PUTs and HEADs them)."""
        pattern = re.compile(rf"/v2/{re.escape(repository)}/manifests/")
        lines = self.log.read_text(errors="replace").splitlines()
        return sum(
            1
            for line in lines
            if pattern.search(line)
            and "response completed" in line
            and "http.request.method=GET" in line
        )


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    with tempfile.TemporaryDirectory(prefix="sbx-registry-") as scratch:
        config = Path(scratch) / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: info\n  formatter: text\n"
            f"storage:\n  filesystem:\n    rootdirectory: {scratch}/data\n"
            f"http:\n  addr: {REGISTRY}\n"
        )
        log = Path(scratch) / "registry.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["docker-registry", "serve", str(config)], stdout=out, stderr=subprocess.STDOUT
            )
        try:
            up = ["curl", "-sf", "-o", "/dev/null", f"http://{REGISTRY}/v2/"]
            wait_for(lambda: sh(*up, check=False).returncode == 0, timeout=60)
            yield Registry(process, log)
        finally:
            os.kill(process.pid, signal.SIGCONT)
            process.terminate()
            process.wait(30)


def pushed(name: str, size: int) -> str:
    """An image in the registry, and not on this host: the test image plus ``size`` random
    bytes of its own layer."""
    image = f"{REGISTRY}/slicebox-test/{name}:1"
    container = sh("docker", "create", TEST_IMAGE).stdout.strip()
    with tempfile.NamedTemporaryFile(prefix="sbx-layer-") as layer:
        layer.write(os.urandom(size))
        layer.flush()
        sh("docker", "cp", layer.name, f"{container}:/random.bin")
    sh("docker", "commit", container, image)
    sh("docker", "rm", container)
    sh("docker", "push", "-q", image)
    sh("docker", "rmi", image)
    return image


def forget(image: str) -> None:
    sh("docker", "rmi", "-f", image, check=False)


@pytest.fixture(scope="module")
def agent(registry: Registry) -> Iterator[Client]:
    config = f"pull_timeout_seconds = {PULL_TIMEOUT}\n" + agent_config()
    with installed_agent(config), ordinary_user(USER):
        sh("systemctl", "start", "slicebox.socket")
        try:
            yield Client(str(SOCKET), timeout=600)
        finally:
            remove_sandboxes()


def agent_threads() -> int:
    pid = sh("systemctl", "show", "-P", "MainPID", "slicebox.service").stdout.strip()
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE)
    assert found is not None
    return int(found.group(1))


def spec(image: str) -> CreateSandbox:
    return CreateSandbox(project=PROJECT, image=image)


def test_four_creates_share_one_pull_that_holds_no_thread_and_tells_each_layer(
    agent: Client, registry: Registry
) -> None:
    image = pushed("shared", 24 * MiB)
    # The calls pool's threads exist once creates have run at once: count from there.
    warm = [
        threading.Thread(target=lambda: agent.destroy(agent.create(spec(TEST_IMAGE)).id))
        for _ in range(4)
    ]
    for thread in warm:
        thread.start()
    for thread in warm:
        thread.join(300)
    before, gets = agent_threads(), registry.manifest_gets("slicebox-test/shared")
    events: list[ProgressEvent] = []
    made: list[str] = []
    failed: list[BaseException] = []

    def create(streamed: bool) -> None:
        try:
            client = Client(str(SOCKET), timeout=600)
            if streamed:
                made.append(client.create_stream(spec(image), events.append).id)
            else:
                made.append(client.create(spec(image)).id)
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=create, args=(n == 0,)) for n in range(4)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    during: list[int] = []
    while any(thread.is_alive() for thread in threads):
        if any(event.phase is Phase.PULLING for event in events) and not any(
            event.phase is Phase.STARTING for event in events
        ):
            during.append(agent_threads())
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    took = time.monotonic() - started
    try:
        assert failed == []
        assert len(made) == 4
        assert registry.manifest_gets("slicebox-test/shared") - gets == 1, "one pull"
        pulled = [event for event in events if event.phase is Phase.PULLING]
        assert pulled, "the streamed create was told the pull"
        big = max(pulled[-1].layers, key=lambda layer: layer.total or 0)
        assert big.total is not None
        assert big.total >= 20 * MiB
        assert big.current == big.total, "the layer's bytes reach its total"
        assert pulled[-1].done == pulled[-1].total
        partial = [layer.current for e in pulled for layer in e.layers if layer.id == big.id]
        assert any(0 < (current or 0) < big.total for current in partial), "told as it went"
        assert during, "the threads were counted while the pull ran"
        assert max(during) - before <= 2, (before, during)
        print(f"four creates with one pull: {took:.1f} s; threads {before} -> {max(during)}")
    finally:
        for box in made:
            agent.destroy(box)
        forget(image)


def test_a_registry_stopped_mid_pull_is_image_pull_failed_at_the_timeout_leaving_nothing(
    agent: Client, registry: Registry
) -> None:
    image = pushed("stopped", 48 * MiB)  # far more than the socket buffers hold
    stopped = threading.Event()

    def on(event: ProgressEvent) -> None:
        if event.phase is Phase.PULLING and (event.done or 0) > 0 and not stopped.is_set():
            os.kill(registry.process.pid, signal.SIGSTOP)
            stopped.set()

    started = time.monotonic()
    try:
        with pytest.raises(ImagePullFailed) as caught:
            agent.create_stream(spec(image), on)
        took = time.monotonic() - started
        assert stopped.is_set(), "the registry was stopped mid-pull"
        assert caught.value.code == "image_pull_failed"
        assert f"did not end within {PULL_TIMEOUT} s" in caught.value.message
        assert PULL_TIMEOUT - 1 <= took <= PULL_TIMEOUT + 30, took
        print(f"a stopped registry failed the create after {took:.1f} s")
    finally:
        os.kill(registry.process.pid, signal.SIGCONT)
    time.sleep(5)  # had dockerd kept the pull, the registry's answers would finish it now
    assert sh("docker", "image", "inspect", image, check=False).returncode != 0
    assert [box.id for box in agent.list_sandboxes()] == []
    listed = sh("docker", "ps", "-aq", "--filter", f"ancestor={image}").stdout.strip()
    assert listed == ""
    units = sh("systemctl", "list-units", "--all", "--plain", "--no-legend", f"*{PROJECT}*")
    assert units.stdout.strip() == ""
    forget(image)


def as_user(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return slicebox_as(USER, *argv)


def on_a_terminal(*argv: str) -> tuple[int, bytes]:
    """``slicebox argv`` as the user with a pty for its stdin, stdout and stderr."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a window
    process = subprocess.Popen(
        ["runuser", "-u", USER, "--", "slicebox", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(slave)
    said = bytearray()
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                piece = os.read(master, 65536)
            except OSError:  # the slave side closed: the command ended
                break
            if not piece:
                break
            said += piece
        elif process.poll() is not None:
            break
    os.close(master)
    return process.wait(600), bytes(said)


def test_the_cli_draws_a_bar_on_a_terminal_and_plain_lines_in_a_pipe(agent: Client) -> None:
    image = pushed("cli", 24 * MiB)
    made: list[str] = []
    try:
        code, drawn = on_a_terminal("create", "--project", PROJECT, "--image", image)
        assert code == 0, drawn
        made.append(drawn.decode(errors="replace").strip().splitlines()[-1].strip())
        assert b"pulling" in drawn
        assert b"\r" in drawn, "a bar redraws its line"
        assert b"%|" in drawn, "tqdm's bar"
        assert b"24.0M/24.0M" in drawn or b"24.1M/24.1M" in drawn, drawn
        for box in made:
            agent.destroy(box)
        made.clear()
        forget(image)  # pulled again, now in a pipe
        piped = as_user("create", "--project", PROJECT, "--image", image)
        assert piped.returncode == 0, piped.stderr
        made.append(piped.stdout.decode().strip())
        lines = piped.stderr.decode().splitlines()
        assert b"\r" not in piped.stderr
        assert any(line.startswith(f"pulling {image}: ") for line in lines), lines
        finished = r"pulling .*: (\d+(\.\d+)? MiB) of \1, \d+/\d+ layers"
        assert re.search(finished, piped.stderr.decode()), lines
        quiet = as_user("-q", "create", "--project", PROJECT, "--image", image)
        assert (quiet.returncode, quiet.stderr) == (0, b"")
        made.append(quiet.stdout.decode().strip())
    finally:
        for box in made:
            agent.destroy(box)
        forget(image)


def test_cp_of_200_mib_shows_its_bytes_as_they_go(agent: Client) -> None:
    # Its tmpfs /workspace is half its memory: room for the 200 MiB (as tests/host/test_files.py).
    box = as_user("-q", "create", "--project", PROJECT, "--memory", "640MB")
    assert box.returncode == 0, box.stderr
    sandbox = box.stdout.decode().strip()
    with tempfile.TemporaryDirectory(prefix="sbx-cp-") as scratch:
        tree = Path(scratch) / "tree"
        tree.mkdir()
        for n in range(4):
            (tree / f"part{n}.bin").write_bytes(os.urandom(50 * MiB))
        sh("chown", "-R", USER, scratch)
        try:
            started = time.monotonic()
            sent = as_user("cp", str(tree), f"{sandbox}:/workspace/tree")
            took = time.monotonic() - started
            assert sent.returncode == 0, sent.stderr
            lines = sent.stderr.decode().splitlines()
            assert len(lines) >= 2, lines
            assert lines[-1].endswith(", done"), lines
            assert re.search(r": 200(\.\d)? MiB, done$", lines[-1]), lines
            quiet = as_user("-q", "cp", f"{sandbox}:/workspace/tree/part0.bin", f"{scratch}/back")
            assert (quiet.returncode, quiet.stderr) == (0, b"")
            print(f"cp of 200 MiB in: {took:.1f} s, {len(lines)} lines of progress")
        finally:
            agent.destroy(sandbox)


def test_nothing_is_left(agent: Client) -> None:
    assert admin().list_sandboxes() == []
