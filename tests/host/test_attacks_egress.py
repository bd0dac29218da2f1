"""Hostile code in an egress sandbox, and a hostile tenant's allow-list (issue 38), through the
installed agent on a real host.

What an egress sandbox may never reach, whatever its list names: the host (its sshd on port 22,
any other port on the gateway or on any of its addresses; the operator has even named one of
them internal here, so only the packet rules stand between), a metadata address (169.254.169.254
on a dummy link of the guest, with a listener), another sandbox. What a list may never name:
``0.0.0.0/0``, the gateway, the metadata address (``policy_egress`` at create). Bridge sandboxes of
two users cannot reach each other. A flood of denied names and of TCP connections to the
resolver from one sandbox leaves the agent small and its API answering.

Everything stays in the guest: the world's namespace (``tests.host.egressworld``), a dummy link,
Docker's networks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from slicebox.client import Client
from slicebox.model.api import CreateSandbox, SandboxView
from slicebox.model.errors import SliceboxError
from slicebox.model.exec import ExecRequest
from tests.host import egressworld as w
from tests.host.agentunits import SOCKET, agent_config, installed_agent, prop
from tests.host.helpers import ordinary_user, sh, unique, wait_for

pytestmark = pytest.mark.host

GATEWAY = "10.213.0.1"
METADATA = "169.254.169.254"
META_LINK = "sbxt-meta"
HOST_PORT = 18082
USERS = ("sbxealice", "sbxebob")
# The host's side of the world's veth, named internal by the operator: an entry may name it,
# and still nothing on the host answers (the packet rules, not the list, keep the host out).
CONFIG = (
    'allowed_networks = ["none", "bridge"]\n'
    + agent_config()
    + f'[egress]\nupstream = ["{w.NAMESERVER}"]\n'
    + f'internal_networks = ["{w.INTERNAL}", "{w.HOST_ADDRESS}/32"]\n'
    + '[[egress.rule]]\nusers = ["*"]\n'
)
MiB = 1024 * 1024

UDP_FLOOD = """
import socket, struct, sys
count, sent = int(sys.argv[1]), 0
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setblocking(False)
for n in range(count):
    labels = [b"d%d" % n, b"nowhere", b"test"]
    name = b"".join(bytes([len(l)]) + l for l in labels) + b"\\0"
    query = struct.pack(">HHHHHH", n & 0xFFFF, 0x0100, 1, 0, 0, 0) + name + b"\\0\\1\\0\\1"
    try:
        sock.sendto(query, (sys.argv[2], 53))
        sent += 1
    except (BlockingIOError, OSError):
        pass
    if n % 64 == 0:
        try:
            while True:
                sock.recv(4096)
        except OSError:
            pass
print(sent)
"""

TCP_HOLD = """
import socket, sys, time
held = []
for _ in range(int(sys.argv[1])):
    try:
        held.append(socket.create_connection((sys.argv[2], 53), timeout=5))
    except OSError:
        pass
print(len(held), flush=True)
time.sleep(float(sys.argv[3]))
"""


class _Listener(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"a host service answered\n")

    def log_message(self, format: str, *args: object) -> None:
        return


def _serve(address: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((address, port), _Listener)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def agent() -> Iterator[Client]:
    sh("ip", "link", "del", META_LINK, check=False)
    sh("ip", "link", "add", META_LINK, "type", "dummy")
    servers: list[ThreadingHTTPServer] = []
    try:
        sh("ip", "addr", "add", f"{METADATA}/32", "dev", META_LINK)
        sh("ip", "link", "set", META_LINK, "up")
        servers += [_serve(METADATA, 80), _serve("0.0.0.0", HOST_PORT)]
        with (
            w.world(),
            installed_agent(CONFIG, start_limit=False),
            ordinary_user(USERS[0]),
            ordinary_user(USERS[1]),
        ):
            sh("systemctl", "start", "slicebox.service")
            client = Client(str(SOCKET), timeout=300)
            client.health()
            try:
                yield client
            finally:
                for sandbox in client.list_sandboxes():
                    client.destroy(sandbox.id)
    finally:
        for server in servers:
            server.shutdown()
        sh("ip", "link", "del", META_LINK, check=False)
        sh("nft", "delete", "table", "inet", "slicebox", check=False)
        for network in ("slicebox-egress", "slicebox-bridge"):
            sh("docker", "network", "rm", network, check=False)


def create(client: Client, body: dict[str, object]) -> SandboxView:
    return client.create(CreateSandbox.model_validate({"project": unique("atk-"), **body}))


def egress(allow: list[str]) -> dict[str, object]:
    return {"network": {"egress": {"allow": allow}}}


@pytest.fixture(scope="module")
def boxes(agent: Client) -> dict[str, SandboxView]:
    """x names the host's (internal) address and a world name; y serves on port 8000."""
    made = {
        "x": create(agent, egress([w.HOST_ADDRESS, "pkgs.test"])),
        "y": create(agent, egress(["pkgs.test"])),
    }
    run(agent, made["y"], "httpd -p 8000 -h /")  # it forks into the background
    return made


def run(agent: Client, sandbox: SandboxView, command: str) -> str:
    request = ExecRequest.model_validate(
        {"argv": command, "shell": True, "timeout": 30, "cwd": "/"}
    )
    result = agent.exec(sandbox.id, request)
    return f"{result.exit_code}:" + result.stdout.decode(errors="replace")


def reaches(agent: Client, sandbox: SandboxView, *targets: tuple[str, int]) -> dict[str, str]:
    """What TCP connections from the sandbox got, all at once (a dropped SYN costs its
    timeout): per ``address:port``, an SSH banner, an HTTP answer or wget's error, or ''."""
    probes = " ".join(
        f"( echo | timeout 5 nc -w 3 {a} {p}; wget -q -O - -T 3 http://{a}:{p}/ ) 2>&1 "
        f'| sed "s/^/{a}:{p} /" &'
        for a, p in targets
    )
    out = run(agent, sandbox, f"{probes} wait")
    got = {f"{a}:{p}": "" for a, p in targets}
    for line in out.partition(":")[2].splitlines():
        target, _, text = line.partition(" ")
        if target in got:
            got[target] += text + "\n"
    return got


def connected(got: str) -> bool:
    """An SSH banner or any HTTP answer (wget's errors quote the status line)."""
    return "SSH-" in got or "HTTP/" in got or "answered" in got


def ip_of(container_id: str) -> str:
    """The address on the one network it is on (slicebox-bridge now; docker0 before)."""
    out = sh("docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", container_id)
    [network] = json.loads(out.stdout).values()
    return str(network["IPAddress"])


def test_an_entry_for_all_space_the_gateway_or_metadata_is_refused(agent: Client) -> None:
    guest = sh("ip", "-4", "-j", "route", "get", "1.1.1.1").stdout
    own = json.loads(guest)[0]["prefsrc"]  # the guest's own address on its uplink
    for entry in ("0.0.0.0/0", GATEWAY, METADATA, "10.213.0.0/16:22", "127.0.0.1", own):
        with pytest.raises(SliceboxError) as refused:
            create(agent, egress([entry]))
        assert refused.value.code == "policy_egress", entry
        assert "internal_networks" in refused.value.message
    assert agent.list_sandboxes() == [], "nothing made"


def test_the_host_the_gateway_metadata_and_a_neighbour_are_out_of_reach(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    x, y = boxes["x"], boxes["y"]
    assert f"hello from {w.PKGS}" in run(agent, x, "wget -q -O - -T 4 http://pkgs.test:8000/")
    neighbour = ip_of(y.container_id)
    targets = [(a, p) for a in (w.HOST_ADDRESS, GATEWAY) for p in (22, HOST_PORT)]
    got = reaches(agent, x, *targets, (METADATA, 80), (neighbour, 8000))
    assert not [target for target, text in got.items() if connected(text)], got
    control = reaches(agent, y, (neighbour, 8000))  # y itself: its server does answer
    assert connected(control[f"{neighbour}:8000"]), control
    usage = agent.usage(x.id).egress
    assert usage is not None
    host = sh("nft", "-j", "list", "counter", "inet", "slicebox", "host").stdout
    assert json.loads(host)["nftables"][1]["counter"]["packets"] > 0, "dropped on the host"


def _as(user: str, *argv: str) -> str:
    done = subprocess.run(
        ["runuser", "-u", user, "--", "slicebox", "--json", *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_bridge_sandboxes_of_two_users_cannot_reach_each_other(agent: Client) -> None:
    alice = json.loads(_as(USERS[0], "create", "--project", "br", "--network", "bridge"))
    bob = json.loads(_as(USERS[1], "create", "--project", "br", "--network", "bridge"))
    try:
        sh("docker", "exec", alice["container_id"], "httpd", "-p", "8000", "-h", "/")
        address = ip_of(alice["container_id"])
        fetch = ["wget", "-q", "-O", "-", "-T", "4", f"http://{address}:8000/"]
        own = sh("docker", "exec", alice["container_id"], *fetch, check=False)
        assert connected(own.stdout + own.stderr), "alice's server answers alice"
        got = sh("docker", "exec", bob["container_id"], *fetch, check=False)
        assert not connected(got.stdout + got.stderr), got
        networks = sh("docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", bob["id"])
        assert list(json.loads(networks.stdout)) == ["slicebox-bridge"], "not docker0"
    finally:
        _as(USERS[0], "rm", alice["id"])
        _as(USERS[1], "rm", bob["id"])


def _rss() -> int:
    pid = prop("slicebox.service", "MainPID")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _nsenter(sandbox: SandboxView) -> list[str]:
    pid = sh("docker", "inspect", "-f", "{{.State.Pid}}", sandbox.container_id).stdout.strip()
    return ["nsenter", "-n", "-t", pid, sys.executable, "-c"]


def _health_within(agent: Client, seconds: float) -> None:
    started = time.monotonic()
    Client(str(SOCKET), timeout=seconds).health()
    assert time.monotonic() - started < seconds


def test_a_resolver_flood_leaves_the_agent_small_and_answering(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    y = boxes["y"]
    before = _rss()
    flood = sh(*_nsenter(y), UDP_FLOOD, "100000", GATEWAY)
    assert int(flood.stdout) > 50_000, "the sender sent"
    _health_within(agent, 5)
    hold = subprocess.Popen(
        [*_nsenter(y), TCP_HOLD, "300", GATEWAY, "40"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert hold.stdout is not None
        held = int(hold.stdout.readline())
        assert held > 200, held
        for _ in range(3):
            _health_within(agent, 5)
            time.sleep(1)
        usage = agent.usage(y.id).egress
        assert usage is not None
        assert usage.refused_connections >= 200, usage
        assert usage.dropped_queries > 0, usage
        assert usage.denied_names + usage.dropped_queries > 10_000, usage
        assert _rss() - before < 32 * MiB, (before, _rss())
    finally:
        hold.kill()
        hold.wait()
    wait_for(lambda: "pkgs.test" in run(agent, y, "nslookup pkgs.test 2>&1"), timeout=60)
