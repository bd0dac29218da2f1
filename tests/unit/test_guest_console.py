"""The rig's reading of a guest's console (``tests/guest/lib.sh``), fed sample console logs.

A guest whose kernel died answers nothing more; the rig must see that on the console and end
the ssh session at once instead of waiting for time-outs. Here a ``sleep`` stands in for QEMU
and ``tail --pid`` for an ssh session, which ends when QEMU exits and closes its connection.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[2] / "tests" / "guest" / "lib.sh"
GUEST_LOST = 75

BOOT = """\
[    0.000000] Linux version 6.12.43+deb13-amd64 (debian-kernel@lists.debian.org)
[    2.104512] EXT4-fs (vda): mounted filesystem with ordered data mode.
[  OK  ] Started ssh.service - OpenBSD Secure Shell server.\r
"""
OOPS = """\
[   61.337812] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI
[   61.338420] CPU: 1 UID: 0 PID: 1523 Comm: runc:[2:INIT] Not tainted 6.12.43+deb13-amd64 #1
[   61.339001] Hardware name: QEMU Standard PC (i440FX + PIIX, 1996)
[   61.339590] RIP: 0010:pick_next_task_fair+0x3a/0x3f0
[   61.340120] Code: 41 54 55 53 48 83 ec 10 <cc> 1f 44 00 00 48 8b 87 e8 0a 00 00
[   61.352003] Kernel panic - not syncing: Fatal exception in interrupt
[   61.353141] ---[ end Kernel panic - not syncing: Fatal exception in interrupt ]---
"""
SOFT_LOCKUP = """\
[   88.100021] watchdog: BUG: soft lockup - CPU#0 stuck for 23s! [dockerd:812]
[   88.100544] CPU: 0 UID: 0 PID: 812 Comm: dockerd Not tainted 6.12.43+deb13-amd64 #1
"""


def bash(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f'source "{LIB}"; {script}', "-", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def console(tmp_path: Path, text: str) -> Path:
    (tmp_path / "console.log").write_text(text)
    return tmp_path


def test_a_clean_boot_is_no_panic(tmp_path: Path) -> None:
    assert bash('console_panic "$1"', str(console(tmp_path, BOOT))).returncode == 1


def test_a_soft_lockup_report_is_no_panic(tmp_path: Path) -> None:
    # An emulated CPU starved by a busy build machine trips the watchdog; the guest lives on.
    assert bash('console_panic "$1"', str(console(tmp_path, BOOT + SOFT_LOCKUP))).returncode == 1


def test_a_missing_console_is_no_panic(tmp_path: Path) -> None:
    assert bash('console_panic "$1"', str(tmp_path)).returncode == 1


def test_an_oops_prints_the_lines_that_show_it(tmp_path: Path) -> None:
    result = bash('console_panic "$1"', str(console(tmp_path, BOOT + OOPS)))
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].endswith("Oops: int3: 0000 [#1] PREEMPT SMP NOPTI")
    assert any("Comm: runc:[2:INIT]" in line for line in lines)
    assert any("RIP: 0010:pick_next_task_fair" in line for line in lines)
    assert lines[-1].endswith(
        "---[ end Kernel panic - not syncing: Fatal exception in interrupt ]---"
    )
    assert not any("Hardware name" in line or "Code:" in line for line in lines)


@pytest.mark.parametrize(
    "line",
    [
        "[   12.000001] BUG: kernel NULL pointer dereference, address: 0000000000000008",
        "[   12.000001] Kernel panic - not syncing: Attempted to kill init! exitcode=0x0000000b",
        "[   12.000001] Oops: general protection fault, probably for non-canonical address",
    ],
)
def test_each_kind_of_death_is_a_panic(tmp_path: Path, line: str) -> None:
    result = bash('console_panic "$1"', str(console(tmp_path, BOOT + line + "\r\n")))
    assert result.returncode == 0
    assert result.stdout == line + "\n"


def test_only_lines_after_the_offset_count(tmp_path: Path) -> None:
    console(tmp_path, OOPS + BOOT)
    assert bash('console_panic "$1" "$2"', str(tmp_path), str(len(OOPS))).returncode == 1
    assert bash('console_panic "$1" "$2"', str(tmp_path), "0").returncode == 0


@pytest.fixture
def fake_qemu(tmp_path: Path) -> Iterator[int]:
    """A process that stands for QEMU, recorded in the pid file the rig reads.

    Like a daemonized QEMU it is not our child, so it leaves no zombie that looks alive.
    """
    pid_file = tmp_path / "pid"
    subprocess.run(["sh", "-c", 'sleep 120 & echo $! > "$1"', "-", str(pid_file)], check=True)
    pid = int(pid_file.read_text())
    console(tmp_path, BOOT)
    yield pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_session_ends_at_once_when_the_kernel_dies(tmp_path: Path, fake_qemu: int) -> None:
    session = subprocess.Popen(
        [
            "bash",
            "-c",
            f'source "{LIB}"; under_watch "$1" tail --pid="$2" -f /dev/null',
            "-",
            str(tmp_path),
            str(fake_qemu),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)
    assert session.poll() is None, "the session ended while the guest lived"
    with (tmp_path / "console.log").open("a") as log:
        log.write(OOPS)
    started = time.monotonic()
    _, stderr = session.communicate(timeout=20)
    assert session.returncode == GUEST_LOST
    assert time.monotonic() - started < 5
    assert not alive(fake_qemu)
    assert "Oops: int3" in stderr
    assert not (tmp_path / "pid").exists()


def test_a_session_keeps_its_exit_code_while_the_guest_lives(
    tmp_path: Path, fake_qemu: int
) -> None:
    result = bash('under_watch "$1" sh -c "exit 4"', str(tmp_path))
    assert result.returncode == 4
    assert alive(fake_qemu)
    assert (tmp_path / "pid").exists()
