"""``slicebox capacity`` against the installed agent, as an ordinary user meets it: a project is
filled until capacity says no more of a shape fits, the next create of that shape is refused
``admission_refused``, and a smaller shape that capacity says fits is admitted."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.model.names import slice_names
from tests.host.agentunits import SOCKET, TEST_CONFIG, installed_agent, remove_sandboxes
from tests.host.helpers import ordinary_user, sh, unique

pytestmark = pytest.mark.host

USER = "sbxcap"
PROJECT = unique("fill")
RACE = unique("race")  # room for exactly two of BIG: 60 pids
# Admission counts memory and pids; this project's ceilings make pids run out first: three
# sandboxes of 30 pids take 90 of its 100, and 10 are left.
CONFIG = TEST_CONFIG + (
    "[admission]\nmemory_ratio = 1.0\npids_ratio = 1.0\n"
    f'[projects."{USER}/{PROJECT}"]\nmemory = "512MB"\npids = 100\n'
    f'[projects."{USER}/{RACE}"]\nmemory = "512MB"\npids = 60\n'
)
BIG = ("--memory", "32MB", "--pids", "30")
SMALL = ("--memory", "32MB", "--pids", "10")


def slicebox(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", USER, "--", "slicebox", *argv],
        capture_output=True,
        text=True,
        check=False,
    )


def capacity(*shape: str, project: str = PROJECT) -> dict[str, object]:
    asked = slicebox("--json", "capacity", "--project", project, *shape)
    assert asked.returncode == 0, asked.stderr
    return dict(json.loads(asked.stdout))


def create(*shape: str) -> subprocess.CompletedProcess[str]:
    return slicebox("--json", "create", "--project", PROJECT, *shape)


@pytest.fixture(scope="module")
def agent() -> Iterator[None]:
    with installed_agent(CONFIG), ordinary_user(USER):
        sh("systemctl", "start", "slicebox.socket")
        try:
            yield
        finally:
            remove_sandboxes([USER])


def test_a_project_filled_to_what_capacity_says_refuses_the_next_and_admits_what_fits(
    agent: None,
) -> None:
    before = capacity(*BIG)
    assert (before["user"], before["project"], before["fits"]) == (USER, PROJECT, 3)
    assert before["bound"] == {"level": "project", "resource": "pids"}
    host = before["host"]
    assert isinstance(host, dict)
    assert 0 < host["available_bytes"] <= host["total_bytes"], "MemAvailable, beside fits"

    made: list[dict[str, object]] = []
    while (left := capacity(*BIG)["fits"]) != 0:
        assert left == 3 - len(made), "each create takes exactly one"
        created = create(*BIG)
        assert created.returncode == 0, created.stderr
        made.append(json.loads(created.stdout))
    assert len(made) == 3
    project = Path(str(slice_names(USER, PROJECT).cgroups().project))
    assert (project / "pids.max").read_text().strip() == "100", "the kernel's ceiling too"

    refused = create(*BIG)
    assert refused.returncode == 2
    assert refused.stderr.startswith("slicebox: admission_refused: pids 30:"), refused.stderr
    assert "10 left" in refused.stderr

    small = capacity(*SMALL)
    assert small["fits"] == 1
    admitted = create(*SMALL)
    assert admitted.returncode == 0, admitted.stderr
    made.append(json.loads(admitted.stdout))
    assert capacity(*SMALL)["fits"] == 0

    # The same answer on the socket, as docs/capacity.md shows it with curl.
    target = f"http://localhost/v1/capacity?project={PROJECT}&memory=32MB&pids=10"
    raw = subprocess.run(
        ["runuser", "-u", USER, "--", "curl", "-s", "--unix-socket", str(SOCKET), target],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    levels = json.loads(raw)["levels"]
    assert [level["level"] for level in levels] == ["managed", "user", "project"]
    assert levels[2]["sandboxes"] == 4
    assert levels[2]["pids"] == {"ceiling": 100, "admits": 100, "provisioned": 100, "left": 0}

    for box in made:
        assert slicebox("rm", str(box["id"])).returncode == 0
    assert capacity(*BIG)["fits"] == 3, "each destroy gives its room back"


def test_creates_racing_for_the_last_room_admit_exactly_what_fits(agent: None) -> None:
    """Six creates at once where two fit: the ledger checks and counts under one lock, so two
    are admitted and four refused, never a third past the ceiling."""
    assert capacity(*BIG, project=RACE)["fits"] == 2
    racing = [
        subprocess.Popen(
            ["runuser", "-u", USER, "--", "slicebox", "--json", "create", "--project", RACE, *BIG],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    ended = [(race.wait(300), *race.communicate()) for race in racing]
    made = [json.loads(out) for code, out, _ in ended if code == 0]
    refusals = [err for code, _, err in ended if code != 0]
    try:
        assert len(made) == 2, ended
        assert len(refusals) == 4
        assert all(err.startswith("slicebox: admission_refused: pids 30:") for err in refusals)
        assert capacity(*BIG, project=RACE)["fits"] == 0
    finally:
        for box in made:
            slicebox("rm", str(box["id"]))
    assert capacity(*BIG, project=RACE)["fits"] == 2
