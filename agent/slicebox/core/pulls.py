"""An image's pull, once however many creates wait for it, off the agent's threads.

A create of an image not known present pulls it (``core.creation``). Every create that needs
the same image while its pull runs waits for that one pull, and each is told its progress
(``core.progress``). The pull runs as a task on the core loop (``core.blocking``), whichever
loop its creates came from (the agent's for the API, the core loop's for a pool's refill), and
holds no thread: the backend reads the engine's progress on that loop. It is bounded by the
configured ``pull_timeout_seconds``, and ends early, closing its connection (which makes the
engine abandon it), when every create waiting for it has gone.

A pull holds one of the agent's ``[shares] pulls_in_flight`` until it ends, counted against the
caller who started it (``core.shares``: its share first, ``pull_share_full``, then the total,
``pulls_busy``): a slow registry of one user's holds that user's pulls, never every user's.
A create that joins a pull in flight takes none.

A pull sends the credentials the operator granted the sandbox's user for the image's registry
(``model.pulls``), or none; creates join only a pull with their own grant.

A backend that cannot pull on a loop (a fake, an engine without the Engine API) is asked to
``prepare`` the image on a thread, as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

from slicebox.core import progress
from slicebox.core.blocking import Blocking, core_loop
from slicebox.core.shares import PULLS, Reservation, Slots
from slicebox.host.identity import Identity
from slicebox.model.progress import ProgressEvent
from slicebox.model.pulls import RegistryCredential
from slicebox.model.shares import SharesConfig

log = logging.getLogger(__name__)

Report = Callable[[ProgressEvent], None]


@runtime_checkable
class ImagePuller(Protocol):
    async def pull(
        self, image: str, report: Report, timeout: float, grant: RegistryCredential | None = None
    ) -> None:
        """Make ``image`` present, pulling it on the running loop, reporting its progress,
        with ``grant``'s credentials (``model.pulls``) or none."""


@runtime_checkable
class ImageLooker(Protocol):
    async def present(self, image: str) -> bool:
        """Whether the engine holds ``image`` already (nothing to pull)."""


class Preparer(Protocol):
    def prepare(self, image: str) -> None: ...


def puller_of(backend: object) -> ImagePuller | None:
    """The backend's puller: the router's Docker backend, or the backend itself."""
    inner = getattr(backend, "docker", backend)
    return inner if isinstance(inner, ImagePuller) else None


# A pull in flight is one image's with one grant of credentials (None: anonymous). A create
# joins only the pull with its own grant: one without credentials must not be handed an image
# that another user's credentials are pulling.
PullKey = tuple[str, RegistryCredential | None]


class PullFor(NamedTuple):
    """For whom a pull runs: the credentials it may send (``model.pulls``; None: anonymous)
    and whose share of pulls in flight it takes (None: the agent's own, the totals only)."""

    grant: RegistryCredential | None = None
    who: Identity | None = None


AGENTS = PullFor()  # anonymous, in the agent's own name (the totals only)


class _Pull:
    """One pull in flight: its outcome, its waiters and where each wants its progress."""

    def __init__(self, image: str, grant: RegistryCredential | None) -> None:
        self.image = image
        self.grant = grant
        self.outcome: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.task: concurrent.futures.Future[None] | None = None
        self.waiters = 0
        self.listeners: dict[int, tuple[asyncio.AbstractEventLoop, Report]] = {}
        self.last: ProgressEvent | None = None
        self.held: Reservation | None = None  # its slot of pulls in flight

    def emit(self, event: ProgressEvent) -> None:
        """On the core loop: to each listener, on its own loop."""
        self.last = event
        for loop, sink in list(self.listeners.values()):
            with contextlib.suppress(RuntimeError):  # a closed loop: it is not listening
                loop.call_soon_threadsafe(sink, event)


class Pulls:
    """The pulls in flight, by image."""

    def __init__(
        self,
        loop: Callable[[], asyncio.AbstractEventLoop] = core_loop,
        shares: Callable[[], SharesConfig] = SharesConfig,
    ) -> None:
        self._loop = loop
        self.slots = Slots(PULLS, shares)  # distinct pulls at once, per caller and in all
        self._lock = threading.Lock()
        self._running: dict[PullKey, _Pull] = {}
        self._ids = itertools.count()
        self.started = 0  # pulls started (one per image at a time however many creates wait)

    async def prepare(
        self,
        backend: Preparer,
        image: str,
        timeout: float,
        blocking: Blocking,
        by: PullFor = AGENTS,
    ) -> None:
        """Make ``image`` present ``by`` whom: a shared pull on the loop when the backend can,
        else its ``prepare`` on a thread (anonymous)."""
        puller = puller_of(backend)
        if puller is None:
            with self.slots.take(by.who):
                await blocking(lambda: backend.prepare(image))
            return
        await self.ensure(puller, image, timeout, progress.sink(), by)

    async def ensure(
        self,
        puller: ImagePuller,
        image: str,
        timeout: float,
        report: Report | None,
        by: PullFor = AGENTS,
    ) -> None:
        """Wait for ``image``'s pull with ``by``'s grant, starting it unless one runs (in the
        share of ``by``'s caller: ``pull_share_full``, ``pulls_busy``); its outcome is this
        one's."""
        if isinstance(puller, ImageLooker):  # one present (a snapshot's, say) takes no slot
            looked = asyncio.run_coroutine_threadsafe(puller.present(image), self._loop())
            if await asyncio.wrap_future(looked):
                return
        pull, listener = self._join(puller, (image, by.grant), timeout, report, by.who)
        try:
            await asyncio.shield(asyncio.wrap_future(pull.outcome))
        finally:
            self._leave(pull, listener)

    def _join(
        self,
        puller: ImagePuller,
        key: PullKey,
        timeout: float,
        report: Report | None,
        who: Identity | None,
    ) -> tuple[_Pull, int]:
        loop = asyncio.get_running_loop()
        with self._lock:
            pull = self._running.get(key)
            fresh = pull is None
            if pull is None:
                held = self.slots.take(who)  # refused: nothing is registered
                pull = self._running[key] = _Pull(*key)
                pull.held = held
                self.started += 1
            pull.waiters += 1
            listener = next(self._ids)
            if report is not None:
                pull.listeners[listener] = (loop, report)
                if pull.last is not None:
                    report(pull.last)  # where the pull stands, for one that joins late
        if fresh:
            pull.task = asyncio.run_coroutine_threadsafe(
                self._run(puller, pull, timeout), self._loop()
            )
        return pull, listener

    def _leave(self, pull: _Pull, listener: int) -> None:
        with self._lock:
            pull.waiters -= 1
            pull.listeners.pop(listener, None)
            abandoned = pull.waiters == 0 and not pull.outcome.done()
        if abandoned and pull.task is not None:
            log.info("every create waiting for %s has gone: its pull ends", pull.image)
            pull.task.cancel()  # the task's cancellation closes the engine's connection

    async def _run(self, puller: ImagePuller, pull: _Pull, timeout: float) -> None:
        try:
            await puller.pull(pull.image, pull.emit, timeout, pull.grant)
        except BaseException as exc:
            self._end(pull)
            if isinstance(exc, asyncio.CancelledError):
                pull.outcome.cancel()
                raise
            pull.outcome.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            self._end(pull)
            pull.outcome.set_result(None)

    def _end(self, pull: _Pull) -> None:
        """Forget ``pull`` and give back its slot; once, however often called."""
        with self._lock:
            key = (pull.image, pull.grant)
            if self._running.get(key) is pull:
                del self._running[key]
            held, pull.held = pull.held, None
        if held is not None:
            held.release()
