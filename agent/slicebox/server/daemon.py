"""``sliceboxd``: the host agent.

It answers on ``/run/slicebox/slicebox.sock`` (passed by ``slicebox.socket``, or bound here),
tells systemd how it is doing (READY, STATUS, STOPPING) and proves the event loop is alive by
pinging the watchdog from a task on that loop: a loop that stops making progress stops the
pings, and systemd restarts the agent. SIGHUP re-reads the configuration; SIGTERM stops the
agent gracefully and leaves sandboxes running for the next start to adopt (it first waits,
briefly, for the removals one-shot runs left under way after their answers: see
:mod:`slicebox.server.pools`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import slicebox
from slicebox import VersionAction
from slicebox.host.identity import SystemUsers
from slicebox.host.journal import Auditor, SystemJournal
from slicebox.host.lean import started
from slicebox.host.listen import listening_socket
from slicebox.model.audit import AuditEvent, AuditRecord
from slicebox.model.config import DEFAULT_PATH as DEFAULT_CONFIG
from slicebox.model.errors import SliceboxError
from slicebox.model.paths import AGENT_SOCKET
from slicebox.server.api import (
    CALLERS,
    ENGINE,
    MEASURE,
    NESTED,
    SOCKET_LIMITS,
    Callers,
    Route,
    build_app,
    socket_limits,
)
from slicebox.server.metrics import METRICS
from slicebox.server.pools import POOLS, run_in
from slicebox.server.resolver import serve_resolver
from slicebox.server.routes import ROUTES
from slicebox.server.runtime import Runtime, assemble, assemble_expiry
from slicebox.server.scrape import ScrapeListener
from slicebox.server.state import SERVICE
from slicebox.web.app import AppKey
from slicebox.web.limits import Limits
from slicebox.web.server import Serving

log = logging.getLogger(__name__)

DEFAULT_SOCKET = Path(AGENT_SOCKET)
MEMORY_SAMPLE_SECONDS = 5.0
# A stop lets the requests under way finish their answers for this long (an exec's own
# timeout may be longer: such an exec is cut off and audited as abandoned).
ANSWER_WAIT = 30.0
KEEPALIVE_TIMEOUT = 75.0  # an idle connection is closed after this long
Reload = Callable[[], Awaitable[str]]
Periodic = tuple[float, Callable[[], object]]  # (interval in seconds, a blocking function)

# The refill is asked for at every acquire; this catches what else empties a pool (the
# reaper's trims, a member that failed to start).
POOL_KICK_SECONDS = 5.0


class Notifier(Protocol):
    def notify(self, state: str) -> None: ...


class SystemdNotifier:
    """sd_notify through the ``sdnotify`` package; a no-op outside a notify service."""

    def __init__(self) -> None:
        import sdnotify

        self._notifier = sdnotify.SystemdNotifier()

    def notify(self, state: str) -> None:
        self._notifier.notify(state)


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Half of WatchdogSec, as systemd recommends, when the watchdog is meant for us."""
    usec = env.get("WATCHDOG_USEC")
    if not usec or env.get("WATCHDOG_PID", str(pid)) != str(pid):
        return None
    return int(usec) / 1_000_000 / 2


async def ping_watchdog(notifier: Notifier, interval: float) -> None:
    while True:
        notifier.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


class Agent:
    """The agent's life: serve, reload on SIGHUP, stop on SIGTERM."""

    def __init__(
        self,
        routes: Sequence[Route],
        notifier: Notifier,
        auditor: Auditor,
        reload: Reload | None = None,
        *,
        periodic: Sequence[Periodic] = (),
        state: Mapping[AppKey[Any], object] | None = None,
        closing: Sequence[Callable[[], Awaitable[None]]] = (),
        opening: Sequence[Callable[[], Awaitable[Callable[[], Awaitable[None]]]]] = (),
        first: Callable[[Serving], Awaitable[None]] | None = None,
        limits: Limits = SOCKET_LIMITS,
    ) -> None:
        self._limits = limits
        self._first = first  # run on the server before its main socket is answered
        self._opening = opening  # run on the loop before it answers; each returns its close
        self._routes = routes
        self._state = state
        self._closing = closing  # run on the loop once the app has stopped: its connections
        self._notifier = notifier
        self._auditor = auditor
        self._reload = reload
        self._periodic = periodic
        self._stop = asyncio.Event()

    async def run(self, socket_path: Path) -> None:
        app = build_app(self._routes, SystemUsers(), self._state)
        serving = Serving(app, KEEPALIVE_TIMEOUT, self._limits)
        if self._first is not None:  # the nested sandboxes' sockets, before anyone is answered
            await self._first(serving)
        serving.listen(listening_socket(socket_path))
        closing = [*[await opener() for opener in self._opening], *self._closing]
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self._on_reload()))
        background = app[POOLS].background  # the reaper never waits behind requests
        tasks = [
            loop.create_task(_every(interval, job, background)) for interval, job in self._periodic
        ]
        watchdog = self._start_watchdog()
        self._notifier.notify(f"READY=1\nSTATUS=answering on {socket_path}")
        started()  # the collector, paused by slicebox.host.lean while the agent started
        self._auditor.record(
            AuditRecord(event=AuditEvent.AGENT_STARTED, detail=slicebox.__version__)
        )
        await self._stop.wait()
        self._notifier.notify("STOPPING=1\nSTATUS=stopping; sandboxes keep running")
        self._auditor.record(AuditRecord(event=AuditEvent.AGENT_STOPPING))
        for task in [*tasks, watchdog]:
            if task is not None:
                task.cancel()
        await serving.close(ANSWER_WAIT)
        for close in closing:
            await close()

    def _start_watchdog(self) -> asyncio.Task[None] | None:
        interval = watchdog_interval(os.environ, os.getpid())
        if interval is None:
            return None
        return asyncio.get_running_loop().create_task(ping_watchdog(self._notifier, interval))

    async def _on_reload(self) -> None:
        self._notifier.notify("RELOADING=1\nSTATUS=reloading the configuration")
        status = "configuration reloaded"
        if self._reload is not None:
            try:
                status = await self._reload()
            except Exception as exc:
                log.exception("reload failed; keeping the previous configuration")
                status = f"reload failed ({exc}); previous configuration in force"
        self._notifier.notify(f"READY=1\nSTATUS={status}")


async def _every(interval: float, job: Callable[[], object], pool: ThreadPoolExecutor) -> None:
    """Run a blocking ``job`` on ``pool`` every ``interval`` seconds; failures are logged."""
    while True:
        await asyncio.sleep(interval)
        try:
            await run_in(pool, job)
        except Exception:
            log.exception("periodic %s failed", getattr(job, "__name__", job))


async def _inner_sockets(runtime: Runtime, serving: Serving) -> None:
    """Every running nested sandbox's socket re-made (server.inner), then kept in line with
    the sandboxes each reaper interval: a sandbox gone without the agent (its expiry, the
    reaper's removal, a ``docker rm``) has its socket closed and its directory removed."""
    runtime.inner.attach(serving)
    nested = await asyncio.to_thread(runtime.nested)
    made = await runtime.inner.restore(nested)
    if made:
        log.info("re-made the sockets of %d nested sandboxes", made)

    async def keep() -> None:
        while True:
            await asyncio.sleep(runtime.config.reaper.interval_seconds)
            try:
                # In this order: a directory seen is its create's, in flight when the creates
                # are read, or done by then, and so running when the sandboxes are listed.
                seen = runtime.inner.directories()
                spared = runtime.sandboxes.operations.engaged()
                alive = {s.id for s in await asyncio.to_thread(runtime.nested)}
                await runtime.inner.sync(alive, seen, spared)
            except Exception:
                log.exception("could not check the nested sandboxes' sockets")

    asyncio.get_running_loop().create_task(keep())


async def _opened_listener(
    runtime: Runtime, listener: ScrapeListener
) -> Callable[[], Awaitable[None]]:
    """The metrics listener as the configuration says (none unless ``[metrics] listen``);
    its close also ends the scrape thread."""
    await listener.apply(runtime.config.metrics)

    async def close() -> None:
        await listener.close()
        runtime.metrics.close()

    return close


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sliceboxd", description=__doc__)
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("--socket", type=Path, default=DEFAULT_SOCKET, help="unix socket path")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="TOML configuration")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    commands = parser.add_subparsers(dest="command", metavar="expire")
    expire = commands.add_parser(
        "expire",
        help="expire a sandbox at its deadline (what its deadline timer runs; no agent needed)",
        description=EXPIRE_HELP,
    )
    expire.add_argument("sandbox_id")
    expire.add_argument("container_id")
    expire.add_argument(
        "--deadline",
        type=int,
        metavar="EPOCH",
        help="the deadline the timer enforces (seconds since 1970); a later one is left be",
    )
    return parser


EXPIRE_HELP = (
    "Read the sandbox's final usage from its cgroup, audit its expiry (rule expired), kill and "
    "remove it, and stop its empty slices. Nothing is done for a sandbox that is gone, runs "
    "nothing, or whose deadline was extended past --deadline; with Docker down its scope is "
    "killed through systemd and the reaper removes the container later."
)


def expire(options: argparse.Namespace) -> int:
    """``sliceboxd expire``: run by a deadline timer's service, as root, agent or no agent."""
    at = None if options.deadline is None else datetime.fromtimestamp(options.deadline, UTC)
    try:
        result = assemble_expiry(Auditor(SystemJournal())).expire(
            options.sandbox_id, options.container_id, at
        )
    except SliceboxError as exc:
        log.error("could not expire %s: %s", options.sandbox_id, exc)
        return 1
    log.info("%s: %s", options.sandbox_id, result.value)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    logging.basicConfig(level=options.log_level, format="%(levelname)s %(name)s: %(message)s")
    if options.command == "expire":
        started()
        return expire(options)
    auditor = Auditor(SystemJournal())
    notifier = SystemdNotifier()
    try:
        runtime = assemble(options.config, auditor)
        runtime.apply_ceilings()
        # Nobody is answered before the view is rebuilt from labels and systemd: orphans
        # adopted, deadlines re-armed, what a crash left half-made removed.
        notifier.notify("STATUS=reconciling sandboxes with Docker and systemd")
        log.info("%s", runtime.reconcile())
    except SliceboxError as exc:
        log.error("cannot start: %s", exc)  # systemd shows it in `systemctl status`
        return 1

    listener = ScrapeListener(runtime.metrics)

    async def reload() -> str:
        status = await asyncio.to_thread(runtime.reload)
        await listener.apply(runtime.config.metrics)  # moved, re-keyed or stopped
        return status

    # Each backend's connections end with the agent; the remote one's clients on every loop.
    remote = runtime.backend.daytona
    closing = [runtime.docker.aclose, *([remote.aclose] if remote is not None else [])]
    agent = Agent(
        ROUTES,
        notifier,
        auditor,
        reload,
        periodic=[
            (MEMORY_SAMPLE_SECONDS, runtime.sample_memory),
            (runtime.config.reaper.interval_seconds, runtime.reaper.run),
            (POOL_KICK_SECONDS, runtime.pool.kick),
        ],
        state={
            SERVICE: runtime.service,
            ENGINE: runtime.docker.found.describe(),
            CALLERS: Callers(lambda: runtime.sandboxes.config.callers),
            METRICS: runtime.metrics,
            MEASURE: runtime.metrics.requests,
            NESTED: runtime.inner,
        },
        closing=closing,
        first=lambda serving: _inner_sockets(runtime, serving),
        limits=socket_limits(runtime.config.socket),
        opening=[
            lambda: serve_resolver(
                runtime.egress.config.gateway, runtime.egress.answer, gate=runtime.egress
            ),
            lambda: _opened_listener(runtime, listener),
        ],
    )
    asyncio.run(agent.run(options.socket))
    return 0
