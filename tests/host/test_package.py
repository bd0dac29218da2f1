"""The .deb on a real host: install, use, upgrade, remove and purge it with apt, as an operator.

The packages come from ``packaging/build`` on the build machine (``tests/run-all`` builds
``dist/slicebox_<version>_all.deb`` and a higher version in ``dist/upgrade/``); the guest sees
them at /src/dist. A missing package is a failure, never a skip. The guest has no network:
the package's dependencies are already installed in the image, so apt resolves them locally.

Other host tests install the checkout's units into /run/systemd/system; this one installs the
package's into /usr/lib/systemd/system and leaves the guest as it found it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from slicebox.model.audit import MESSAGE_IDS, AuditEvent
from tests.host.agentunits import CONFIG, SOCKET, TEST_CONFIG, curl_health, prop
from tests.host.helpers import TEST_IMAGE, sh, unique, wait_for
from tests.host.sliceboxhost import active, cleanup_slices, slicebox_units

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
VERSION = str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])
USER = "sbxpkg"
GROUPS = ("slicebox", "slicebox-admin")
UNITS = ("slicebox.service", "slicebox.socket")
PACKAGED_UNITS = Path("/usr/lib/systemd/system")
CATALOG_ID = MESSAGE_IDS[AuditEvent.SANDBOX_CREATED]
APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


def find_package(directory: Path, version: str | None = None) -> Path:
    pattern = f"slicebox_{version or '*'}_all.deb"
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        pytest.fail(
            f"expected one {pattern} in {directory}, found {[p.name for p in found]}: "
            "build them on the build machine first (tests/run-all does: packaging/build)"
        )
    return found[0]


def apt(*argv: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["apt-get", "-y", "-q", *argv], capture_output=True, text=True, env=APT_ENV, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def package_state() -> str:
    """dpkg's two-letter state: 'ii' installed, 'rc' removed with config, '' unknown."""
    status = sh("dpkg-query", "-W", "-f", "${db:Status-Abbrev}", "slicebox", check=False)
    return status.stdout.strip() if status.returncode == 0 else ""


def installed_version() -> str:
    if package_state() != "ii":
        return ""
    return sh("dpkg-query", "-W", "-f", "${Version}", "slicebox").stdout.strip()


def group_exists(group: str) -> bool:
    return sh("getent", "group", group, check=False).returncode == 0


def as_user(*argv: str) -> subprocess.CompletedProcess[str]:
    """The packaged CLI (/usr/bin, not the checkout's /usr/local/bin) as the test's user."""
    return subprocess.run(
        ["runuser", "-u", USER, "--", "/usr/bin/slicebox", *argv],
        capture_output=True,
        text=True,
        check=False,
    )


def containers_of(user: str) -> list[str]:
    out = sh("docker", "ps", "-aq", "--filter", f"label=slicebox.user={user}").stdout
    return out.split()


def deadline_timers(sandbox_id: str) -> list[str]:
    """The systemd timers holding the sandbox's deadline (they outlive the package)."""
    return slicebox_units(f"slicebox-ttl-{sandbox_id}-*.timer")


def remove_sandbox(container: str) -> None:
    """What an operator does with a sandbox the removed package left: the container and the
    timer that would otherwise still kill it at its deadline."""
    labels = json.loads(sh("docker", "inspect", container).stdout)[0]["Config"]["Labels"]
    sh("docker", "rm", "-f", container)
    for timer in deadline_timers(labels.get("slicebox.sandbox_id", "none")):
        sh("systemctl", "stop", timer)


def container_state(container: str) -> dict[str, object]:
    return dict(json.loads(sh("docker", "inspect", container).stdout)[0]["State"])


def audit_events(root_task: str) -> list[dict[str, str]]:
    out = sh("journalctl", "--no-pager", "-o", "json", "-u", "slicebox.service").stdout
    entries = [json.loads(line) for line in out.splitlines()]
    return [e for e in entries if e.get("SLICEBOX_ROOT_TASK_ID") == root_task]


def catalog_knows_slicebox() -> bool:
    return CATALOG_ID in sh("journalctl", "--list-catalog").stdout


@pytest.fixture
def operator_host() -> Iterator[None]:
    """The guest before and after: no slicebox package, no test units, the same groups."""
    if package_state():
        pytest.fail(f"slicebox is already known to dpkg ({package_state()}): a run left it")
    shadowing = [unit for unit in UNITS if (Path("/run/systemd/system") / unit).exists()]
    assert not shadowing, f"runtime units would shadow the package's: {shadowing}"
    assert not CONFIG.parent.exists(), f"{CONFIG.parent} exists before the package installs it"
    groups_before = {group: group_exists(group) for group in GROUPS}
    slice_was_active = active("slicebox.slice")
    try:
        yield
    finally:
        if package_state():
            apt("purge", "slicebox")
        for container in containers_of(USER):
            remove_sandbox(container)
        user_slices = [u for u in slicebox_units(f"slicebox-{USER}*") if u.endswith(".slice")]
        cleanup_slices(*user_slices, *([] if slice_was_active else ["slicebox.slice"]))
        sh("userdel", USER, check=False)
        for group, existed in groups_before.items():
            if not existed and group_exists(group):
                sh("groupdel", group)
        sh("rm", "-rf", str(CONFIG.parent), "/run/slicebox")
        sh("systemctl", "daemon-reload")


def test_install_use_upgrade_remove_and_purge_the_deb(operator_host: None) -> None:
    first = find_package(DIST, VERSION)
    upgrade = find_package(DIST / "upgrade")
    newer = upgrade.name.split("_")[1]
    assert sh("dpkg", "--compare-versions", newer, "gt", VERSION, check=False).returncode == 0

    # Install: the dependencies are the guest's Debian packages; the socket is enabled and
    # listening, the agent starts on the first request; the groups exist.
    apt("install", str(first))
    assert installed_version() == VERSION
    assert_packaged_code_is_the_checkouts()
    assert prop("slicebox.socket", "FragmentPath") == str(PACKAGED_UNITS / "slicebox.socket")
    assert sh("systemctl", "is-enabled", "slicebox.socket").stdout.strip() == "enabled"
    assert active("slicebox.socket")
    assert sh("stat", "-c", "%a %G", str(SOCKET)).stdout.split() == ["660", "slicebox"]
    assert all(group_exists(group) for group in GROUPS)
    assert catalog_knows_slicebox()

    # The operator points the default image at the guest's local one: a modified conffile.
    # (The agent is not running yet: the socket starts it with this config.)
    assert prop("slicebox.service", "ActiveState") == "inactive"
    CONFIG.write_text(CONFIG.read_text() + "\n" + TEST_CONFIG)
    edited = CONFIG.read_text()

    sh("useradd", "--no-create-home", "--shell", "/bin/sh", "--groups", "slicebox", USER)
    root = unique("pkg-")
    ran = as_user("run", "--project", "pkg", "--root-task", root, "--", "echo", "hi")
    assert (ran.returncode, ran.stdout) == (0, "hi\n"), ran.stderr
    assert active("slicebox.service")
    wait_for(lambda: len(audit_events(root)) >= 3, timeout=30)
    story = audit_events(root)
    assert [e["SLICEBOX_EVENT"] for e in story] == ["sandbox_created", "exec", "sandbox_destroyed"]
    assert {e["SLICEBOX_CALLER_UID"] for e in story} == {sh("id", "-u", USER).stdout.strip()}

    # A long-lived sandbox, to live through the upgrade and the removal.
    created = as_user("--json", "create", "--project", "pkglong", "--ttl", "3600")
    assert created.returncode == 0, created.stderr
    box = json.loads(created.stdout)
    started_at = container_state(box["container_id"])["StartedAt"]
    old_pid = prop("slicebox.service", "MainPID")

    # Upgrade: the edited config is kept, the running agent is restarted with the new code,
    # the sandbox keeps running and answers.
    apt("install", str(upgrade))
    assert installed_version() == newer
    assert CONFIG.read_text() == edited
    assert sorted(p.name for p in CONFIG.parent.iterdir()) == ["config.toml"]  # no .dpkg-*
    assert active("slicebox.service")
    assert prop("slicebox.service", "MainPID") not in {old_pid, "0"}
    assert curl_health()["version"] == newer
    assert container_state(box["container_id"])["StartedAt"] == started_at
    still = as_user("exec", box["id"], "--", "echo", "still here")
    assert (still.returncode, still.stdout) == (0, "still here\n"), still.stderr
    listed = json.loads(as_user("--json", "ps").stdout)
    assert [sandbox["id"] for sandbox in listed] == [box["id"]]

    # Remove: socket and agent stopped cleanly and gone; the sandbox is left to the operator.
    apt("remove", "slicebox")
    assert package_state() == "rc"
    for unit in UNITS:
        assert prop(unit, "ActiveState") == "inactive"
        assert prop(unit, "LoadState") == "not-found"
    assert prop("slicebox.service", "Result") == "success"
    assert not SOCKET.exists()
    assert sh("pgrep", "-f", "sliceboxd", check=False).stdout == ""
    assert not Path("/usr/bin/slicebox").exists()
    assert not Path("/usr/lib/slicebox").exists()  # byte code removed too
    assert CONFIG.read_text() == edited  # remove keeps conffiles; purge removes them
    assert not catalog_knows_slicebox()
    assert container_state(box["container_id"])["Running"] is True
    image = sh("docker", "inspect", "-f", "{{.Config.Image}}", box["container_id"]).stdout
    assert image.strip() == TEST_IMAGE  # the edited default_image was in force

    # Its deadline still holds: systemd's timer does not need the agent or the package.
    assert deadline_timers(box["id"]), "the sandbox's deadline timer outlives the package"
    # The operator cleans up what was left to them.
    remove_sandbox(box["container_id"])
    assert deadline_timers(box["id"]) == []

    # Purge: config and enablement forgotten, catalog rebuilt without slicebox; groups kept.
    apt("purge", "slicebox")
    assert package_state() == ""
    assert not CONFIG.parent.exists()
    assert not Path("/etc/systemd/system/sockets.target.wants/slicebox.socket").is_symlink()
    assert all(group_exists(group) for group in GROUPS)


def assert_packaged_code_is_the_checkouts() -> None:
    """The package under test was built from this checkout (dist/ is not stale)."""
    checkout = ROOT / "agent" / "slicebox"
    packaged = Path("/usr/lib/slicebox/slicebox")
    stale = [
        path.name
        for path in checkout.glob("*.py")
        if not (packaged / path.name).exists()
        or (packaged / path.name).read_bytes() != path.read_bytes()
    ]
    assert not stale, f"dist/ is stale ({stale} differ): rebuild it with packaging/build"
