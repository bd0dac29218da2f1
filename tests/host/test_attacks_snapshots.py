"""Snapshots as a hostile member of group ``slicebox`` attacks them (issue 59), through the
installed agent, as real users (``runuser``):

- a snapshot taken while a second sandbox on the same volume keeps swapping a directory of it
  for a symlink to the host's volume store (``/var/lib/docker/volumes``, where another user's
  volume and Docker's own root-only database are): 20 snapshots, the swaps counted during each,
  each snapshot read through a fork of it as its user would read it, which finds the
  sandbox's own files in every one and nothing of another user's volume or of the host;
- images an attacker brings into the engine's store (as a pull would: here ``docker import``,
  since the guest reaches no registry) labelled as another user's snapshots: not in his list,
  not on his quota, not his to delete or fork, and one without a name breaks no one's list;
- a snapshot deleted while a fork runs it: its bytes stay on its owner's quota until the fork
  is gone, and an agent restarted meanwhile frees them (its first reaper pass).

The tests that take a user's snapshots leave none behind, and the module removes every
sandbox, volume and image it made (and its users)."""

from __future__ import annotations

import io
import subprocess
import tarfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from slicebox.model.snapshots import snapshot_image
from tests.host.agentunits import TEST_CONFIG, admin, installed_agent, prop, remove_sandboxes
from tests.host.helpers import ordinary_user, sh, wait_for
from tests.host.test_snapshots import ask, create, out

pytestmark = pytest.mark.host

ALICE, BOB = "sbxsnx", "sbxsny"
MAX_COUNT = 5
# One busybox snapshot with the 12 MiB of the quota test fits (14.6 MB), two do not; a batch of
# the race test's five small ones (2 MB each) does.
CONFIG = TEST_CONFIG + f'[snapshots]\nmax_count = {MAX_COUNT}\nmax_bytes = "24MB"\n'
STORE = "/var/lib/docker/volumes"  # the host's volume store: every user's volumes, Docker's db
ALICE_MARK = "alice-own-file"
BOB_MARK = "bob-volume-secret-a7c1"
SNAPSHOTS, BATCH = 20, MAX_COUNT  # a batch is taken, then forked, read and deleted
FILES = 200  # in the swapped directory: its walk takes a while, the window a race needs


@pytest.fixture(scope="module")
def agent() -> Iterator[None]:
    with installed_agent(CONFIG), ordinary_user(ALICE), ordinary_user(BOB):
        sh("systemctl", "start", "slicebox.socket")
        try:
            yield
        finally:
            remove_sandboxes((ALICE, BOB))
            for user in (ALICE, BOB):
                label = f"label=slicebox.user={user}"
                for volume in sh("docker", "volume", "ls", "-q", "--filter", label).stdout.split():
                    sh("docker", "volume", "rm", "-f", volume, check=False)
            images = sh("docker", "images", "-q", "--filter", "label=slicebox-snapshot=true")
            for image in sorted(set(images.stdout.split())):
                sh("docker", "rmi", "-f", image, check=False)


def pid_of(box: str) -> int:
    found = sh("docker", "inspect", "-f", "{{.State.Pid}}", admin().get(box).container_id)
    return int(found.stdout.strip())


def swaps(pid: int) -> int:
    """How many times the swapping sandbox has swapped so far (its own /tmp, read as root).
    The shell truncates the file before it writes the next count: a read in between finds it
    empty (or half written), and is made again."""
    path = Path(f"/proc/{pid}/root/tmp/swaps")
    for _ in range(1000):
        text = path.read_text().strip()
        if text.isdigit():
            return int(text)
        time.sleep(0.001)
    raise AssertionError(f"{path} never held a count")


# The swapped directory's own files; names of the store's too, so that a walk which follows
# the link finds them there (Docker's database, another user's volume).
SEED = f"""
cd /workspace && mkdir -p keep d && echo {ALICE_MARK} > mine.txt && echo {ALICE_MARK} > keep/a.txt
i=0; while [ $i -lt {FILES} ]; do echo {ALICE_MARK} > d/f$i; i=$((i+1)); done
echo {ALICE_MARK} > d/metadata.db
mkdir -p d/slicebox-{BOB}-loot/_data && echo {ALICE_MARK} > d/slicebox-{BOB}-loot/_data/secret.txt
"""
SWAP = f"""
cd /workspace; n=0
while :; do
  mv d t && ln -s {STORE} d && rm d && mv t d
  n=$((n+1)); echo $n > /tmp/swaps
done
"""
# A fork's /workspace: every path, then every regular file without alice's mark, then every
# file with bob's.
SCAN = f"""
cd /workspace && find . | sort; echo ---
find . -type f -exec grep -L {ALICE_MARK} {{}} + ; echo ---
find . -type f -exec grep -l {BOB_MARK} {{}} + ; true
"""


def allowed_paths() -> set[str]:
    """Every path a snapshot of alice's /workspace may hold (the swapped directory under
    either of its names, ``t`` read as ``d``)."""
    below = [f"f{i}" for i in range(FILES)] + ["metadata.db", f"slicebox-{BOB}-loot"]
    below += [f"slicebox-{BOB}-loot/_data", f"slicebox-{BOB}-loot/_data/secret.txt"]
    return {".", "./mine.txt", "./keep", "./keep/a.txt", "./d", *(f"./d/{p}" for p in below)}


def read_through_a_fork(name: str) -> tuple[set[str], list[str], list[str]]:
    """A fork of alice's snapshot ``name``, its /workspace scanned as alice, then removed."""
    fork = create(ALICE, from_snapshot=name)
    try:
        paths, foreign, bobs = out(ALICE, fork, SCAN).split("---\n")
    finally:
        ask(ALICE, "DELETE", f"/sandboxes/{fork}")
    normal = {("./d" + p[3:]) if p.startswith("./t") else p for p in paths.split()}
    return normal, foreign.split(), bobs.split()


def test_a_snapshot_taken_while_a_neighbour_swaps_a_directory_for_a_link_holds_its_own_only(
    agent: None,
) -> None:
    """The swaps are counted around each snapshot's call (its walk is within it): every one
    must have raced with some, or the test proved nothing."""
    race = {"kind": "volume", "name": "race"}
    bobs = create(BOB, workspace={"kind": "volume", "name": "loot"})
    out(BOB, bobs, f"echo {BOB_MARK} > /workspace/secret.txt")
    box = create(ALICE, workspace=race)
    out(ALICE, box, SEED)
    swapper = create(ALICE, workspace=race, cpus=0.25, command=["sh", "-c", SWAP])
    swapping = pid_of(swapper)
    wait_for(lambda: Path(f"/proc/{swapping}/root/tmp/swaps").exists(), timeout=60)
    counted: list[int] = []
    for batch in range(SNAPSHOTS // BATCH):
        names = [f"race{batch * BATCH + n}" for n in range(BATCH)]
        ask(ALICE, "POST", f"/sandboxes/{swapper}/resume")
        for name in names:
            before = swaps(swapping)
            taken = ask(ALICE, "POST", f"/sandboxes/{box}/snapshots", {"name": name})
            assert taken.get("name") == name, taken
            counted.append(swaps(swapping) - before)
        ask(ALICE, "POST", f"/sandboxes/{swapper}/pause")  # its CPU to the forks meanwhile
        with ThreadPoolExecutor(max_workers=BATCH) as pool:
            scans = list(pool.map(read_through_a_fork, names))
        for name, (paths, foreign, found_bobs) in zip(names, scans, strict=True):
            assert {"./mine.txt", "./keep/a.txt"} <= paths, f"{name}: its own files"
            assert paths <= allowed_paths(), f"{name}: {sorted(paths - allowed_paths())[:20]}"
            assert foreign == [], f"{name}: files not alice's: {foreign[:20]}"
            assert found_bobs == [], f"{name}: bob's volume: {found_bobs}"
            assert ask(ALICE, "DELETE", f"/snapshots/{name}") == {"name": name, "deleted": True}
    print(f"swaps during each of the {SNAPSHOTS} snapshots: {counted}")
    assert all(n > 0 for n in counted), f"a snapshot was taken with nothing swapping: {counted}"
    ask(ALICE, "POST", f"/sandboxes/{swapper}/resume")
    for sandbox in (swapper, box, bobs):
        admin().destroy(sandbox)


def forged_image(tag: str, labels: dict[str, str]) -> None:
    """An image in the engine's store carrying ``labels``, as a pull of one would leave it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("forged")
        data = tag.encode()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    changes = [arg for k, v in labels.items() for arg in ("--change", f"LABEL {k}={v}")]
    argv = ["docker", "import", *changes, "-", tag]
    subprocess.run(argv, input=buffer.getvalue(), capture_output=True, check=True)


def test_images_labelled_as_bob_s_snapshots_are_not_his(agent: None) -> None:
    forged = [f"slicebox-test/forged:{n}" for n in range(MAX_COUNT + 1)]
    for n, tag in enumerate(forged):
        labels = {"slicebox-snapshot": "true", "slicebox-snapshot.user": BOB}
        labels |= {"slicebox-snapshot.name": f"forged{n}"} if n < MAX_COUNT else {}
        forged_image(tag, labels)
    try:
        assert ask(BOB, "GET", "/snapshots") == {"list": []}, "no 500, and none of them his"
        everyone = admin().request("GET", "/snapshots")
        assert not [s for s in everyone if s["user"] == BOB], everyone
        box = create(BOB)
        taken = ask(BOB, "POST", f"/sandboxes/{box}/snapshots", {"name": "mine"})
        assert taken.get("name") == "mine", f"{MAX_COUNT} forged images filled his quota: {taken}"
        listed = ask(BOB, "GET", "/snapshots")["list"]
        assert isinstance(listed, list)
        assert [s["name"] for s in listed] == ["mine"]
        assert ask(BOB, "DELETE", "/snapshots/forged0").get("code") == "not_found"
        forked = ask(BOB, "POST", "/sandboxes", {"project": "snap", "from_snapshot": "forged0"})
        assert forked.get("code") == "not_found", forked
        assert ask(BOB, "DELETE", "/snapshots/mine") == {"name": "mine", "deleted": True}
        admin().destroy(box)
        for tag in forged:
            assert sh("docker", "image", "inspect", tag, check=False).returncode == 0, tag
    finally:
        for tag in forged:
            sh("docker", "rmi", "-f", tag, check=False)


def image_exists(image_id: str) -> bool:
    return sh("docker", "image", "inspect", image_id, check=False).returncode == 0


def test_a_deleted_snapshot_a_fork_runs_holds_its_bytes_until_a_restarted_agent_frees_them(
    agent: None,
) -> None:
    box = create(ALICE, memory="256MB")
    out(ALICE, box, "dd if=/dev/urandom of=/workspace/big bs=1M count=12 2>/dev/null")
    taken = ask(ALICE, "POST", f"/sandboxes/{box}/snapshots", {"name": "held"})
    assert taken.get("name") == "held", taken
    image_id = sh("docker", "image", "inspect", "-f", "{{.Id}}", snapshot_image(ALICE, "held"))
    image = image_id.stdout.strip()
    fork = create(ALICE, from_snapshot="held")
    assert ask(ALICE, "DELETE", "/snapshots/held") == {"name": "held", "deleted": True}
    assert ask(ALICE, "GET", "/snapshots") == {"list": []}
    assert image_exists(image), "the engine keeps what a fork runs"
    over = ask(ALICE, "POST", f"/sandboxes/{box}/snapshots", {"name": "again"})
    assert over.get("code") == "snapshot_quota", f"the fork's image took no room: {over}"
    assert "forks still run" in str(over.get("message")), over
    # The fork goes while no agent runs (as a killed container would): what frees its image
    # is the next agent's first reaper pass, from the engine's tags alone.
    container = admin().get(fork).container_id
    sh("systemctl", "stop", "slicebox.service")
    sh("docker", "rm", "-f", container)
    assert image_exists(image), "no agent, no release"
    sh("systemctl", "start", "slicebox.service")
    wait_for(lambda: prop("slicebox.service", "ActiveState") == "active", timeout=120)
    wait_for(lambda: not image_exists(image), timeout=120)
    again = ask(ALICE, "POST", f"/sandboxes/{box}/snapshots", {"name": "again"})
    assert again.get("name") == "again", again
    assert ask(ALICE, "DELETE", "/snapshots/again") == {"name": "again", "deleted": True}
    admin().destroy(box)
    left = sh("docker", "images", "-q", "--filter", f"label=slicebox-snapshot.user={ALICE}")
    assert left.stdout.split() == [], "a snapshot no fork runs is gone at its delete"
