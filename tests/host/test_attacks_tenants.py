"""Native sandboxes, pulls and shared stores as a hostile member of group ``slicebox`` attacks
them (issue 60), through the installed agent, as real users (``runuser``, the kernel's uid on
the socket):

- a native sandbox whose code replaces its init's socket, with a link to the agent's own
  socket and then with a listener of its own that never answers: its user's execs are refused
  (at once, or at the handshake's end), and another user's exec with eight of them in flight
  takes about what it takes alone, measured against his time alone in the same run;
- a native sandbox with a host workspace (run as its caller, who is in group ``slicebox``):
  its code reaches neither the agent's socket nor Docker's (it still holds its caller's
  supplementary groups: docs/security.md);
- a local user holding every connection one uid may open to the metrics listener on the
  guest's own LAN address: root's scrape there is answered;
- pulls from a registry behind a gate (``tests.host.registrygate``, before the guest's own
  ``docker-registry``): alice's slow pull in flight holds her whole share of pulls, so her
  next distinct pull is refused ``pull_share_full`` at once while bob's pull is served; a
  private repository is pulled with the operator's grant to alice (the credentials as the
  engine reads them), never with root's own Docker credentials, and bob, who has no grant,
  is refused it;
- a wasm plugin alice uploaded is hers: bob naming it by its sha256 is told it is not held;
  and its allowed hosts may not name the host's own address.

One agent for the module (its metrics listener on the LAN address, two pulls in flight, the
grant); the sandboxes, images, users, the token, the grant and root's Docker config as it
was are restored after."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from tests.host.agentunits import (
    SOCKET,
    WORKSPACE_ROOTS,
    agent_config,
    installed_agent,
    remove_sandboxes,
)
from tests.host.helpers import TEST_IMAGE, ordinary_user, sh, wait_for
from tests.host.test_attacks_shares import call
from tests.host.test_pulls import REGISTRY, Registry, registry  # noqa: F401 (a fixture)
from tests.wasm.build import TOOLKIT, build

pytestmark = pytest.mark.host

ALICE, BOB = "sbxtenanta", "sbxtenantb"
TOKEN = Path("/etc/slicebox/metrics-tenants.token")
PORT = 9474
HELD = 4  # the listener's connections per uid (server.scrape.SCRAPER_LIMITS)
STUCK = 8  # alice's execs in flight: twice the native backend's threads
HANDSHAKE = 10.0  # the init's handshake (backends.native.initwire.HANDSHAKE_TIMEOUT)
GATE = "127.0.0.1:5047"  # tests.host.registrygate, before REGISTRY: its slow repositories
PRIVATE = "127.0.0.1:5048"  # and another, private to alice's grant
GRANT = Path("/etc/slicebox/tenants-registry.json")  # the operator's grant, root's, 0600
ROOTS_DOCKER = Path("/root/.docker/config.json")
PULLS = (
    f'[[registry_credentials]]\nregistry = "{PRIVATE}"\nusers = ["{ALICE}"]\n'
    f'auth_file = "{GRANT}"\n'
    "[shares]\npulls_in_flight = 2\n"  # half of it each user's (user_share 0.5): one pull
    "[[egress.rule]]\n"  # egress for anyone: a wasm plugin's hosts come from its allow-list
)


def lan_address() -> str:
    """The guest's own IPv4 address besides loopback."""
    listed = sh("ip", "-4", "-o", "addr", "show", "scope", "global").stdout.split()
    return listed[listed.index("inet") + 1].split("/")[0]


def auths(user: str, password: str) -> str:
    """A Docker client config whose one entry is the private gate's."""
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    return json.dumps({"auths": {PRIVATE: {"auth": auth}}})


@pytest.fixture(scope="module")
def agent() -> Iterator[str]:
    """The agent with its metrics listener on the LAN address, the pull settings, and the
    two users; the grant in place, and root's own Docker config naming the gate too."""
    roots = ROOTS_DOCKER.read_text() if ROOTS_DOCKER.exists() else None
    made_dir = not ROOTS_DOCKER.parent.exists()
    ROOTS_DOCKER.parent.mkdir(exist_ok=True)
    ROOTS_DOCKER.write_text(auths("root", "root-pass"))
    listen = f'[metrics]\nlisten = "{lan_address()}:{PORT}"\ntoken_file = "{TOKEN}"\n'
    try:
        with ExitStack() as stack:
            stack.enter_context(installed_agent(agent_config() + listen + PULLS))
            # In /etc/slicebox, which the installed agent makes (and takes away after).
            TOKEN.write_text("tenants-token\n")
            TOKEN.chmod(0o600)
            GRANT.write_text(auths("alice", "alice-pass"))
            GRANT.chmod(0o600)
            for user in (ALICE, BOB):
                stack.enter_context(ordinary_user(user))
            sh("systemctl", "start", "slicebox.socket")
            try:
                yield lan_address()
            finally:
                remove_sandboxes((ALICE, BOB))
    finally:
        TOKEN.unlink(missing_ok=True)
        GRANT.unlink(missing_ok=True)
        if roots is None:
            ROOTS_DOCKER.unlink(missing_ok=True)
            if made_dir:
                ROOTS_DOCKER.parent.rmdir()
        else:
            ROOTS_DOCKER.write_text(roots)


def native_box(user: str) -> str:
    status, _, body = call(user, "POST", "/sandboxes", {"project": "t4", "backend": "native"})
    assert status in {200, 201}, body
    return str(json.loads(body)["id"])


def exec_seconds(user: str, box: str, argv: list[str]) -> tuple[float, int, str]:
    began = time.monotonic()
    status, _, body = call(user, "POST", f"/sandboxes/{box}/exec", {"argv": argv})
    return time.monotonic() - began, status, body


def stuck_execs(box: str) -> list[subprocess.Popen[str]]:
    """Alice's execs into ``box``, in flight until the agent answers them."""
    return [
        subprocess.Popen(
            ["runuser", "-u", ALICE, "--", "curl", "-s", "--unix-socket", str(SOCKET),
             "-H", "Content-Type: application/json", "-d", '{"argv": ["true"]}',
             f"http://localhost/v1/sandboxes/{box}/exec"],
            stdout=subprocess.PIPE, text=True,
        )
        for _ in range(STUCK)
    ]  # fmt: skip


# Alice's code: a listener of her own where her init's socket was, which never accepts (no
# single quote in it: it goes in a shell's single quotes).
SILENT = """
import os, socket, sys, time
path = sys.argv[1]
os.unlink(path)
listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
os.chmod(path, 0o777)  # open to the agent (the umask made it 0700), as an init socket is
listener.listen(64)
print("listening", flush=True)
time.sleep(3600)
"""


def test_a_native_sandbox_that_replaced_its_init_socket_stalls_no_one(agent: str) -> None:
    """Before: each of alice's execs held one of the native backend's four shared threads for
    the 10 s handshake (following the link as root), and bob's exec waited behind them
    (19.8 s with eight in flight, 0.02 s alone)."""
    bob = native_box(BOB)
    try:
        alone, status, body = exec_seconds(BOB, bob, ["true"])
        assert status == 200, body
        took: dict[str, float] = {}
        for how in ("link", "silent"):  # a sandbox of alice's each
            alice = native_box(ALICE)
            sock = f"/run/slicebox/init/{alice}/init.sock"
            if how == "link":
                swap = ["ln", "-sf", str(SOCKET), sock]
            else:
                swap = ["sh", "-c", f"python3 -c '{SILENT}' {sock} > /tmp/silent 2>&1 &"
                        " until grep -q listening /tmp/silent; do sleep 0.1; done"]  # fmt: skip
            done = exec_seconds(ALICE, alice, swap)
            assert done[1] == 200, done
            assert json.loads(done[2])["exit_code"] == 0, done
            held = stuck_execs(alice)
            time.sleep(2.0)  # all eight at the agent (runuser and curl start slowly here)
            began = time.monotonic()
            took[how], status, body = exec_seconds(BOB, bob, ["true"])
            assert status == 200, body
            answers = [json.loads(each.communicate(timeout=120)[0]) for each in held]
            after = time.monotonic() - began
            print(f"{how}: bob's exec {took[how]:.2f} s with {STUCK} of alice's in flight, "
                  f"{alone:.2f} s alone; hers answered within {after:.1f} s")  # fmt: skip
            want = "was replaced" if how == "link" else "did not answer"
            assert all(want in answer["message"] for answer in answers), answers
            assert all(answer["code"] == "host_error" for answer in answers), answers
            if how == "link":
                assert after < HANDSHAKE, "a link is refused at once, no handshake waited out"
        # Bob's exec as if alone (before: 10-20 s behind hers, whatever the machine's speed).
        for how, seconds in took.items():
            assert seconds < max(3 * alone, alone + 3.0), (how, seconds, alone)
    finally:
        remove_sandboxes((ALICE, BOB))


def test_a_local_user_at_its_caps_on_the_lan_address_leaves_the_scraper_served(
    agent: str,
) -> None:
    """Alice holds every connection one uid may open to the listener on the guest's LAN
    address; root's scrape there is answered (before: 429, every non-loopback peer was one
    bucket)."""
    hold = (
        "import socket, sys\n"
        f"held = [socket.create_connection(('{agent}', {PORT})) for _ in range({HELD})]\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        ["runuser", "-u", ALICE, "--", "python3", "-c", hold],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        scraped = sh(
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
            "-H", f"Authorization: Bearer {TOKEN.read_text().strip()}",
            f"http://{agent}:{PORT}/metrics",
        )  # fmt: skip
        assert scraped.stdout == "200"
    finally:
        holder.communicate(timeout=60)


@contextmanager
def gate_at(address: str, log: Path, *mode: str) -> Iterator[Path]:
    """A gate at ``address`` before the registry; its log of requests (and, beside it, the
    release of the slow repositories)."""
    log.touch()
    argv = [sys.executable, "-m", "tests.host.registrygate", address.split(":")[1], REGISTRY]
    process = subprocess.Popen(
        [*argv, str(log), *mode], stdout=subprocess.PIPE, text=True, cwd="/src"
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        yield log
    finally:
        log.with_name(log.name + ".release").touch()
        process.terminate()
        process.wait(30)


@pytest.fixture
def gate(registry: Registry, tmp_path: Path) -> Iterator[Path]:  # noqa: F811
    with gate_at(GATE, tmp_path / "gate.log") as log:
        yield log


@pytest.fixture
def private(registry: Registry, tmp_path: Path) -> Iterator[Path]:  # noqa: F811
    with gate_at(PRIVATE, tmp_path / "private.log", "private") as log:
        yield log


def pushed(repository: str, gate: str = GATE) -> str:
    """An image of 1 MiB of its own in the registry, not on this host; its name through
    ``gate``."""
    container = sh("docker", "create", TEST_IMAGE).stdout.strip()
    with open("/dev/urandom", "rb") as random, open("/tmp/sbx-layer", "wb") as layer:
        layer.write(random.read(1 << 20))
    sh("docker", "cp", "/tmp/sbx-layer", f"{container}:/random.bin")
    os.unlink("/tmp/sbx-layer")
    sh("docker", "commit", container, f"{REGISTRY}/{repository}:1")
    sh("docker", "rm", container)
    sh("docker", "push", "-q", f"{REGISTRY}/{repository}:1")
    sh("docker", "rmi", f"{REGISTRY}/{repository}:1")
    return f"{gate}/{repository}:1"


def forget(*images: str) -> None:
    for image in images:
        sh("docker", "rmi", "-f", image, check=False)


def create_of(user: str, image: str, seconds: int = 120) -> subprocess.Popen[str]:
    """``user``'s create of ``image`` by curl, in flight until the agent answers (status on
    the last line)."""
    body = json.dumps({"project": "t4", "image": image})
    return subprocess.Popen(
        ["runuser", "-u", user, "--", "curl", "-s", "-w", "\n%{http_code}",
         "--max-time", str(seconds), "--unix-socket", str(SOCKET),
         "-H", "Content-Type: application/json", "-d", body,
         "http://localhost/v1/sandboxes"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def answer_of(process: subprocess.Popen[str]) -> tuple[int, dict[str, object]]:
    out = process.communicate(timeout=300)[0]
    body, _, status = out.rpartition("\n")
    return int(status or 0), json.loads(body) if body.strip() else {}


def test_a_user_s_slow_pull_holds_her_share_only(agent: str, gate: Path) -> None:
    """Alice's pull held by her slow registry fills her share (one of two in flight): her
    next distinct pull is refused at once with the share's code, and bob's pull is served
    meanwhile (before: nothing bounded her pulls; each waited for the registry)."""
    slow, other, bobs = pushed("slow/first"), pushed("slow/second"), pushed("open/bobs")
    held = create_of(ALICE, slow)
    try:
        wait_for(lambda: "/slow/first/" in gate.read_text(), timeout=60)
        refused = answer_of(create_of(ALICE, other, seconds=30))
        assert refused[0] == 429, refused
        assert refused[1]["code"] == "pull_share_full", refused
        served = answer_of(create_of(BOB, bobs))
        assert served[0] in {200, 201}, served
        assert held.poll() is None, "alice's first pull is still held"
    finally:
        gate.with_name(gate.name + ".release").touch()
        first = answer_of(held)
    assert first[0] in {200, 201}, first
    remove_sandboxes((ALICE, BOB))
    forget(slow, other, bobs)


def test_a_private_pull_sends_the_operator_s_grant_only(agent: str, private: Path) -> None:
    """The operator granted alice credentials for the gate's private repositories; root's own
    Docker config names the gate too. Alice's pull succeeds with her grant (before: sent as
    ``b'…'``, which the engine cannot read, so anonymous and refused); bob, without a grant,
    is refused, and the gate never saw root's credentials from anyone."""
    image = pushed("team", PRIVATE)
    try:
        alices = answer_of(create_of(ALICE, image))
        assert alices[0] in {200, 201}, alices
        sent = private.read_text()
        granted = "Basic " + base64.b64encode(b"alice:alice-pass").decode()
        assert granted in sent, sent[-2000:]
        remove_sandboxes((ALICE,))
        forget(image)  # an image on the host is anyone's to name (docs/security.md)
        private.write_text("")
        bobs = answer_of(create_of(BOB, image))
        assert bobs[0] >= 400, bobs
        assert bobs[1]["code"] == "image_pull_failed", bobs
        seen = private.read_text()
        assert "/v2/" in seen, "bob's pull reached the gate"
        assert granted not in seen, f"alice's grant sent for bob: {seen[-2000:]}"
        root = base64.b64encode(b"root:root-pass").decode()
        assert root not in sent + seen, "root's own credentials were sent"
    finally:
        remove_sandboxes((ALICE, BOB))
        forget(image)


def test_a_plugin_alice_uploaded_is_not_bob_s_to_name(agent: str, tmp_path: Path) -> None:
    """Before: one store by sha256 for everyone, so bob ran alice's plugin by naming its hash
    (and his uploads evicted hers)."""
    module = build(TOOLKIT, tmp_path).read_bytes()
    sha = hashlib.sha256(module).hexdigest()
    upload = {"module": base64.b64encode(module).decode()}
    body = {"project": "t4", "backend": "wasm", "wasm": upload}
    status, _, made = call(ALICE, "POST", "/sandboxes", body)
    assert status in {200, 201}, made
    try:
        named = {"project": "t4", "backend": "wasm", "wasm": {"sha256": sha}}
        status, _, answer = call(BOB, "POST", "/sandboxes", named)
        assert status == 404, answer
        assert json.loads(answer)["code"] == "wasm_not_found", answer
        status, _, own = call(ALICE, "POST", "/sandboxes", named)  # hers to name again
        assert status in {200, 201}, own
        # Her plugin's hosts name the host's own LAN address: refused as for an egress
        # sandbox's list (before: checked against the reserved networks only).
        home = {**named, "network": {"egress": {"allow": ["pypi.org", agent]}}}
        status, _, answer = call(ALICE, "POST", "/sandboxes", home)
        assert status == 400, answer
        assert json.loads(answer)["code"] == "policy_egress", answer
    finally:
        remove_sandboxes((ALICE, BOB))


# What a native sandbox's code tries: its groups, and the agent's and Docker's sockets.
REACH = """
import os, socket
print(" ".join(str(g) for g in sorted(set(os.getgroups()) - {os.getgid()})) or "-")
for path in ("/run/slicebox/slicebox.sock", "/run/docker.sock"):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        print("reached", path)
    except OSError as exc:
        print("refused", path, exc.errno)
"""


def test_a_native_sandbox_with_a_host_workspace_reaches_neither_the_agent_nor_docker(
    agent: str,
) -> None:
    """Before: it ran with its caller's supplementary groups (systemd's initgroups), slicebox
    among them, and reached the agent's socket with the caller's whole API. The groups are
    still there (printed): what they would open is out of reach."""
    home = Path(WORKSPACE_ROOTS) / ALICE
    work = home / "w"
    work.mkdir(parents=True)
    uid, gid = (int(sh("id", flag, ALICE).stdout) for flag in ("-u", "-g"))
    os.chown(home, uid, gid)
    os.chown(work, uid, gid)
    spec = {"project": "t4", "backend": "native", "workspace": {"kind": "host", "path": str(work)}}
    try:
        status, _, body = call(ALICE, "POST", "/sandboxes", spec)
        assert status in {200, 201}, body
        box = json.loads(body)["id"]
        status, _, ran = call(
            ALICE, "POST", f"/sandboxes/{box}/exec", {"argv": ["python3", "-c", REACH]}
        )
        assert status == 200, ran
        said = base64.b64decode(json.loads(ran)["stdout"]).decode().splitlines()
        print(said)
        assert [line.split()[0] for line in said[1:]] == ["refused", "refused"], said
    finally:
        remove_sandboxes((ALICE,))
        shutil.rmtree(home, ignore_errors=True)
