"""Per-user shares through the installed agent (issue 38, finding 3), as real users meet them
(``runuser``, the kernel's uid on the socket): one user holding its whole share of the exec
output budget, of streams and of transfers in flight is refused, with the code of the share and
``Retry-After``, while another user is served the same at that moment.

The agent runs with a small budget so that one held exec fills a share: 24 MiB, half of it per
user, and an exec with a 1 MiB ``output_cap`` reserves 12 MiB (``core.budget``); two streams and
two transfers in flight, one of each per user. Alice holds all three shares with two requests:
a streamed exec that prints one line and sleeps (its stream is read, its output reserved until
it ends) and a download nobody reads (the agent's answer waits on her socket). Her stream's
command prints nothing more after its holder leaves: the agent sees her connection end and
cancels the stream (``web.connection``), killing its command, so her share is free again at
once (issue 60; before, a silent stream held it until the sandbox went). Two sandboxes in all;
they, the users and the holders are gone after.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from tests.host.agentunits import SOCKET, agent_config, installed_agent
from tests.host.helpers import journal_records, ordinary_user, sh, wait_for

pytestmark = pytest.mark.host

ALICE, BOB = "sbxsharea", "sbxshareb"
MiB = 1024 * 1024
CONFIG = (
    f"exec_output_budget = {24 * MiB}\n"
    + agent_config()
    + "[shares]\nuser_share = 0.5\nstreams_in_flight = 2\ntransfers_in_flight = 2\n"
)
HOLD = {
    "argv": ["sh", "-c", "dd if=/dev/zero of=/workspace/big bs=1M count=8 2>/dev/null; echo go; "
             "sleep 600"],
    "output_cap": MiB,
    "timeout": 900,
}  # fmt: skip


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", user, "--", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def call(user: str, method: str, path: str, body: object = None) -> tuple[int, str, str]:
    """One API call as ``user`` with curl: its status, its head and its body."""
    data = ["-H", "Content-Type: application/json", "-d", json.dumps(body)] if body else []
    url = f"http://localhost/v1{path}"
    done = as_user(user, "curl", "-s", "-i", "--unix-socket", str(SOCKET), "-X", method, *data, url)
    head, _, rest = done.stdout.partition("\n\n")  # text mode: CRLF read as LF
    return int(head.split()[1]), head.lower(), rest


@contextmanager
def holding(user: str, method: str, path: str, body: object, until: str) -> Iterator[None]:
    """``tests.host.holder`` as ``user``: the request is held open for the block."""
    argv = ["python3", "-m", "tests.host.holder", method, f"/v1{path}", "--until", until]
    holder = subprocess.Popen(
        ["runuser", "-u", user, "--", *argv, "--body", json.dumps(body) if body else ""],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/src",
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line == "held\n", holder.communicate(timeout=60)[1][-2000:]
        yield
    finally:
        holder.communicate(timeout=120)  # closing its stdin ends it: the agent sees it leave


# --- issue 38 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def boxes() -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        stack.enter_context(installed_agent(CONFIG))
        for user in (ALICE, BOB):
            stack.enter_context(ordinary_user(user))
        sh("systemctl", "start", "slicebox.socket")
        made: dict[str, str] = {}
        try:
            for user in (ALICE, BOB):
                created = as_user(user, "slicebox", "--json", "create", "--project", "shares")
                assert created.returncode == 0, created.stderr
                made[user] = json.loads(created.stdout)["id"]
            yield made
        finally:
            for user, box in made.items():
                as_user(user, "slicebox", "rm", box)


def refused(answer: tuple[int, str, str], code: str) -> None:
    status, head, body = answer
    assert status == 429, (status, body)
    assert "\nretry-after: 1\n" in head
    assert json.loads(body)["code"] == code
    assert "retry after a second" in json.loads(body)["message"]


def test_a_user_holding_her_shares_is_refused_while_another_user_is_served(
    boxes: dict[str, str],
) -> None:
    alice, bob = boxes[ALICE], boxes[BOB]
    small = {"argv": ["echo", "hi"], "output_cap": 1000}
    big = {"argv": ["echo", "hi"], "output_cap": MiB}
    download = "/files?path=/workspace/big&format=file"
    with holding(ALICE, "POST", f"/sandboxes/{alice}/exec/stream", HOLD, '"stream"'):
        # Her 12 MiB share of the output budget and her one stream are held: refused at once.
        refused(call(ALICE, "POST", f"/sandboxes/{alice}/exec", small), "output_share_full")
        refused(call(ALICE, "POST", f"/sandboxes/{alice}/exec/stream", small), "stream_share_full")
        with holding(ALICE, "GET", f"/sandboxes/{alice}{download}", None, "HTTP/1.1 200"):
            refused(call(ALICE, "GET", f"/sandboxes/{alice}{download}"), "transfer_share_full")
            got = call(BOB, "GET", f"/sandboxes/{bob}/files?path=/etc/hostname&format=file")
            assert got[0] == 200, got
        # Bob is served what Alice holds: the budget's other half, the other stream.
        status, _, body = call(BOB, "POST", f"/sandboxes/{bob}/exec", big)
        assert (status, json.loads(body)["exit_code"]) == (200, 0), body
        status, _, body = call(BOB, "POST", f"/sandboxes/{bob}/exec/stream", small)
        assert status == 200, body
        assert json.loads(body.splitlines()[-1])["result"]["exit_code"] == 0, body
    uid = sh("id", "-u", ALICE).stdout.strip()
    refusals = journal_records(SLICEBOX_EVENT="request_refused", SLICEBOX_CALLER_UID=uid)
    codes = [r["SLICEBOX_RESULT"] for r in refusals]
    assert codes[-3:] == ["output_share_full", "stream_share_full", "transfer_share_full"]
    # Her holder gone, its silent stream is cancelled: her stream and her budget are free.
    streamed: list[tuple[int, str, str]] = []

    def served() -> bool:
        streamed.append(call(ALICE, "POST", f"/sandboxes/{alice}/exec/stream", small))
        return streamed[-1][0] == 200

    wait_for(served, timeout=20)
    assert json.loads(streamed[-1][2].splitlines()[-1])["result"]["exit_code"] == 0
