"""One pull per image however many creates wait for it, each told its progress; a failure is
each one's; creates that all went away end the pull; the progress of a create reaches a
streamed answer's events in order, and only the latest of each phase waits for a slow reader."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator

import pytest

from slicebox.core import progress
from slicebox.core.blocking import inline
from slicebox.core.gitcounts import GitCounts
from slicebox.core.progress import ProgressFeed, with_progress
from slicebox.core.pulls import PullFor, Pulls, puller_of
from slicebox.host.identity import Identity
from slicebox.model.errors import Busy, ImagePullFailed, ShareFull
from slicebox.model.progress import Phase, ProgressEvent
from slicebox.model.pulls import RegistryCredential
from slicebox.model.shares import SharesConfig

IMAGE = "localhost:5000/big:1"


def pulling(done: int, total: int = 100) -> ProgressEvent:
    return ProgressEvent(phase=Phase.PULLING, subject=IMAGE, done=done, total=total)


class Puller:
    """Pulls when told to: ``go`` ends each pull with ``error`` (or success)."""

    def __init__(self) -> None:
        self.pulls: list[str] = []
        self.grants: list[RegistryCredential | None] = []
        self.go = asyncio.Event()
        self.error: Exception | None = None
        self.cancelled = 0

    async def pull(
        self,
        image: str,
        report: progress.Report,
        timeout: float,
        grant: RegistryCredential | None = None,
    ) -> None:
        self.pulls.append(image)
        self.grants.append(grant)
        try:
            report(pulling(10))
            await self.go.wait()
            report(pulling(100))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error


class Preparer:
    def __init__(self) -> None:
        self.prepared: list[str] = []

    def prepare(self, image: str) -> None:
        self.prepared.append(image)


def test_concurrent_creates_of_one_image_share_one_pull_and_each_sees_its_progress() -> None:
    async def main() -> tuple[list[str], list[list[ProgressEvent]], int]:
        puller, pulls = Puller(), Pulls(asyncio.get_running_loop)
        seen: list[list[ProgressEvent]] = [[] for _ in range(4)]
        before = threading.active_count()
        waiting = [
            asyncio.ensure_future(pulls.ensure(puller, IMAGE, 10, seen[n].append)) for n in range(4)
        ]
        await asyncio.sleep(0.05)
        threads = threading.active_count() - before
        puller.go.set()
        await asyncio.gather(*waiting)
        return puller.pulls, seen, threads

    pulled, seen, threads = asyncio.run(main())
    assert pulled == [IMAGE]
    assert threads <= 0, "no thread held by the pull (another test's may end meanwhile)"
    for events in seen:
        assert events[-1] == pulling(100)


def test_a_failed_pull_is_every_waiter_s_and_the_next_create_pulls_again() -> None:
    async def main() -> list[str]:
        puller, pulls = Puller(), Pulls(asyncio.get_running_loop)
        puller.error = ImagePullFailed("the registry said 500")
        puller.go.set()
        results = await asyncio.gather(
            *(pulls.ensure(puller, IMAGE, 10, None) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(result, ImagePullFailed) for result in results)
        puller.error = None
        await pulls.ensure(puller, IMAGE, 10, None)
        return puller.pulls

    assert asyncio.run(main()) == [IMAGE, IMAGE]


def test_a_create_without_credentials_never_joins_a_pull_with_another_user_s() -> None:
    """alice's pull sends the operator's grant; bob's create of the same image while it runs
    waits for an anonymous pull of its own, whose refusal is bob's alone."""
    grant = RegistryCredential(
        registry="localhost:5000", users=frozenset({"alice"}), auth_file="/etc/a.json"
    )

    async def main() -> tuple[list[RegistryCredential | None], BaseException | None]:
        puller, pulls = Puller(), Pulls(asyncio.get_running_loop)
        alice = asyncio.ensure_future(pulls.ensure(puller, IMAGE, 10, None, PullFor(grant)))
        await asyncio.sleep(0.02)
        bob = asyncio.ensure_future(pulls.ensure(puller, IMAGE, 10, None))
        await asyncio.sleep(0.02)
        puller.error = ImagePullFailed("denied")  # what the registry says to anyone anonymous
        puller.go.set()
        results = await asyncio.gather(alice, bob, return_exceptions=True)
        return puller.grants, results[1] if isinstance(results[1], BaseException) else None

    grants, bobs = asyncio.run(main())
    assert sorted(grants, key=lambda g: g is None) == [grant, None], "two pulls, one anonymous"
    assert isinstance(bobs, ImagePullFailed)


def test_a_pull_whose_creates_all_went_away_ends() -> None:
    async def main() -> int:
        puller, pulls = Puller(), Pulls(asyncio.get_running_loop)
        waiting = [asyncio.ensure_future(pulls.ensure(puller, IMAGE, 10, None)) for _ in range(2)]
        await asyncio.sleep(0.05)
        waiting[0].cancel()
        await asyncio.sleep(0.05)
        assert puller.cancelled == 0, "one create still waits"
        waiting[1].cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await asyncio.sleep(0.05)
        return puller.cancelled

    assert asyncio.run(main()) == 1


def test_a_backend_that_cannot_pull_on_the_loop_prepares_on_a_thread() -> None:
    preparer = Preparer()
    assert puller_of(preparer) is None
    asyncio.run(Pulls().prepare(preparer, IMAGE, 10, inline))
    assert preparer.prepared == [IMAGE]


def test_the_router_s_docker_backend_is_the_puller() -> None:
    class Router:
        docker = Puller()

    assert puller_of(Router()) is Router.docker


def test_a_pull_runs_on_the_core_loop_and_reports_to_the_caller_s_loop() -> None:
    async def main() -> list[ProgressEvent]:
        puller, pulls = Puller(), Pulls()
        puller.go.set()
        seen: list[ProgressEvent] = []
        await pulls.ensure(puller, IMAGE, 10, seen.append)
        await asyncio.sleep(0.01)  # the last report was handed to this loop
        return seen

    assert asyncio.run(main())[-1] == pulling(100)


# --- the progress of a create, in a streamed answer -------------------------------------------


async def create_events() -> AsyncGenerator[str, None]:
    progress.report(pulling(10))
    await asyncio.sleep(0.01)
    progress.report(pulling(50))
    await asyncio.sleep(0.01)
    yield "created"
    progress.report(ProgressEvent(phase=Phase.STARTING, subject=IMAGE))
    yield "done"


def test_progress_comes_before_the_event_it_led_to() -> None:
    async def main() -> list[object]:
        return [event async for event in with_progress(create_events())]

    got = asyncio.run(main())
    assert got[0] == pulling(10)
    assert got[1] == pulling(50)
    assert got[2:] == ["created", ProgressEvent(phase=Phase.STARTING, subject=IMAGE), "done"]


def test_without_a_stream_a_report_goes_nowhere() -> None:
    progress.report(pulling(1))  # no sink: nothing happens
    assert progress.sink() is None


def test_a_slow_reader_is_sent_only_the_latest_of_each_phase() -> None:
    async def main() -> list[ProgressEvent]:
        feed = ProgressFeed()
        for done in range(1000):
            feed.put(pulling(done, 1000))
        feed.put(ProgressEvent(phase=Phase.STARTING))
        return feed.take()

    taken = asyncio.run(main())
    assert taken == [pulling(999, 1000), ProgressEvent(phase=Phase.STARTING)]


def test_a_run_s_stream_opens_with_a_pull_not_with_a_start() -> None:
    async def main() -> list[ProgressEvent]:
        feed = ProgressFeed(soft_first=True)
        feed.put(ProgressEvent(phase=Phase.STARTING))
        quiet = feed.take()
        feed.put(pulling(1))
        feed.put(ProgressEvent(phase=Phase.STARTING))
        return [*quiet, *feed.take()]

    assert asyncio.run(main()) == [pulling(1), ProgressEvent(phase=Phase.STARTING)]


def test_a_stream_closed_mid_create_cancels_its_step_and_closes_its_events() -> None:
    closed: list[bool] = []

    async def slow() -> AsyncGenerator[str, None]:
        try:
            progress.report(pulling(1))
            await asyncio.sleep(3600)
            yield "never"
        finally:
            closed.append(True)

    async def main() -> None:
        events = with_progress(slow())
        assert await anext(events) == pulling(1)
        await events.aclose()

    asyncio.run(main())
    assert closed == [True]


# --- git's counts ---------------------------------------------------------------------------


def test_git_s_counts_are_read_across_chunks_and_carriage_returns() -> None:
    seen: list[ProgressEvent] = []
    now = [0.0]

    async def main() -> None:
        token = progress._SINK.set(seen.append)
        try:
            counts = GitCounts("https://git.example/r.git", clock=lambda: now[0])
            counts.feed(b"Receiving objects:  10% (10/100)\rReceiving obj")
            counts.feed(b"ects:  20% (20/100)\r")  # within the period: waits
            now[0] = 1.0
            counts.feed(b"Receiving objects: 100% (100/100), 1.2 MiB | 3 MiB/s, done.\n")
            counts.feed(b"Resolving deltas:  50% (5/10)\r")
        finally:
            progress._SINK.reset(token)

    asyncio.run(main())
    assert [(event.step, event.done, event.total) for event in seen] == [
        ("Receiving objects", 10, 100),
        ("Receiving objects", 100, 100),
        ("Resolving deltas", 5, 10),
    ]
    assert all(event.phase is Phase.CLONING for event in seen)


@pytest.mark.parametrize("noise", [b"remote: Enumerating objects: 3, done.\n", b"\xff\xfe\r\n"])
def test_what_is_not_a_count_reports_nothing(noise: bytes) -> None:
    seen: list[ProgressEvent] = []
    token = progress._SINK.set(seen.append)
    try:
        GitCounts("u").feed(noise)
    finally:
        progress._SINK.reset(token)
    assert seen == []


def caller(uid: int, name: str, *, admin: bool = False) -> Identity:
    return Identity(uid=uid, gid=uid, pid=1, user_name=name, is_admin=admin)


ALICE, BOB, ADMIN = caller(1001, "alice"), caller(1002, "bob"), caller(1003, "ops", admin=True)


def test_one_user_s_pulls_in_flight_hold_only_its_share_and_a_joiner_takes_none() -> None:
    """Four pulls in flight for all, two per user: alice's third distinct image is refused
    pull_share_full (429) while bob's pulls start; a create of an image alice is pulling
    waits for that pull; past the total, pulls_busy; a pull that ends gives its slot back."""
    shares = SharesConfig(pulls_in_flight=4, user_share=0.5)

    async def main() -> list[str]:
        puller, pulls = Puller(), Pulls(asyncio.get_running_loop, lambda: shares)

        def start(image: str, who: Identity) -> asyncio.Future[None]:
            return asyncio.ensure_future(pulls.ensure(puller, image, 10, None, PullFor(who=who)))

        waiting = [start("a/1", ALICE), start("a/2", ALICE)]
        await asyncio.sleep(0.02)
        refused = []
        try:
            await pulls.ensure(puller, "a/3", 10, None, PullFor(who=ALICE))
        except ShareFull as exc:
            refused.append(exc.code)
        waiting += [start("a/1", BOB), start("b/1", BOB), start("b/2", BOB)]
        await asyncio.sleep(0.02)
        try:
            await pulls.ensure(puller, "c/1", 10, None, PullFor(who=ADMIN))
        except Busy as exc:
            refused.append(exc.code)
        puller.go.set()
        await asyncio.gather(*waiting)
        assert pulls.slots.in_use == 0, "every slot given back"
        await pulls.ensure(puller, "a/3", 10, None, PullFor(who=ALICE))
        return refused

    assert asyncio.run(main()) == ["pull_share_full", "pulls_busy"]
