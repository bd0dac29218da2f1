"""The reaper and deadlines on a real host: real Docker containers, real systemd timers and
slices, the real agent stopped while a deadline passes. (The agent killed with SIGKILL twenty
times under load is in test_load.py.)

What is asserted is what Docker and systemd show afterwards (containers, their state and
finish time, units), never only what the reaper reported.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker
import pytest

from slicebox.backends.docker import DockerBackend
from slicebox.client import Client
from slicebox.core.deadlines import PATTERN as TIMERS
from slicebox.core.deadlines import Deadlines, parse_timer, timer_unit
from slicebox.core.reaper import Reaper
from slicebox.core.reaping import TIMER_GRACE
from slicebox.core.sandboxes import SandboxManager
from slicebox.core.slices import SliceManager
from slicebox.host.journal import Auditor
from slicebox.host.systemd import PystemdSystemd
from slicebox.model.config import ReaperConfig, parse_config, read_host_memory
from slicebox.model.labels import MANAGED
from slicebox.model.names import MANAGED_SLICE
from slicebox.model.reaper import Action, Kind, Rule
from slicebox.model.spec import SandboxSpec
from tests.fakes.journal import ListJournal
from tests.fakes.threadside import created
from tests.host.agentunits import SOCKET, agent_config, installed_agent, prop
from tests.host.helpers import TEST_IMAGE, journal_records, sh, unique, wait_for
from tests.host.sliceboxhost import active, cleanup_slices, slicebox_units

pytestmark = pytest.mark.host


class Host:
    """The real parts, assembled the way the agent assembles them, with a movable clock."""

    def __init__(self, client: docker.DockerClient, state_dir: Path) -> None:
        self.client = client
        self.offset = timedelta()
        self.user = unique("reap-")
        self.escaped = self.user.replace("-", "\\x2d")
        self.tag = unique("sbx-left")  # ids of the leftovers a test plants
        systemd = PystemdSystemd()
        self.slices = SliceManager(systemd)
        self.deadlines = Deadlines(systemd)
        self.manager = SandboxManager(
            DockerBackend.from_env(),
            self.slices,
            config=parse_config(f'default_image = "{TEST_IMAGE}"\n'),
            host_memory=read_host_memory(),
            instance_id=unique("run-"),
            deadlines=self.deadlines,
        )
        self.journal = ListJournal()
        # No grace: a pass stops the slices its own destroys emptied, as these tests expect.
        self.config = ReaperConfig(state_dir=state_dir, empty_slice_grace_seconds=0)
        self.reaper = Reaper(
            self.manager,
            self.slices,
            DockerBackend.from_env(),
            auditor=Auditor(self.journal),
            config=lambda: self.config,
            clock=lambda: datetime.now(UTC) + self.offset,
        )

    def create(self, project: str = "p", **fields: object) -> str:
        spec = {"user": self.user, "project": project, "memory": "32MB", **fields}
        return created(self.manager, SandboxSpec.model_validate(spec)).id

    def containers(self) -> list[dict[str, Any]]:
        found = self.client.api.containers(
            all=True, filters={"label": f"slicebox.user={self.user}"}
        )
        return list(found)

    def own(self, actions: list[Action]) -> list[Action]:
        """The actions about this test's own sandboxes, slices and leftovers: the reaper sees
        the whole host, and another test's leftover is that test's failure, not this one's."""
        return [a for a in actions if a.user == self.user or a.sandbox_id.startswith(self.tag)]

    def units(self) -> list[str]:
        return slicebox_units(f"slicebox-{self.user.replace('-', '?x2d')}*")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    client = docker.from_env()
    managed_was_active = active(MANAGED_SLICE)
    made = Host(client, tmp_path / "state")
    yield made
    for found in made.containers():
        client.api.remove_container(found["Id"], force=True)
    for timer in made.deadlines.timers():
        sh("systemctl", "stop", timer.unit, check=False)
    cleanup_slices(*made.units())
    if not managed_was_active:
        cleanup_slices(MANAGED_SLICE)
    client.close()


def timers_of(sandbox_id: str) -> list[str]:
    units = slicebox_units(TIMERS)
    return [u for u in units if (t := parse_timer(u)) is not None and t.sandbox_id == sandbox_id]


def test_an_expired_sandbox_is_gone_after_one_pass(host: Host) -> None:
    keep, doomed = host.create(ttl_seconds=3600), host.create(project="q", ttl_seconds=600)
    assert timers_of(doomed), "create arms a systemd timer"
    # The reaper's clock, not systemd's; past the timer's own turn (its expiry) too.
    host.offset = timedelta(seconds=601) + TIMER_GRACE
    report = host.reaper.run()
    assert [(a.kind, a.rule, a.target) for a in host.own(report.plan)] == [
        (Kind.DESTROY, Rule.EXPIRED, doomed),
        (Kind.STOP_SLICE, Rule.EMPTY_SLICE, f"slicebox-{host.escaped}-q.slice"),
    ]
    assert [c["Labels"]["slicebox.sandbox_id"] for c in host.containers()] == [keep]
    wait_for(lambda: timers_of(doomed) == [], timeout=10)  # systemd stops it with the scope
    assert not [u for u in host.units() if u.endswith("-q.slice")], "its empty slice is gone"
    assert host.journal.entries[0]["SLICEBOX_REAPER_RULE"] == "expired"
    assert host.own(host.reaper.run().plan) == []


def test_a_three_level_tree_is_removed_deepest_first(host: Host) -> None:
    root = host.create(ttl_seconds=600, root_task_id=unique("task-"))
    child = host.create(parent_id=root, ttl_seconds=3600)
    grandchild = host.create(parent_id=child, ttl_seconds=3600)
    events = subprocess.Popen(
        ["docker", "events", "--filter", "event=destroy", "--format", "{{.Actor.Attributes.name}}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1)  # docker events is listening
        host.offset = timedelta(seconds=601) + TIMER_GRACE
        report = host.reaper.run()
        time.sleep(1)
    finally:
        events.terminate()
        out, _ = events.communicate(timeout=10)
    assert [(a.target, a.rule) for a in host.own(report.plan) if a.kind is Kind.DESTROY] == [
        (grandchild, Rule.PARENT_GONE),
        (child, Rule.PARENT_GONE),
        (root, Rule.EXPIRED),
    ]
    assert out.split() == [grandchild, child, root], "Docker saw them go deepest first"
    assert host.containers() == []
    assert host.units() == []


def test_dry_run_changes_nothing_and_a_pass_removes_every_kind_of_leftover(host: Host) -> None:
    live = host.create(ttl_seconds=3600)
    # A create killed before its timer was armed; an exited container; a managed container
    # without lineage; leftover files; a stale timer; an empty project slice.
    lost_timer = host.create(ttl_seconds=3600)
    host.deadlines.disarm(lost_timer)
    exited = host.create(command=["true"], project="done")
    wait_for(lambda: host.client.api.inspect_container(exited)["State"]["Status"] == "exited")
    bare = host.client.api.create_container(
        TEST_IMAGE, ["sleep", "600"], labels={MANAGED: "true", "slicebox.user": host.user}
    )["Id"]
    gone = host.tag + "-gone"
    (host.config.state_dir / gone).mkdir(parents=True)
    # A timer bound to its container's scope stops with it: a stale one is left by an agent
    # that bound none (an earlier version), so it is started here unbound.
    at = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    stale = timer_unit(gone, at)
    PystemdSystemd().start_timer(stale, at, ["/bin/true"], f"slicebox deadline of {gone}")
    host.slices.ensure(
        f"slicebox-{host.escaped}-empty.slice",
        parse_config("").project_ceiling(host.user, "empty", read_host_memory()),
    )
    before = (sorted(c["Id"] for c in host.containers()), host.units(), timers_of(gone))

    dry = host.reaper.run(dry_run=True)
    assert {(a.rule, a.target) for a in host.own(dry.plan)} >= {
        (Rule.MISSING_LINEAGE, bare),
        (Rule.EXITED, exited),
        (Rule.DEADLINE_MISSING, lost_timer),
        (Rule.LEFTOVER_FILES, gone),
        (Rule.STALE_DEADLINE, stale),
    }
    assert Rule.EMPTY_SLICE in {a.rule for a in dry.plan}
    assert live not in {a.target for a in dry.plan}
    after_dry = (sorted(c["Id"] for c in host.containers()), host.units(), timers_of(gone))
    assert after_dry == before, "a dry run changes nothing"
    assert (host.config.state_dir / gone).is_dir()

    done = host.reaper.run()
    assert {o.result for o in done.outcomes} <= {"ok", "skipped"}, done.outcomes
    left = {c["Labels"].get("slicebox.sandbox_id") for c in host.containers()}
    assert left == {live, lost_timer}
    assert timers_of(lost_timer), "the lost deadline is armed again from the label"
    assert timers_of(gone) == []
    assert not (host.config.state_dir / gone).exists()
    assert sorted(host.units()) == [
        f"slicebox-{host.escaped}-p.slice",
        f"slicebox-{host.escaped}.slice",
    ]
    assert host.own(host.reaper.run().plan) == []


# --- the agent: deadlines while it is down, extension, the CLI --------------------------------

AGENT_CONFIG = agent_config(reaper="interval_seconds = 3600\n")  # passes only on demand


@pytest.fixture
def agent() -> Iterator[Client]:
    with installed_agent(AGENT_CONFIG, start_limit=False):
        sh("systemctl", "start", "slicebox.socket")
        client = Client(str(SOCKET), timeout=120)
        try:
            yield client
        finally:
            sh("systemctl", "start", "slicebox.service", check=False)
            for sandbox in client.request("GET", "/sandboxes"):
                client.request("DELETE", f"/sandboxes/{sandbox['id']}")
            client.request("POST", "/reaper", {})
            leftover = docker.from_env().api.containers(all=True, filters={"label": MANAGED})
            assert leftover == [], "the test left sandboxes behind"


def reaper_records(sandbox_id: str) -> list[dict[str, Any]]:
    return journal_records(SLICEBOX_EVENT="reaper_action", SLICEBOX_SANDBOX_ID=sandbox_id)


def container_exists(container_id: str) -> bool:
    return sh("docker", "inspect", container_id, check=False).returncode == 0


BURN = "i=0; while [ $i -lt 5000 ]; do i=$((i+1)); done"  # light: an emulated guest is slow


def test_deadlines_hold_while_the_agent_is_stopped_an_expiry_by_its_timer_an_extension_too(
    agent: Client,
) -> None:
    """Two deadlines in well under a minute of real time. ``doomed``'s timer runs ``sliceboxd
    expire``: the final usage read from the live cgroup, one ``expired`` record, the container
    removed, with no agent running. ``kept`` was extended before the agent stopped: the new
    deadline lives in systemd alone (the label keeps the original), so the original passes,
    agent or no agent, and nothing expires it.
    Each TTL leaves an emulated guest about three times what comes after its create before the
    agent is stopped (``kept``: its extension, ``doomed``'s create, an exec, the stop; ``doomed``:
    the exec and the stop); the wait after the stop is what is left of them."""
    kept = agent.request("POST", "/sandboxes", {"project": "ext", "ttl_seconds": 40})
    extended = agent.request("POST", f"/sandboxes/{kept['id']}/deadline", {"ttl_seconds": 600})
    doomed = agent.request("POST", "/sandboxes", {"project": "ttl", "ttl_seconds": 25})
    sandbox_id, container = doomed["id"], doomed["container_id"]
    expires = datetime.fromisoformat(doomed["expires_at"])
    [timer] = timers_of(sandbox_id)
    service = timer.removesuffix(".timer") + ".service"
    assert "sliceboxd expire " + sandbox_id in prop(service, "ExecStart")

    assert datetime.fromisoformat(extended["expires_at"]) > datetime.now(UTC) + timedelta(
        seconds=500
    )
    labels = json.loads(sh("docker", "inspect", kept["container_id"]).stdout)[0]["Config"]
    labelled = datetime.fromisoformat(labels["Labels"]["slicebox.expires_at"])
    assert labelled == datetime.fromisoformat(kept["expires_at"]), "the label keeps the original"
    assert len(timers_of(kept["id"])) == 1, "the original timer went with the extension"

    burnt = agent.request("POST", f"/sandboxes/{sandbox_id}/exec", {"argv": ["sh", "-c", BURN]})
    assert burnt["exit_code"] == 0
    sh("systemctl", "stop", "slicebox.service", "slicebox.socket")
    try:
        assert datetime.now(UTC) < expires, "the agent must be stopped before the deadline"
        assert datetime.now(UTC) < labelled, "and before the extended one's original deadline"
        wait_for(lambda: not container_exists(container), timeout=180, step=1)
        wait_for(lambda: not timers_of(sandbox_id) and not active(service), timeout=60, step=1)
        time.sleep(max((labelled - datetime.now(UTC)).total_seconds() + 5, 0))
        assert not active("slicebox.service"), "nothing of the agent ran meanwhile"
        assert container_exists(kept["container_id"]), "the extended sandbox outlives its label"
    finally:
        sh("systemctl", "start", "slicebox.socket")
    wait_for(lambda: bool(reaper_records(sandbox_id)), timeout=30)
    [record] = reaper_records(sandbox_id)
    assert record["SLICEBOX_REAPER_RULE"] == "expired"
    assert record["SLICEBOX_RESULT"] == "ok"
    assert float(record["SLICEBOX_USAGE_CPU_SECONDS"]) > 0, "read before the cgroup went"
    assert "deadline timer" in record["SLICEBOX_DETAIL"]
    assert record.get("_SYSTEMD_UNIT", service) == service, "written by the timer's service"
    written = datetime.fromtimestamp(int(record["__REALTIME_TIMESTAMP"]) / 1e6, UTC)
    assert expires - timedelta(seconds=1) <= written <= expires + timedelta(seconds=120)
    # The agent comes back (its start-up pass runs before it answers) and finds nothing to do
    # for the expired sandbox; its reaper stops the emptied slice (the tests' grace is 0).
    assert [s["id"] for s in agent.request("GET", "/sandboxes")] == [kept["id"]]
    report = agent.request("POST", "/reaper", {})
    assert [a for a in report["plan"] if a["sandbox_id"] in (sandbox_id, kept["id"])] == []
    assert len(reaper_records(sandbox_id)) == 1, "no second record, start-up pass included"
    assert not slicebox_units("slicebox-root-ttl.slice")

    # The extended one answers with its systemd deadline, runs, and refuses a TTL of 0.
    assert agent.request("GET", f"/sandboxes/{kept['id']}")["expires_at"] == extended["expires_at"]
    ran = agent.request("POST", f"/sandboxes/{kept['id']}/exec", {"argv": ["echo", "alive"]})
    assert ran["exit_code"] == 0
    refused = subprocess.run(
        ["slicebox", "extend", kept["id"], "0"], capture_output=True, text=True, check=False
    )
    assert refused.returncode == 2
    assert "invalid_ttl" in refused.stderr
    assert agent.request("DELETE", f"/sandboxes/{kept['id']}")["destroyed"] is True

    # The emptied slices go with the reaper's passes (grace 0). A pass sees a user slice empty
    # once its project slice's stop has ended, which a loaded guest may finish only after the
    # pass listed it (one CI run, with the other lane busy): the next pass stops it.
    def passed_and_gone() -> bool:
        agent.request("POST", "/reaper", {})
        return not slicebox_units("slicebox-root.slice")

    wait_for(passed_and_gone, timeout=60, step=2)


def test_the_reap_command_prints_the_plan_and_only_admins_may_run_it(agent: Client) -> None:
    agent.request("GET", "/health")  # running: its start-up pass would take the leftover
    state = Path("/run/slicebox/sandboxes/sbx-leftover")
    state.mkdir(parents=True)
    dry = sh("slicebox", "reap", "--dry-run")
    assert "reaper would take" in dry.stdout
    planned = [line.split() for line in dry.stdout.splitlines() if "sbx-leftover" in line]
    assert [line[:3] for line in planned] == [["planned", "remove_files", "sbx-leftover"]]
    assert state.is_dir(), "dry run"
    done = json.loads(sh("slicebox", "--json", "reap").stdout)
    mine = [o for o in done["outcomes"] if o["action"]["target"] == "sbx-leftover"]
    assert [(o["action"]["rule"], o["result"]) for o in mine] == [("leftover_files", "ok")]
    assert not state.exists()
    story = sh("journalctl", "--no-pager", "-o", "json", "SLICEBOX_REAPER_RULE=leftover_files")
    assert "sbx-leftover" in story.stdout
    user = unique("sbxr")[:12]
    sh("useradd", "--no-create-home", "-G", "slicebox", user)
    try:
        refused = subprocess.run(
            ["runuser", "-u", user, "--", "slicebox", "reap", "--dry-run"],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        sh("userdel", user)
    assert refused.returncode == 2
    assert "forbidden" in refused.stderr
