"""Egress by allow-list on a real host (issue 18), through the installed agent's create path.

A world inside the guest (``tests.host.egressworld``: a namespace with HTTP servers and a DNS
zone on private addresses the agent's config declares internal) stands for the outside. The
sandboxes are real containers on slicebox's egress bridge; their names go through Docker's
resolver to the agent's, and their packets through slicebox's nftables table.

One module-wide agent serves the tests in order, on four sandboxes made at once (and destroyed at
once at the end): each its own address and list, what a sandbox reaches and not, sandbox to
sandbox and to the host, counters and the audit summary, then ``kill -9`` of the agent (the
rules hold, the restarted agent serves names again), then the clean-up after destroy.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

import pytest

from slicebox.client import Client
from slicebox.host.nft import key_of
from slicebox.model.api import CreateSandbox, SandboxView
from slicebox.model.exec import ExecRequest
from tests.host import egressworld as w
from tests.host.agentunits import SOCKET, agent_config, installed_agent, prop
from tests.host.helpers import journal_records, sh, unique, wait_for

pytestmark = pytest.mark.host

GATEWAY = "10.213.0.1"
HOST_PORT = 18081
ALLOW = ["pkgs.test", "*.wild.test", f"{w.LISTED}", "port.test:8080"]
CONFIG = agent_config() + (
    f'[egress]\nupstream = ["{w.NAMESERVER}"]\ninternal_networks = ["{w.INTERNAL}"]\n'
    "[[egress.rule]]\n"  # closed by default: this operator lets anyone ask for anything
)


class _Host(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"the host's own service\n")

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture(scope="module")
def agent() -> Iterator[Client]:
    host = ThreadingHTTPServer(("0.0.0.0", HOST_PORT), _Host)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        with w.world(), installed_agent(CONFIG, start_limit=False):
            sh("systemctl", "start", "slicebox.service")
            client = Client(str(SOCKET), timeout=300)
            client.health()
            yield client
            for sandbox in client.list_sandboxes():
                client.destroy(sandbox.id)
    finally:
        host.shutdown()
        sh("nft", "delete", "table", "inet", "slicebox", check=False)
        sh("docker", "network", "rm", "slicebox-egress", check=False)


# Made at once, each by a client of its own, in one new project: as parallel tool calls arrive.
LISTS = {
    "a": ALLOW,
    "b": ["other.test"],
    "c": [w.LISTED],  # an address alone
    "d": ["pkgs.test"],  # a name alone
}


@pytest.fixture(scope="module")
def boxes(agent: Client) -> dict[str, SandboxView]:
    project = unique("egress-")

    def create(allow: list[str]) -> SandboxView:
        body = {"project": project, "network": {"egress": {"allow": allow}}}
        return Client(str(SOCKET), timeout=300).create(CreateSandbox.model_validate(body))

    with ThreadPoolExecutor(max_workers=len(LISTS)) as pool:
        made = {key: pool.submit(create, allow) for key, allow in LISTS.items()}
        return {key: future.result() for key, future in made.items()}


class Ran(NamedTuple):
    exit_code: int
    stdout: str


def run(agent: Client, sandbox: SandboxView, command: str, timeout: float = 30) -> Ran:
    request = ExecRequest.model_validate(
        {"argv": command, "shell": True, "timeout": timeout, "cwd": "/"}
    )
    result = agent.exec(sandbox.id, request)
    return Ran(result.exit_code, result.stdout.decode(errors="replace"))


def fetch(agent: Client, sandbox: SandboxView, url: str, seconds: int = 4) -> Ran:
    return run(agent, sandbox, f"wget -q -O - -T {seconds} {url} 2>&1")


def dropped(agent: Client, sandbox: SandboxView, url: str) -> Ran:
    """A fetch the rules are to drop: given up after 2 s (an answered one, on this guest's own
    bridge, takes well under a second even under emulation), each a wait the suite pays."""
    return fetch(agent, sandbox, url, seconds=2)


def address(agent: Client, sandbox: SandboxView) -> str:
    out = sh("docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", sandbox.container_id)
    return str(json.loads(out.stdout)["slicebox-egress"]["IPAddress"])


def test_an_allowed_name_answers_and_other_names_do_not_resolve(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    a = boxes["a"]
    assert agent.get(a.id).egress == (
        "pkgs.test",
        "*.wild.test",
        f"{w.LISTED}/32",
        "port.test:8080",
    )
    reached = fetch(agent, a, "http://pkgs.test:8000/")
    assert reached.exit_code == 0, reached.stdout
    assert f"hello from {w.PKGS}:8000" in reached.stdout
    wild = fetch(agent, a, "http://files.wild.test:8000/")
    assert f"hello from {w.WILD}:8000" in wild.stdout, "a wildcard's name"
    refused = fetch(agent, a, "http://other.test:8000/")
    assert refused.exit_code != 0, refused.stdout
    assert "bad address" in refused.stdout, refused.stdout
    looked_up = run(agent, a, "nslookup other.test 2>&1; nslookup pkgs.test 2>&1")
    assert "NXDOMAIN" in looked_up.stdout, looked_up.stdout
    assert w.PKGS in looked_up.stdout, looked_up.stdout


def test_sandboxes_made_at_once_each_get_an_address_and_only_their_own_list(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    """Four creates raced each other for addresses, rules and resolver entries: each has an
    address of its own, and its packets meet its own list, not a neighbour's."""
    addresses = {key: address(agent, box) for key, box in boxes.items()}
    assert len(set(addresses.values())) == len(boxes), addresses
    table = sh("nft", "-j", "list", "table", "inet", "slicebox").stdout
    for box in boxes.values():
        assert key_of(box.id) in table, f"{box.id} has no rules"
    c, d = boxes["c"], boxes["d"]
    assert f"hello from {w.LISTED}:8000" in fetch(agent, c, f"http://{w.LISTED}:8000/").stdout
    assert "bad address" in fetch(agent, c, "http://pkgs.test:8000/").stdout, "not c's name"
    assert f"hello from {w.PKGS}:8000" in fetch(agent, d, "http://pkgs.test:8000/").stdout
    listed = dropped(agent, d, f"http://{w.LISTED}:8000/")
    assert listed.exit_code != 0, "c's address is not d's"
    assert "hello" not in listed.stdout, "c's address is not d's"


def test_an_address_not_allowed_is_dropped_and_lists_and_ports_hold(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    a = boxes["a"]
    literal = dropped(agent, a, f"http://{w.OTHER}:8000/")
    assert literal.exit_code != 0, "the other server's IP"
    assert "hello" not in literal.stdout, "the other server's IP"
    listed = fetch(agent, a, f"http://{w.LISTED}:8000/")
    assert f"hello from {w.LISTED}:8000" in listed.stdout, "an address on the list"
    ported = fetch(agent, a, "http://port.test:8080/")
    assert f"hello from {w.PORTED}:8080" in ported.stdout, ported.stdout
    other_port = dropped(agent, a, "http://port.test:8081/")
    assert other_port.exit_code != 0, "port-limited"
    assert "hello" not in other_port.stdout, "port-limited"


def test_a_private_answer_not_on_the_list_is_refused(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    rebound = fetch(agent, boxes["a"], "http://rebind.wild.test:8000/")
    assert rebound.exit_code != 0, rebound.stdout
    assert "hello" not in rebound.stdout, rebound.stdout
    direct = dropped(agent, boxes["a"], f"http://{w.PRIVATE}:8000/")
    assert direct.exit_code != 0
    assert "hello" not in direct.stdout


def test_sandboxes_cannot_reach_each_other_or_the_host(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    a, b = boxes["a"], boxes["b"]
    run(agent, b, "nohup httpd -f -p 8000 -h / >/dev/null 2>&1 &")
    other = address(agent, b)
    to_b = dropped(agent, a, f"http://{other}:8000/")
    assert to_b.exit_code != 0, "sandbox A reached sandbox B"
    for host in (GATEWAY, w.HOST_ADDRESS):
        to_host = dropped(agent, a, f"http://{host}:{HOST_PORT}/")
        assert "the host's own service" not in to_host.stdout, host
    b_reaches = fetch(agent, b, "http://other.test:8000/")
    assert f"hello from {w.OTHER}:8000" in b_reaches.stdout, "B's own list holds for B"


def test_usage_counts_what_was_allowed_and_denied(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    usage = agent.usage(boxes["a"].id)
    assert usage.egress is not None
    assert usage.egress.allowed_packets > 0
    assert usage.egress.allowed_bytes > 0
    assert usage.egress.denied_packets > 0, "the dropped literal, port, B and the host"
    assert usage.egress.denied_names >= 2, "other.test, twice, and the rebinding answer"


def test_rules_hold_while_the_agent_is_killed_and_its_resolver_returns(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    a = boxes["a"]
    pid = prop("slicebox.service", "MainPID")
    sh("systemctl", "kill", "--signal=SIGKILL", "slicebox.service")
    # While it is down (or restarting), straight through Docker: the kernel's rules hold.
    wget = ["docker", "exec", a.container_id, "wget", "-q", "-O", "-", "-T", "4"]
    assert sh(*wget, f"http://{w.OTHER}:8000/", check=False).returncode != 0
    reached = sh(*wget, f"http://{w.PKGS}:8000/", check=False)
    assert "hello" in reached.stdout, "an address its resolver opened stays open"
    wait_for(lambda: prop("slicebox.service", "MainPID") not in ("0", pid), timeout=120)
    wait_for(lambda: prop("slicebox.service", "ActiveState") == "active", timeout=180)
    again = fetch(agent, a, "http://pkgs.test:8000/")
    assert f"hello from {w.PKGS}:8000" in again.stdout, "the restarted agent serves names"
    assert "bad address" in fetch(agent, a, "http://other.test:8000/").stdout


def test_destroy_leaves_no_rule_and_audits_one_summary(
    agent: Client, boxes: dict[str, SandboxView]
) -> None:
    # What A is refused from now on is in its summary (the agent's tally started anew with
    # the restart above: it lives in the agent, not the kernel).
    fetch(agent, boxes["a"], "http://rebind.wild.test:8000/")
    fetch(agent, boxes["a"], "http://nowhere.test:8000/")
    with ThreadPoolExecutor(max_workers=len(boxes)) as pool:  # at once, as they were made
        destroyed = list(pool.map(lambda box: Client(str(SOCKET)).destroy(box.id), boxes.values()))
    assert [gone.destroyed for gone in destroyed] == [True] * len(boxes)
    table = sh("nft", "-j", "list", "table", "inet", "slicebox").stdout
    for box in boxes.values():
        assert key_of(box.id) not in table, f"{box.id}'s rules are left"
    summaries = journal_records(SLICEBOX_EVENT="egress_summary", SLICEBOX_SANDBOX_ID=boxes["a"].id)
    assert len(summaries) == 1
    detail = summaries[0]["SLICEBOX_DETAIL"]
    for name in ("other.test (", "rebind.wild.test (", "nowhere.test ("):
        assert name in detail, detail
    assert "packets allowed" in detail, detail
