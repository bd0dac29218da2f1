"""The rig's guest snapshots (``tests/guest/lib.sh``, ``tests/guest/qmp.py``), without QEMU.

A resumed guest starts in seconds instead of a 40-60 s cold boot; a snapshot that cannot be
resumed must cost one line and a cold boot, never a failed run. Here stubs stand in for
``qemu-system-x86_64`` and ``qemu-img`` on PATH, a small fake speaks QMP, and bash functions
of the rig are replaced where a test is about the decisions around them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

GUEST = Path(__file__).resolve().parents[2] / "tests" / "guest"
LIB = GUEST / "lib.sh"

STUB_QEMU = """#!/bin/bash
# A QEMU that knows its version and fails to load any state: exit 1 on -incoming, or with
# STUB_QEMU=dies, daemonize (a fake QMP that hangs up at the first question) and "exit while
# loading" the way QEMU does, saying why in its -D log.
echo "qemu $*" >> "$STUB_LOG"
[ "$1" = --version ] && { echo "QEMU emulator version 7.2.0 (stub)"; exit 0; }
case " $* " in *" -incoming "*) ;; *) exit 1 ;; esac
[ "${STUB_QEMU:-}" = dies ] || exit 1
while [ $# -gt 0 ]; do
    case $1 in
        -pidfile) pidfile=$2 ;;
        -D) log=$2 ;;
        -qmp) sock=${2#unix:}; sock=${sock%%,*} ;;
    esac
    shift
done
echo "qemu-system-x86_64: load of migration failed: Input/output error" > "$log"
setsid python3 "$STUB_QMP" "$sock" </dev/null >/dev/null 2>&1 &
echo $! > "$pidfile"
sleep 0.3  # QEMU listens before its -daemonize returns
"""

STUB_QMP = """import socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(1)
conn, _ = server.accept()
conn.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\\n')
conn.recv(4096)
conn.sendall(b'{"return": {}}\\n')
conn.recv(4096)
"""

STUB_IMG = """#!/bin/bash
echo "qemu-img $*" >> "$STUB_LOG"
for last; do :; done
: > "$last"
"""


@pytest.fixture
def rig(tmp_path: Path) -> dict[str, str]:
    """The environment of a rig whose QEMU is a stub and whose cache is tmp_path/cache."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("qemu-system-x86_64", STUB_QEMU), ("qemu-img", STUB_IMG)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    (tmp_path / "fake_qmp.py").write_text(STUB_QMP)
    (tmp_path / "run").mkdir()
    return {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "SLICEBOX_CACHE": str(tmp_path / "cache"),
        "SLICEBOX_GUEST_ACCEL": "tcg",
        "SLICEBOX_GUEST_SNAPSHOT": "1",
        "STUB_LOG": str(tmp_path / "calls.log"),
        "STUB_QMP": str(tmp_path / "fake_qmp.py"),
        "DIR": str(tmp_path / "run"),
    }


def bash(env: dict[str, str], script: str) -> subprocess.CompletedProcess[str]:
    # As tests/guest/up runs the rig: errexit, nounset, pipefail.
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{LIB}"; {script}'],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def snapshot(env: dict[str, str], key: str = "snapshot_key") -> Path:
    """A snapshot of the stub QEMU's kind; its key from KEY, a command of the rig."""
    made = bash(
        env,
        f'snap=$(snapshot_dir); mkdir -p "$snap"; echo state > "$snap/state"; '
        f'echo disk > "$snap/disk.qcow2"; {key} > "$snap/key"; echo "$snap"',
    )
    assert made.returncode == 0, made.stderr
    return Path(made.stdout.strip())


def resume(env: dict[str, str]) -> tuple[int, list[str]]:
    result = bash(env, 'if resume_guest "$DIR"; then exit 0; else exit 1; fi')  # as start_guest
    lines = [line.split("] ", 1)[1] for line in result.stderr.splitlines()]
    return result.returncode, lines


def calls(env: dict[str, str]) -> str:
    log = Path(env["STUB_LOG"])
    return log.read_text() if log.exists() else ""


def test_qemu_exiting_on_incoming_is_one_line_a_dropped_snapshot_and_a_cold_boot(
    rig: dict[str, str],
) -> None:
    snap = snapshot(rig)
    rc, lines = resume(rig)
    assert rc == 1
    assert lines == ["snapshot unusable (QEMU exited while loading the state): cold boot"]
    assert not snap.exists()
    assert "-incoming exec:cat '" + str(snap / "state") + "'" in calls(rig)
    run = Path(rig["DIR"])
    assert not (run / "overlay.qcow2").exists()
    assert not (run / "pid").exists()


def test_qemu_dying_while_loading_says_what_qemu_said(rig: dict[str, str]) -> None:
    snap = snapshot(rig)
    rc, lines = resume({**rig, "STUB_QEMU": "dies"})
    assert rc == 1
    assert lines == [
        "snapshot unusable (QEMU exited while loading the state: "
        "load of migration failed: Input/output error): cold boot"
    ]
    assert not snap.exists()


def test_a_snapshot_for_another_machine_is_dropped_without_starting_qemu(
    rig: dict[str, str],
) -> None:
    snap = snapshot(rig, key="GUEST_MEM=2048 snapshot_key")
    rc, lines = resume(rig)
    assert rc == 1
    assert lines == ["snapshot unusable (saved for another GUEST_MEM): cold boot"]
    assert not snap.exists()
    assert "-incoming" not in calls(rig)


def test_a_snapshot_missing_its_state_is_dropped(rig: dict[str, str]) -> None:
    snap = snapshot(rig)
    (snap / "state").unlink()
    assert resume(rig) == (1, ["snapshot unusable (its state is missing): cold boot"])
    assert not snap.exists()


def test_no_snapshot_yet_says_so(rig: dict[str, str]) -> None:
    assert resume(rig) == (1, ["no snapshot of this guest yet: cold boot, then saving one"])


def test_snapshots_can_be_turned_off(rig: dict[str, str]) -> None:
    snap = snapshot(rig)
    rc, lines = resume({**rig, "SLICEBOX_GUEST_SNAPSHOT": "0"})
    assert (rc, lines) == (1, ["snapshots are off (SLICEBOX_GUEST_SNAPSHOT=0): cold boot"])
    assert (snap / "state").exists()
    assert "-incoming" not in calls(rig)


def test_a_snapshot_being_saved_is_left_alone(rig: dict[str, str]) -> None:
    snap = snapshot(rig)
    holder = subprocess.Popen(["flock", "-x", f"{snap}.lock", "sleep", "30"])
    try:
        for _ in range(50):  # until the holder has the lock
            probe = subprocess.run(["flock", "-n", f"{snap}.lock", "true"], check=False)
            if probe.returncode != 0:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        rc, lines = resume(rig)
    finally:
        holder.kill()
        holder.wait()
    assert (rc, lines) == (1, ["another checkout is saving a snapshot: cold boot"])
    assert (snap / "state").exists()


def test_the_key_fits_every_checkout_and_changes_with_the_machine(rig: dict[str, str]) -> None:
    key = bash(rig, "snapshot_key").stdout
    assert str(GUEST.parents[1]) not in key  # the checkout: one snapshot serves them all
    assert "{src}" in key
    assert "{port}" in key
    assert "QEMU emulator version 7.2.0 (stub)" in key
    assert bash({**rig, "SLICEBOX_GUEST_CPUS": "4"}, "snapshot_key").stdout != key
    assert bash({**rig, "SLICEBOX_GUEST_ACCEL": "kvm"}, "snapshot_key").stdout != key


# start_guest's decisions, with the steps it takes replaced by ones that log and answer as told.
STEPS = """
step() { echo "$1" >> "$DIR/steps"; }
resume_guest() { step resume; local r=${RESUMES%% *}; RESUMES=${RESUMES#* }; return "$r"; }
boot_guest() { step boot; }
save_snapshot() { step save; return "$SAVE"; }
prepare_guest() { step prepare; }
"""


@pytest.mark.parametrize(
    ("resumes", "save", "steps", "how"),
    [
        ("0 ", "0", "resume prepare", "resume"),
        # No usable snapshot: boot, save one, resume it at once (which proves it).
        ("1 0 ", "0", "resume boot save resume prepare", "boot"),
        # The fresh snapshot does not resume: it is dropped, the guest boots again, none saved.
        ("1 1 ", "0", "resume boot save resume boot prepare", "boot"),
        # Not saved, the booted guest runs on.
        ("1 ", "1", "resume boot save prepare", "boot"),
        # Not saved and the guest is gone.
        ("1 ", "2", "resume boot save boot prepare", "boot"),
    ],
)
def test_start_guest_boots_saves_and_resumes_as_needed(
    rig: dict[str, str], resumes: str, save: str, steps: str, how: str
) -> None:
    env = {**rig, "RESUMES": resumes, "SAVE": save}
    result = bash(env, STEPS + 'start_guest "$DIR"')
    assert result.returncode == 0, result.stderr
    run = Path(rig["DIR"])
    assert (run / "steps").read_text().split() == steps.split()
    assert (run / "started").read_text().split()[0] == how


def test_start_guest_saves_nothing_when_snapshots_are_off(rig: dict[str, str]) -> None:
    env = {**rig, "RESUMES": "1 ", "SAVE": "0", "SLICEBOX_GUEST_SNAPSHOT": "0"}
    result = bash(env, STEPS + 'start_guest "$DIR"')
    assert result.returncode == 0, result.stderr
    assert (Path(rig["DIR"]) / "steps").read_text().split() == ["resume", "boot", "prepare"]


# tests/guest/run's decisions around a guest that dies under its command: its steps replaced by
# ones that log, each start saying whether snapshots were on, each command answering from RUNS.
RUN = GUEST / "run"
RUN_STEPS = """
step() { echo "$1" >> "$DIR/steps"; }
eval "$GUEST_DIR/build() { :; }"
run_dir() { echo "$DIR"; }
guest_alive() { return 1; }
stop_guest() { step stop; }
start_guest() {
    step "start-snapshots-${SLICEBOX_GUEST_SNAPSHOT:-1}"
    if [ "${SLICEBOX_GUEST_SNAPSHOT:-1}" = 0 ]; then echo "boot 50" > "$1/started"
    else echo "${HOW:-resume} 5" > "$1/started"; fi
}
run_command() { step command; local r=${RUNS%% *}; RUNS=${RUNS#* }; return "$r"; }
"""


def run_with(rig: dict[str, str], runs: str, how: str = "resume") -> tuple[int, list[str], str]:
    env = {**rig, "RUNS": runs, "HOW": how}
    done = subprocess.run(
        ["bash", "-c", f'source "{RUN}"\n{RUN_STEPS}\nmain python3 -m pytest'],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    return done.returncode, (Path(rig["DIR"]) / "steps").read_text().split(), done.stderr


def test_a_command_whose_resumed_guest_died_runs_once_more_on_a_cold_boot(
    rig: dict[str, str],
) -> None:
    """A resumed guest's kernel died under the five users' load where cold-booted ones did not
    (issue 58): the command runs once more in a cold-booted guest, and the run says so."""
    rc, steps, said = run_with(rig, "75 0 ")
    assert rc == 0, said
    assert steps == [
        "stop",
        "start-snapshots-1",
        "command",
        "stop",
        "start-snapshots-0",
        "command",
        "stop",
    ]
    assert "the guest resumed from the snapshot died: running the command once more on a cold" in (
        said
    )


def test_a_cold_booted_guest_that_died_is_not_run_again(rig: dict[str, str]) -> None:
    rc, steps, said = run_with(rig, "75 0 ", how="boot")
    assert rc == 75
    assert steps.count("command") == 1
    assert "the guest died while running the command (exit code 75); run it again" in said


def test_a_resumed_guest_that_died_twice_says_so(rig: dict[str, str]) -> None:
    rc, steps, said = run_with(rig, "75 75 ")
    assert rc == 75
    assert steps.count("command") == 2
    assert "run it again" in said


# qmp.py against a fake QEMU that answers from a script.
def load_qmp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("guest_qmp", GUEST / "qmp.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["guest_qmp"] = module
    spec.loader.exec_module(module)
    return module


qmp = load_qmp()


class FakeQEMU:
    """Answers each QMP command with the next answer listed for it; records what it was asked."""

    def __init__(self, path: Path, answers: dict[str, list[dict[str, Any]]]) -> None:
        self.answers = answers
        self.asked: list[str] = []
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(path))
        self.server.listen(1)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.server.accept()
        with conn, conn.makefile("rwb") as stream:
            stream.write(b'{"QMP": {"version": {}, "capabilities": []}}\n')
            stream.write(b'{"event": "RESUME", "timestamp": {}}\n')  # events are no answers
            stream.flush()
            for line in stream:
                name = json.loads(line)["execute"]
                self.asked.append(name)
                queue = self.answers.get(name, [{"return": {}}])
                answer = queue.pop(0) if len(queue) > 1 else queue[0]
                if answer.get("hang_up"):
                    return
                stream.write(json.dumps(answer).encode() + b"\n")
                stream.flush()


@pytest.fixture
def qmp_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "qmp.sock"
    yield path
    path.unlink(missing_ok=True)


def test_resume_runs_a_guest_that_comes_back_paused(qmp_socket: Path) -> None:
    status = [{"return": {"status": s}} for s in ("inmigrate", "paused", "running")]
    fake = FakeQEMU(qmp_socket, {"query-status": status})
    assert qmp.main([str(qmp_socket), "resume", "10"]) == 0
    assert fake.asked == [
        "qmp_capabilities",
        "query-status",
        "query-status",
        "cont",
        "query-status",
    ]


def test_save_stops_migrates_and_waits_for_the_end(qmp_socket: Path) -> None:
    migrate = [{"return": {"status": s}} for s in ("active", "completed")]
    fake = FakeQEMU(qmp_socket, {"query-migrate": migrate})
    assert qmp.main([str(qmp_socket), "save", "exec:cat > state", "10"]) == 0
    assert fake.asked == [
        "qmp_capabilities",
        "stop",
        "migrate-set-parameters",
        "migrate",
        "query-migrate",
        "query-migrate",
    ]


def test_a_failed_migration_says_why(qmp_socket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    failed = [{"return": {"status": "failed", "error-desc": "Unable to write to command"}}]
    FakeQEMU(qmp_socket, {"query-migrate": failed})
    assert qmp.main([str(qmp_socket), "save", "exec:cat > state", "10"]) == 1
    assert capsys.readouterr().err == "migration failed: Unable to write to command\n"


def test_a_qemu_that_hangs_up_has_exited(
    qmp_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    FakeQEMU(qmp_socket, {"query-status": [{"hang_up": True}]})
    assert qmp.main([str(qmp_socket), "resume", "10"]) == 1
    assert capsys.readouterr().err == "QEMU closed its QMP socket (QEMU exited)\n"


def test_a_socket_nobody_listens_on_fails_at_once(
    qmp_socket: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(qmp_socket))  # bound, never listening: what a dead QEMU leaves behind
    stale.close()
    assert qmp.main([str(qmp_socket), "resume", "10"]) == 1
    assert "QEMU does not answer" in capsys.readouterr().err
