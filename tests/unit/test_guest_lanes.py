"""tests/run-all's guest lanes (``tests/guest/lanes``), without QEMU.

The guest suite runs as two halves at once, each in a guest of its own; a module in no lane
would never run in CI, one in both would run twice, and a lane's failure, lost guest or empty
collection must fail the run as one guest's did. Here a bash function stands in for
``tests/guest/run`` and records what each lane was asked to run, as whom and when.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "tests" / "run-all"
LANES = ROOT / "tests" / "guest" / "lanes"
HOST = ROOT / "tests" / "host"


def lane_entries() -> list[tuple[str, str]]:
    entries = []
    for line in LANES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            lane, module = line.split()
            entries.append((lane, module))
    return entries


def test_every_host_module_is_in_exactly_one_lane() -> None:
    listed = [module for _, module in lane_entries()]
    modules = sorted(path.name for path in HOST.glob("test_*.py"))
    assert sorted(listed) == modules, "tests/guest/lanes must name each tests/host module once"
    assert {lane for lane, _ in lane_entries()} == {"a", "b"}


# A stand-in for tests/guest/run: each call notes its lane, vCPUs, arguments and start time in a
# file of its own under $RECORD (and its end in another), and exits with the code $CODES_<lane>
# lists for the lane's nth call (0 past the list's end).
STUB = r"""
tests/guest/run() {
    local lane=${SLICEBOX_GUEST_LANE:-guest} var codes n
    n=$(ls "$RECORD" | grep -c "^$lane-.*\.json$")
    var=CODES_$lane; read -ra codes <<< "${!var:-}"
    local at; at=$(date +%s.%N)  # the call's start, before a slow Python start on a busy host
    python3 -c 'import json, sys; print(json.dumps({"lane": sys.argv[1], "cpus": sys.argv[2],
        "snapshot": sys.argv[3], "at": float(sys.argv[4]), "args": sys.argv[5:]}))' \
        "$lane" "${SLICEBOX_GUEST_CPUS:-}" "${SLICEBOX_GUEST_SNAPSHOT:-}" "$at" "$@" \
        > "$RECORD/$lane-$n.json.part" && mv "$RECORD/$lane-$n.json.part" "$RECORD/$lane-$n.json"
    echo "collected from $lane"
    echo "===== $((n + 2)) passed in 1.50s ====="
    # Two lanes run at once: each waits (30 s at most; CI's unit tests run beside two guest
    # boots) until the other has started too, so that a busy machine starting one lane late is
    # no failure, while lanes run one after the other still are.
    if [ "$lane" != guest ]; then
        for _ in $(seq 300); do
            ls "$RECORD" | grep -q '^a-.*\.json$' && ls "$RECORD" | grep -q '^b-.*\.json$' && break
            sleep 0.1
        done
    fi
    sleep 0.2
    date +%s.%N > "$RECORD/$lane-$n.end"
    return "${codes[$n]:-0}"
}
"""


class Call(NamedTuple):
    """One call of the stand-in tests/guest/run."""

    lane: str
    cpus: str
    snapshot: str  # SLICEBOX_GUEST_SNAPSHOT as the call had it
    args: list[str]
    at: float


def run_lanes(
    tmp_path: Path, script: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[Call]]:
    record = tmp_path / "record"
    record.mkdir()
    logdir = tmp_path / "logs"
    logdir.mkdir()
    full = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SLICEBOX_")},
        "RECORD": str(record),
        "SLICEBOX_CACHE": str(tmp_path / "cache"),
        **env,
    }
    done = subprocess.run(
        ["bash", "-c", f"source {RUN_ALL}\n{STUB}\nlogdir={logdir}\n{script}"],
        check=False,
        capture_output=True,
        text=True,
        env=full,
        timeout=60,
    )
    calls = [Call(**json.loads(path.read_text())) for path in record.glob("*.json")]
    return done, sorted(calls, key=lambda call: call.at)


GUEST_TESTS = """lanes=(); choose_lanes; guest_tests "$@"; rc=$?
echo "outcome=${outcome[guest]}"; exit $rc"""


def modules_of(lane: str) -> list[str]:
    return [f"tests/host/{module}" for name, module in lane_entries() if name == lane]


def test_two_lanes_run_their_halves_at_once_in_guests_of_one_vcpu(tmp_path: Path) -> None:
    done, calls = run_lanes(tmp_path, GUEST_TESTS)
    assert done.returncode == 0, done.stderr
    assert "outcome=passed" in done.stdout
    by_lane = {call.lane: call for call in calls}
    assert sorted(by_lane) == ["a", "b"]
    for lane in "ab":
        call = by_lane[lane]
        assert call.cpus == "1"
        args = call.args
        assert args[:3] == ["python3", "-m", "pytest"]
        assert args[args.index("-m", 3) + 1] == "host and not load"
        assert args[-len(modules_of(lane)) :] == modules_of(lane)
    # Both lanes had started before either ended.
    ends = sorted(float(path.read_text()) for path in (tmp_path / "record").glob("*.end"))
    assert max(call.at for call in calls) < ends[0]
    # Each lane's lines say whose they are; its own log has them plain.
    assert "[a] collected from a" in done.stdout
    assert "[b] collected from b" in done.stdout
    assert (tmp_path / "logs" / "host-a.log").read_text().startswith("collected from a\n")


def test_one_lane_runs_the_whole_suite_in_the_checkouts_guest(tmp_path: Path) -> None:
    done, calls = run_lanes(tmp_path, GUEST_TESTS, SLICEBOX_GUEST_LANES="1")
    assert done.returncode == 0, done.stderr
    assert [call.lane for call in calls] == ["guest"]
    assert calls[0].cpus == ""  # the guest's own default
    assert not any(arg.startswith("tests/host/") for arg in calls[0].args)
    assert "collected from guest\n" in done.stdout
    assert "[" not in done.stdout


def test_a_guest_already_up_for_the_checkout_runs_the_suite_in_one_lane(tmp_path: Path) -> None:
    done, calls = run_lanes(
        tmp_path, 'guest_alive() { [ "$1" = "$(SLICEBOX_GUEST_LANE= run_dir)" ]; }\n' + GUEST_TESTS
    )
    assert done.returncode == 0, done.stderr
    assert [call.lane for call in calls] == ["guest"]
    assert "tests/guest/up" in done.stderr


def test_a_failing_lane_fails_the_run_and_the_other_lane_still_finishes(tmp_path: Path) -> None:
    done, calls = run_lanes(tmp_path, GUEST_TESTS, CODES_b="1")
    assert done.returncode == 1
    assert "outcome=FAILED (lane b: exit code 1)" in done.stdout
    assert sorted(call.lane for call in calls) == ["a", "b"]
    assert len(list((tmp_path / "record").glob("*.end"))) == 2


def test_a_lane_whose_guest_died_runs_once_more_on_a_cold_boot_and_twice_fails(
    tmp_path: Path,
) -> None:
    done, calls = run_lanes(tmp_path, GUEST_TESTS, CODES_a="75 0", SLICEBOX_GUEST_SNAPSHOT="1")
    assert done.returncode == 0, done.stderr
    assert [call.snapshot for call in calls if call.lane == "a"] == ["1", "0"]
    assert [call.snapshot for call in calls if call.lane == "b"] == ["1"]
    assert "lane a's guest died under the suite (exit code 75): once more on a cold boot" in (
        done.stderr
    )

    again = tmp_path / "again"
    again.mkdir()
    done, calls = run_lanes(again, GUEST_TESTS, CODES_a="75 75")
    assert done.returncode == 1
    assert "outcome=FAILED (lane a's guest died twice under the suite)" in done.stdout


@pytest.mark.parametrize(
    ("codes", "args", "expect_rc", "expect"),
    [
        ({"CODES_a": "5"}, "", 1, "FAILED (no tests were collected in lane a: exit code 5)"),
        ({"CODES_a": "5", "CODES_b": "5"}, "-k x", 1, "in lane a lane b: exit code 5"),
        ({"CODES_b": "5"}, "-k x", 0, "passed (lane b had none of the chosen tests)"),
    ],
)
def test_a_lane_that_collected_nothing_fails_unless_the_arguments_chose_the_other(
    tmp_path: Path, codes: dict[str, str], args: str, expect_rc: int, expect: str
) -> None:
    done, calls = run_lanes(tmp_path, f"set -- {args}\n" + GUEST_TESTS, **codes)
    assert done.returncode == expect_rc, done.stderr
    assert expect in done.stdout
    if args:
        assert all(call.args[-2:] == ["-k", "x"] for call in calls)


def test_each_lane_has_its_own_guest_directory(tmp_path: Path) -> None:
    script = "run_dir; SLICEBOX_GUEST_LANE=a run_dir; SLICEBOX_GUEST_LANE=b run_dir"
    done, _ = run_lanes(tmp_path, script)
    plain, a, b = done.stdout.split()
    assert a == plain + "-a"
    assert b == plain + "-b"
    done, _ = run_lanes(tmp_path / "logs", "SLICEBOX_GUEST_LANE=../x run_dir")
    assert done.returncode != 0
    assert "SLICEBOX_GUEST_LANE must be letters and digits" in done.stderr


def test_the_slowest_guest_tests_are_merged_across_lanes(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    script = r"""
    mkdir -p "$logdir"
    for lane in a b; do
        { echo "== slowest 40 durations =="
          [ $lane = a ] && printf '300.00s call tests/host/test_load.py::t\n2.00s call x::a\n'
          [ $lane = b ] && printf '90.50s call tests/host/test_pool.py::t\n'
          echo; } > "$logdir/host-$lane.log"
    done
    lanes=(a b); phases=(); timings
    """
    done, _ = run_lanes(tmp_path, script)
    assert logs.exists()
    lines = [line.strip() for line in done.stderr.splitlines() if "call " in line]
    assert lines == [
        "300.00s call tests/host/test_load.py::t  (lane a)",
        "90.50s call tests/host/test_pool.py::t  (lane b)",
        "2.00s call x::a  (lane a)",
    ]


def test_the_closing_table_says_each_lane_s_time_and_tests(tmp_path: Path) -> None:
    """Each lane's own line: its seconds, what its pytest closed on, and a second attempt."""
    script = GUEST_TESTS.replace("exit $rc", "lanes=(a b); phases=(); timings; exit $rc")
    done, _ = run_lanes(tmp_path, script, CODES_b="75 0")
    assert done.returncode == 0, done.stderr
    table = [line.split(None, 1) for line in done.stderr.splitlines() if ": " in line]
    lanes = {text: seconds for seconds, text in table if text.startswith("lane ")}
    assert set(lanes) == {
        "lane a: 2 passed",
        "lane b: 3 passed (its second attempt, on a cold boot)",
    }, done.stderr
    assert all(seconds.endswith("s") and seconds[:-1].isdigit() for seconds in lanes.values())


def lane_times(log: Path) -> subprocess.CompletedProcess[str]:
    """tests/guest/lane-times on ``log``."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "guest" / "lane-times"), str(log)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_lane_times_sums_each_module_and_evens_the_lanes(tmp_path: Path) -> None:
    """tests/guest/lane-times: a module's seconds are its tests' setup, call and teardown, per
    lane, and the evened split puts the largest first into the lighter lane."""
    log = tmp_path / "run.log"
    log.write_text(
        "[a] 300.00s call     tests/host/test_load.py::test_x\n"
        "[a] 10.00s setup    tests/host/test_load.py::test_x\n"
        "[a] 50.00s call     tests/host/test_native.py::test_y\n"
        "[b] 200.00s call     tests/host/test_pool.py::test_z\n"
        "[b] 140.00s teardown tests/host/test_exec.py::test_w\n"
        "[b] 0.40s call     tests/host/test_cli.py::test_v\n"
        "[b] tests/host/test_cli.py .....   [ 5%]\n"
    )
    done = lane_times(log)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert "lane a: 360 s" in out
    assert "lane b: 340 s" in out
    assert "     310.0  test_load.py" in out
    evened = out[out.index("evened (lane module, in tests/guest/lanes' order):") :]
    assert "# lane a: 360 s" in evened
    assert "# lane b: 340 s" in evened
    assert {"a       test_load.py", "a       test_native.py"} <= set(evened)
    assert {"b       test_pool.py", "b       test_exec.py", "b       test_cli.py"} <= set(evened)


def test_lane_times_says_what_it_needs_when_the_log_has_no_durations(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("nothing here\n")
    done = lane_times(log)
    assert done.returncode == 1
    assert "run tests/run-all" in done.stdout
