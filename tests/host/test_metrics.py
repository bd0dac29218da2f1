"""``GET /metrics`` scraped by Debian's own Prometheus in the guest (issue 41).

The checkout's agent runs as the system service; a reload turns on its metrics listener (a
token in a root-only file). Prometheus, started here with its own config, storage and that
token (``authorization: {type: Bearer, credentials_file: ...}``), scrapes it every second,
and the tests ask Prometheus' query API what it saw: a memory hog's project's OOM kills, a
user's CPU seconds under a busy loop, a pool's hits, a timed-out exec. A user who is no admin
reads ``/metrics`` on the socket and finds no other user's series. Everything started or made
here is stopped and removed at the end, the packaged Prometheus service never touched.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slicebox.client import Client
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.exec import ExecRequest
from tests.host.agentunits import CONFIG, SOCKET, agent_config, installed_agent
from tests.host.helpers import CGROUP_ROOT, sh, wait_for

pytestmark = pytest.mark.host

USER, OTHER = "sbxmetrics", "sbxmetricsb"
PROMETHEUS = "/usr/bin/prometheus"
TOKEN = Path("/etc/slicebox/metrics-test.token")
POOL = f"""
[[pool]]
user = "{USER}"
project = "pooled"
size = 1
memory = "64MB"
"""
FILL_SECONDS = 240.0  # a member takes seconds under emulation, more while others start
SEEN_SECONDS = 120.0  # a change is in Prometheus one scrape (1 s) and a query later


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def client() -> Client:
    return Client(str(SOCKET), timeout=300.0)


class Prometheus:
    """Debian's Prometheus, run here with a config of its own: one job, the agent's listener."""

    def __init__(self, directory: Path, target: str) -> None:
        self.target = target  # the agent's listener it scrapes
        self.port = free_port()
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: slicebox\n    scrape_interval: 1s\n"
            "    scrape_timeout: 1s\n"
            f"    authorization:\n      type: Bearer\n      credentials_file: {TOKEN}\n"
            f'    static_configs:\n      - targets: ["{target}"]\n'
        )
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(directory / "prometheus.log").open("w"),
        )

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            body: bytes = r.read()
            return body

    def ready(self) -> bool:
        try:
            return self.get("/-/ready") is not None
        except OSError:
            return False

    def query(self, expr: str) -> float | None:
        """The one value of ``expr`` now (PromQL, instant); None when it has no series."""
        answer = json.loads(self.get("/api/v1/query?" + urlencode({"query": expr})))
        result = answer["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if not Path(PROMETHEUS).exists():
        pytest.fail("Debian's prometheus is not installed in the guest (tests/guest/packages.txt)")
    with installed_agent(agent_config() + POOL):
        for user in (USER, OTHER):
            sh("useradd", "--no-create-home", "--shell", "/bin/sh", user)
            sh("usermod", "-aG", "slicebox", user)
        sh("systemctl", "start", "slicebox.socket")
        client().health()
        port = free_port()
        TOKEN.write_text("metrics-test-" + str(time.monotonic_ns()) + "\n")
        TOKEN.chmod(0o600)
        # As an operator turns it on: the config gains [metrics], and a reload starts it.
        listen = f'\n[metrics]\nlisten = "127.0.0.1:{port}"\ntoken_file = "{TOKEN}"\n'
        CONFIG.write_text(agent_config() + POOL + listen)
        sh("systemctl", "reload", "slicebox.service")
        directory = tmp_path_factory.mktemp("prometheus")
        server = Prometheus(directory, f"127.0.0.1:{port}")
        try:
            wait_for(server.ready, timeout=180, step=1)
            wait_for(lambda: server.query('up{job="slicebox"}') == 1.0, timeout=180, step=1)
            yield server
        finally:
            server.stop()
            shutil.rmtree(directory, ignore_errors=True)
            _remove_everything()
            TOKEN.unlink(missing_ok=True)
            for user in (USER, OTHER):
                sh("userdel", user, check=False)


def _remove_everything() -> None:
    """The test's sandboxes, then the pool's members: no [[pool]] any more, a reload and a
    reaper pass trim them."""
    for sandbox in client().list_sandboxes():
        if sandbox.user in (USER, OTHER) and sandbox.pool != "idle":
            client().destroy(sandbox.id)
    CONFIG.write_text(agent_config())
    sh("systemctl", "reload", "slicebox.service")
    wait_for(lambda: client().pools().pools == [], timeout=60)
    client().reap()
    managed = ("docker", "ps", "-aq", "--filter", "label=slicebox.managed=true")
    wait_for(lambda: sh(*managed).stdout.split() == [], timeout=120, step=1)


def seen(prometheus: Prometheus, expr: str, above: float) -> float:
    """Wait until Prometheus has a value of ``expr`` above ``above``; that value."""
    found: list[float] = []

    def over() -> bool:
        value = prometheus.query(expr)
        found[:] = [] if value is None else [value]
        return value is not None and value > above

    wait_for(over, timeout=SEEN_SECONDS, step=1)
    return found[0]


def test_a_memory_hog_s_project_counts_its_oom_kill(prometheus: Prometheus) -> None:
    box = client().create(CreateSandbox(user=USER, project="hog", memory="32MB"))
    expr = f'slicebox_level_oom_kills_total{{level="project",user="{USER}",project="hog"}}'
    wait_for(lambda: prometheus.query(expr) is not None, timeout=SEEN_SECONDS, step=1)
    before = prometheus.query(expr) or 0.0
    hog = ExecRequest(argv=("dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1"))
    ran = client().exec(box.id, hog)
    assert ran.exit_code != 0, "the hog was killed"
    assert seen(prometheus, expr, before) >= before + 1
    client().destroy(box.id)


def test_a_user_s_cpu_seconds_rise_under_a_busy_loop(prometheus: Prometheus) -> None:
    box = client().create(CreateSandbox(user=USER, project="busy", cpus=1))
    expr = f'slicebox_level_cpu_seconds_total{{level="user",user="{USER}"}}'
    wait_for(lambda: prometheus.query(expr) is not None, timeout=SEEN_SECONDS, step=1)
    before = prometheus.query(expr) or 0.0
    loop = ExecRequest(
        argv=("sh", "-c", "end=$(($(date +%s)+20)); while [ $(date +%s) -lt $end ]; do :; done")
    )
    spinning = threading.Thread(target=client().exec, args=(box.id, loop), daemon=True)
    spinning.start()
    try:
        assert seen(prometheus, expr, before + 2.0) > before + 2.0, "two CPU seconds at least"
    finally:
        spinning.join(120)
        client().destroy(box.id)


def test_pooled_runs_are_counted_as_the_pool_s_hits(prometheus: Prometheus) -> None:
    wait_for(
        lambda: any(p.ready >= 1 for p in client().pools().pools), timeout=FILL_SECONDS, step=1
    )
    request = RunRequest(
        sandbox=CreateSandbox(user=USER, project="pooled", memory="64MB"),
        exec=ExecRequest(argv=("true",)),
    )
    assert client().run(request).result.exit_code == 0
    hits = f'sum(slicebox_pool_hits_total{{user="{USER}",project="pooled"}})'
    assert seen(prometheus, hits, 0.0) >= 1
    ready = f'sum(slicebox_pool_ready{{user="{USER}",project="pooled"}})'
    assert prometheus.query(ready) is not None


def test_a_timed_out_exec_is_counted(prometheus: Prometheus) -> None:
    box = client().create(CreateSandbox(user=USER, project="slow"))
    expr = f'sum(slicebox_execs_total{{user="{USER}",result="timed_out"}})'
    before = prometheus.query(expr) or 0.0
    ran = client().exec(box.id, ExecRequest(argv=("sleep", "60"), timeout=2))
    assert ran.timed_out
    assert seen(prometheus, expr, before) >= before + 1
    client().destroy(box.id)


def test_psi_series_are_there_exactly_where_the_kernel_has_pressure_files(
    prometheus: Prometheus,
) -> None:
    """Whichever way the guest's kernel is built (PSI on, off, or off by default and not
    turned on with psi=1), the managed level's PSI series follow its cpu.pressure file."""
    has_psi = (CGROUP_ROOT / "slicebox.slice" / "cpu.pressure").exists()
    expr = 'slicebox_level_pressure_cpu_waiting_seconds_total{level="managed"}'
    if has_psi:
        assert seen(prometheus, f"{expr} >= 0", -1.0) >= 0
    else:
        time.sleep(3)  # three scrapes
        assert prometheus.query(expr) is None, "no pressure file: no series, not a zero"
    print(f"the guest's kernel has PSI files: {has_psi}")


def test_a_user_who_is_no_admin_reads_only_their_own_series_on_the_socket(
    prometheus: Prometheus,
) -> None:
    theirs = client().create(CreateSandbox(user=OTHER, project="secret"))
    mine = client().create(CreateSandbox(user=USER, project="open"))
    try:
        admin = sh("curl", "-sf", "--unix-socket", str(SOCKET), "http://localhost/metrics").stdout
        assert f'user="{OTHER}"' in admin, "the admin sees everyone"
        read = sh(
            "runuser", "-u", USER, "--",
            "curl", "-sf", "--unix-socket", str(SOCKET), "http://localhost/metrics",
        )  # fmt: skip
        users = {
            sample.labels.get("user")
            for family in text_string_to_metric_families(read.stdout)
            for sample in family.samples
        }
        assert users == {None, USER}, users
        assert OTHER not in read.stdout
        assert "secret" not in read.stdout
    finally:
        client().destroy(theirs.id)
        client().destroy(mine.id)


def test_the_listener_answers_only_its_token_and_only_metrics(prometheus: Prometheus) -> None:
    """Any local user reaches a TCP port: without the token, or with another, 401; with it,
    nothing but /metrics."""
    url = f"http://{prometheus.target}"

    def status(path: str, *header: str) -> str:
        argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *header, url + path]
        return sh("runuser", "-u", USER, "--", *argv).stdout

    token = TOKEN.read_text().strip()
    assert status("/metrics") == "401"
    assert status("/metrics", "-H", "Authorization: Bearer not-" + token) == "401"
    assert status("/metrics", "-H", "Authorization: Basic " + token) == "401"
    assert status("/metrics", "-H", "Authorization: Bearer " + token) == "200"
    assert status("/v1/sandboxes", "-H", "Authorization: Bearer " + token) == "404"


HOLD = """
import socket, sys
held = []
for _ in range({count}):
    s = socket.socket()
    try:
        s.connect(("{host}", {port}))
        held.append(s)
    except OSError:
        s.close()
print(len(held), flush=True)
sys.stdin.read()
"""


def test_a_user_holding_every_connection_leaves_the_scraper_its_share(
    prometheus: Prometheus,
) -> None:
    """Any local user can connect to the listener and hold what they open: they are held to
    their own share (the kernel names who owns a loopback connection's far end), and the
    scraper, another uid, still scrapes. As one bucket for every TCP peer, 8 idle connections
    of one user starved Prometheus."""
    host, _, port = prometheus.target.partition(":")
    token = TOKEN.read_text().strip()
    code = HOLD.format(count=200, host=host, port=port)
    holder = subprocess.Popen(
        ["runuser", "-u", USER, "--", "python3", "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None
    assert holder.stdout is not None
    try:
        assert int(holder.stdout.readline()) > 0, "the user opened connections and holds them"

        def status(*run_as: str) -> str:
            argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "20"]
            argv += ["-H", "Authorization: Bearer " + token, f"http://{prometheus.target}/metrics"]
            return sh(*run_as, *argv, check=False).stdout

        assert status() == "200", "root, another uid, is answered while the user holds theirs"
        assert status("runuser", "-u", USER, "--") == "429", "the user's own share is full"
        # Scrapes go on (a failed one would record up 0): the last one, seconds later, is new.
        before = prometheus.query('timestamp(up{job="slicebox"})')
        time.sleep(5)
        assert prometheus.query('up{job="slicebox"}') == 1.0, "Prometheus still scrapes"
        after = prometheus.query('timestamp(up{job="slicebox"})')
        assert before is not None
        assert after is not None
        assert after > before
    finally:
        holder.stdin.close()
        holder.wait(30)
