"""``GET /metrics``: the agent's registry, who sees which series, and the exposition.

The agent has a ``CollectorRegistry`` of its own (never prometheus-client's global one): the
core's instruments (:mod:`slicebox.core.instruments`), the requests counted here, the families
read at scrape time (:mod:`slicebox.server.collectors`), and prometheus-client's
``ProcessCollector`` for the agent's own RSS, descriptors, CPU and start time. The exposition is
prometheus-client's: the text format, or OpenMetrics when ``Accept`` asks for
``application/openmetrics-text``.

Who sees what: an admin (root, group slicebox-admin) and the metrics listener's scraper see
every series; any other caller on the socket sees only the series whose ``user`` label is their
own, and the agent's own process series and build, which tell nothing of another user. Series
without a ``user`` label (the managed level, requests by route, the reaper's actions) and every
other user's are left out for them.

A scrape runs on a thread of its own, one at a time, and what it collected is kept for
``FRESH_FOR`` seconds: callers asking at once (any local user may) cost one walk of the slice
tree, each is given their own view of it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from slicebox.core.instruments import Instruments
from slicebox.server.api import identity_of
from slicebox.server.collectors import AgentCollector, ProcessExtras, Sources
from slicebox.web.app import AppKey, HTTPError
from slicebox.web.request import Request
from slicebox.web.response import Response, StreamResponse

FRESH_FOR = 1.0  # seconds a collection answers every scrape that comes meanwhile
# What a caller of any user may see: the agent process's own series and its build.
PUBLIC_PREFIXES = ("process_", "slicebox_build")
METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS"})
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
UNMATCHED = "unmatched"  # a request no route took (404, 405, a head that was not HTTP)


class Requests:
    """Requests to the socket by route pattern (never the path: ids are no label values),
    method and status, and how long each took to answer (a stream: to its end)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.total = Counter(
            "slicebox_http_requests",
            "Requests answered on the agent's socket, by route pattern, method and status.",
            ["route", "method", "code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "slicebox_http_request_duration_seconds",
            "Time from a request's head to its answer's end, by route pattern and method.",
            ["route", "method"],
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        route = route or UNMATCHED
        method = method if method in METHODS else "other"
        self.total.labels(route, method, str(status)).inc()
        self.seconds.labels(route, method).observe(seconds)


class AgentMetrics:
    """The agent's registry and its exposition; ``watch`` adds what is read at scrape time
    once the parts it reads exist."""

    def __init__(
        self, *, fresh_for: float = FRESH_FOR, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = CollectorRegistry()
        self.instruments = Instruments(self.registry)
        self.requests = Requests(self.registry)
        ProcessCollector(registry=self.registry)
        self.registry.register(ProcessExtras())
        self._fresh_for = fresh_for
        self._clock = clock
        self._kept: tuple[float, list[Metric]] | None = None
        self._collecting = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="slicebox-metrics")

    def watch(self, sources: Sources) -> None:
        self.registry.register(AgentCollector(sources))

    def families(self) -> list[Metric]:
        """Every family, collected at most once per ``fresh_for`` seconds."""
        with self._collecting:
            now = self._clock()
            if self._kept is None or now - self._kept[0] >= self._fresh_for:
                self._kept = (now, list(self.registry.collect()))
            return self._kept[1]

    def exposition(self, user: str | None, accept: str) -> tuple[bytes, str]:
        """The exposition for ``user``'s view (None: every series), in the format ``accept``
        asks for, and its content type. Blocking: cgroupfs is read."""
        families = self.families()
        encode, content_type = choose_encoder(accept)
        shown = families if user is None else list(_visible(families, user))
        return encode(_Fixed(shown)), content_type  # type: ignore[arg-type, unused-ignore]

    async def answer(self, user: str | None, accept: str) -> Response:
        """The exposition, made on the scrape thread."""
        loop = asyncio.get_running_loop()
        body, content_type = await loop.run_in_executor(self._thread, self.exposition, user, accept)
        return Response(body, content_type=content_type)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class _Fixed(Collector):
    """Families already collected, for the encoder."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _visible(families: list[Metric], user: str) -> Iterator[Metric]:
    """What a caller who is not an admin may see (the module says what)."""
    for family in families:
        if family.name.startswith(PUBLIC_PREFIXES):
            yield family
            continue
        samples = [sample for sample in family.samples if sample.labels.get("user") == user]
        if samples:
            mine = Metric(family.name, family.documentation, family.type, family.unit)
            mine.samples = samples
            yield mine


METRICS = AppKey("slicebox.metrics", AgentMetrics)


async def metrics(request: Request) -> StreamResponse:
    """``GET /metrics`` on the socket: an admin's view, or the caller's own."""
    if METRICS not in request.app:
        raise HTTPError(404)
    who = identity_of(request)
    accept = request.headers.get("accept", "")
    return await request.app[METRICS].answer(None if who.is_admin else who.user_name, accept)
