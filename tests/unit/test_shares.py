"""Per-user shares (issue 38): one user holding its whole share of the exec output budget, of
streams or of transfers in flight is refused with the code of that share, while another user is
served; the bounds for all stay, and admins are bound by them only."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from slicebox.client import Client, wire
from slicebox.core.blocking import inline
from slicebox.core.budget import OutputBudget, exec_reservation
from slicebox.core.shares import Bounds, Full, Tally
from slicebox.model import errors
from slicebox.model.api import CreateSandbox, RunRequest
from slicebox.model.config import parse_config
from slicebox.model.errors import Busy, InvalidRequest, ShareFull
from slicebox.model.exec import MAX_OUTPUT_CAP, ExecRequest, OutputStream, StreamChunk
from slicebox.model.files import FileFormat, FilesQuery
from slicebox.model.shares import DEFAULT_USER_SHARE, SharesConfig
from tests.fakes.threadside import ThreadSide
from tests.unit.agentserver import served, wait_for
from tests.unit.filesworld import FilesWorld
from tests.unit.test_client import _endless, raw_request
from tests.unit.test_service import ALICE, BOB, ORCH, World, endless

CAP = 1000
ONE = exec_reservation(CAP)
ALICE_UID, BOB_UID = ALICE.uid, BOB.uid


# --- the output budget ---------------------------------------------------------------------


def test_a_user_over_its_share_is_refused_by_code_while_another_user_still_fits() -> None:
    budget = OutputBudget.fixed(4 * ONE, share=0.5)
    first, second = budget.reserve(CAP, ALICE_UID), budget.reserve(CAP, ALICE_UID)
    with pytest.raises(ShareFull) as caught:
        budget.reserve(CAP, ALICE_UID)
    assert (caught.value.code, caught.value.http_status, caught.value.retry_after) == (
        "output_share_full",
        429,
        1,
    )
    assert caught.value.message == (
        "your execs in flight (2) hold 23.4 KiB of your 23.4 KiB share (uid 1000) of the "
        "agent's 46.9 KiB exec output budget and this exec needs 11.7 KiB; wait for one of "
        "them to end, ask for a smaller output_cap, or retry after a second"
    )
    with budget.reserve(CAP, BOB_UID), budget.reserve(CAP, BOB_UID):
        assert budget.in_use == 4 * ONE
        # Both full: the caller's own share is what it is told about.
        with pytest.raises(ShareFull):
            budget.reserve(CAP, ALICE_UID)
    first.release()
    assert (budget.held_by(ALICE_UID), budget.held_by(BOB_UID)) == (ONE, 0)
    budget.reserve(CAP, ALICE_UID).release()  # room in her share again
    second.release()
    assert budget.in_use == 0


def test_the_budget_for_all_still_binds_under_the_shares_and_admins_hold_no_share() -> None:
    budget = OutputBudget.fixed(4 * ONE, share=0.5)
    admin = [budget.reserve(2 * CAP, None), budget.reserve(CAP, None)]  # more than half
    with budget.reserve(CAP, BOB_UID), pytest.raises(Busy) as caught:
        budget.reserve(CAP, ALICE_UID)  # her share is empty: the budget is full
    for held in admin:
        held.release()
    assert (caught.value.code, caught.value.http_status) == ("busy", 503)
    assert caught.value.retry_after == 1
    assert budget.in_use == 0


def test_a_cap_over_a_users_share_could_never_run_and_says_so() -> None:
    budget = OutputBudget.fixed(4 * ONE, share=0.5)
    with pytest.raises(InvalidRequest) as caught:
        budget.reserve(3 * CAP, ALICE_UID)
    assert caught.value.code == "output_cap_over_budget"
    assert "one user's share (23.4 KiB)" in caught.value.message
    assert caught.value.message.endswith(f"at most {2 * CAP} bytes")
    budget.reserve(3 * CAP, None).release()  # an admin's may


def test_concurrent_takes_never_pass_the_share_or_the_total() -> None:
    tally, bounds = Tally(), Bounds(total=10, each=3)
    taken, refused = [], []
    for holder in [ALICE_UID] * 5 + [BOB_UID] * 5 + [None] * 6:
        try:
            taken.append((holder, tally.take(holder, 1, bounds)))
        except Full as full:
            refused.append((holder, full.standing.share))
    assert [h for h, _ in taken].count(ALICE_UID) == 3
    assert [h for h, _ in taken].count(BOB_UID) == 3
    assert tally.in_use == 10
    assert refused == [(ALICE_UID, True)] * 2 + [(BOB_UID, True)] * 2 + [(None, False)] * 2
    for _, held in taken:
        held.release()
        held.release()  # given back once
    assert (tally.in_use, tally.held_by(ALICE_UID)) == (0, 0)


# --- the service: execs, streams, transfers -------------------------------------------------


def test_alice_holding_her_share_leaves_bobs_exec_served(tmp_path: Path) -> None:
    world = World(tmp_path, budget=OutputBudget.fixed(4 * ONE, share=0.5))
    mine, his = world.create(ALICE), world.create(BOB)
    endless(world)
    holding = ThreadSide(world.service).exec_stream(
        ALICE, mine, ExecRequest(argv=("yes",), output_cap=2 * CAP)
    )
    next(holding)  # her whole share, held while her stream runs
    with pytest.raises(ShareFull) as caught:
        ThreadSide(world.service).exec(ALICE, mine, ExecRequest(argv=("x",), output_cap=CAP))
    assert caught.value.code == "output_share_full"
    world.run.script = [[StreamChunk(stream=OutputStream.STDOUT, data=b"hi\n")], None]
    served_bob = ThreadSide(world.service).exec(
        BOB, his, ExecRequest(argv=("x",), output_cap=2 * CAP)
    )
    assert served_bob.stdout == b"hi\n"
    holding.close()
    assert world.budget.in_use == 0
    refusals = [e for e in world.journal.entries if e["SLICEBOX_EVENT"] == "request_refused"]
    assert [(e["SLICEBOX_RESULT"], e["SLICEBOX_CALLER_UID"]) for e in refusals] == [
        ("output_share_full", "1000")
    ]


def shares(world: World, table: str) -> None:
    world.sandboxes.reconfigure(parse_config(f"[shares]\n{table}"))


def test_streams_are_bound_per_user_then_for_all_and_refusals_audited(tmp_path: Path) -> None:
    world = World(tmp_path)
    shares(world, "streams_in_flight = 4")
    mine = world.create(ALICE)
    alice = [world.service.reserve_stream(ALICE, CAP, "exec", mine) for _ in range(2)]
    with pytest.raises(ShareFull) as caught:
        world.service.reserve_stream(ALICE, CAP, "exec", mine)
    assert caught.value.code == "stream_share_full"
    assert caught.value.message.startswith(
        "uid 1000 (alice) has 2 streamed execs and runs in flight, its whole share (2 of the "
        "agent's streams_in_flight 4, [shares] user_share); end one of them"
    )
    assert world.budget.in_use == 2 * ONE, "the refused stream reserved no output"
    bob = world.service.reserve_stream(BOB, CAP, "run")
    orch = world.service.reserve_stream(ORCH, CAP, "run")  # an admin: no share, the total
    with pytest.raises(Busy) as full:
        world.service.reserve_stream(BOB, CAP, "run")
    assert (full.value.code, full.value.http_status) == ("streams_busy", 503)
    world.service.reserve(BOB, CAP).release()  # a plain exec holds no stream
    for held in (*alice, bob, orch):
        held.release()
    assert (world.service.streams.in_use, world.budget.in_use) == (0, 0)
    refusals = [e for e in world.journal.entries if e["SLICEBOX_EVENT"] == "request_refused"]
    assert [e["SLICEBOX_RESULT"] for e in refusals] == ["stream_share_full", "streams_busy"]


def test_a_stream_whose_output_does_not_fit_gives_its_slot_back(tmp_path: Path) -> None:
    world = World(tmp_path, budget=OutputBudget.fixed(ONE, share=1.0))
    with world.budget.reserve(CAP), pytest.raises(Busy):
        world.service.reserve_stream(ALICE, CAP)
    assert world.service.streams.in_use == 0


async def first_then_refused(world: FilesWorld, mine: str, his: str) -> list[bytes]:
    query = FilesQuery(path="/workspace/big", format=FileFormat.FILE)
    files = world.service.files
    holding = files.download(ALICE, mine, query, inline)
    try:
        await anext(holding)  # her one transfer moves
        with pytest.raises(ShareFull) as caught:
            await anext(files.download(ALICE, mine, query, inline))
        assert caught.value.code == "transfer_share_full"
        return [chunk async for chunk in files.download(BOB, his, query, inline)]
    finally:
        await holding.aclose()


def test_alice_moving_her_share_of_transfers_leaves_bobs_transfer_served(tmp_path: Path) -> None:
    world = FilesWorld(tmp_path)
    shares(world, "transfers_in_flight = 2")
    (world.root / "workspace" / "big").write_bytes(data := os.urandom(1024 * 1024))
    mine, his = world.create(ALICE), world.create(BOB)
    assert b"".join(asyncio.run(first_then_refused(world, mine, his))) == data
    assert world.service.files.slots.in_use == 0
    results = [(e["SLICEBOX_EVENT"], e["SLICEBOX_RESULT"]) for e in world.transfers()]
    assert sorted(results) == [
        ("file_transfer", "abandoned"),
        ("file_transfer", "ok"),
        ("request_refused", "transfer_share_full"),
    ]


# --- the config, the wire --------------------------------------------------------------------


def test_the_shares_config_has_documented_defaults_and_refuses_nonsense() -> None:
    default = parse_config("").shares
    assert default == SharesConfig(user_share=0.5, streams_in_flight=64, transfers_in_flight=32)
    assert DEFAULT_USER_SHARE == 0.5
    # The load test's five users with eight clients each: never near a share.
    assert default.share_of(default.streams_in_flight) >= 16
    assert default.share_of(default.transfers_in_flight) >= 16
    assert parse_config("[shares]\nuser_share = 1").shares.share_of(3) == 3
    assert parse_config("[shares]\nuser_share = 0.01").shares.share_of(3) == 1
    for bad in ("user_share = 0", "user_share = 1.5", "streams_in_flight = 0", "colour = 1"):
        with pytest.raises(errors.ConfigError):
            parse_config(f"[shares]\n{bad}")


def test_a_share_refusal_reaches_the_client_as_share_full() -> None:
    assert wire.error_class("output_share_full", 429) is ShareFull
    assert wire.error_class("streams_busy", 503) is errors.Unavailable
    assert wire.error_class("busy", 503) is Busy


def test_a_full_bound_answers_with_retry_after_through_the_socket(tmp_path: Path) -> None:
    """The routes take a stream for a streamed exec or run (as root here: the total binds)."""
    world = World(tmp_path)
    shares(world, "streams_in_flight = 1")
    with served(tmp_path, world) as agent:
        client = Client(agent.socket)
        box = client.create(CreateSandbox(project="web"))
        _endless(agent)  # more than the socket holds: the stream waits for its reader
        events = client.exec_stream(box.id, ExecRequest(argv=("yes",), output_cap=MAX_OUTPUT_CAP))
        assert isinstance(next(events), StreamChunk)
        answer = raw_request(agent.socket, f"/v1/sandboxes/{box.id}/exec/stream", EXEC)
        with pytest.raises(errors.Unavailable) as caught:
            next(client.run_stream(RunRequest(sandbox=CreateSandbox(project="web"), exec=EXEC)))
        events.close()
        wait_for(lambda: world.service.streams.in_use == 0)
        client.destroy(box.id)
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 503 ")
    assert b"\r\nretry-after: 1" in head
    assert b'"code": "streams_busy"' in answer
    assert caught.value.code == "streams_busy"


EXEC = ExecRequest(argv=("true",))
