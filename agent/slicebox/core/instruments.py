"""The counters and histograms the core adds to as things happen, for ``GET /metrics``.

Most of what the agent publishes is read at scrape time from where it already is (cgroupfs,
the pool's lists, the egress counters); these are the numbers that exist only at the moment
something happens: how long an acquire and a refill took, how each exec ended, what each
reaper action did. They are prometheus-client's own objects (thread-safe, cheap to add to),
made on the registry the agent passes in, so each agent (and each test's) counts apart;
``NOWHERE``, the default of a part made without the agent's, is published nowhere.

Label values are bounded: users and projects are names the agent validated, results and rules
are the agent's own words.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# An acquire is an in-memory hand-over plus one systemd call; a refill is a container's create.
ACQUIRE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REFILL_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# How an exec ended, as ``slicebox_execs_total{result}`` says it.
OK = "ok"
TIMED_OUT = "timed_out"
OOM_KILLED = "oom_killed"
ABANDONED = "abandoned"
REFUSED = "refused"  # never ran: no such sandbox, not the caller's, busy, over a share
FAILED = "failed"  # ran and failed on the agent's side (the container went away, Docker)
EXEC_RESULTS = (OK, TIMED_OUT, OOM_KILLED, ABANDONED, REFUSED, FAILED)


class Instruments:
    """What the core counts as it happens; ``registry`` None: counted, never published."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.pool_acquire_seconds = Histogram(
            "slicebox_pool_acquire_seconds",
            "Time to hand a ready pool member to a request (its lease armed), by pool owner.",
            ["user", "project"],
            buckets=ACQUIRE_BUCKETS,
            registry=registry,
        )
        self.pool_refill_seconds = Histogram(
            "slicebox_pool_refill_seconds",
            "Time to make one pool member ready (its container created and started).",
            ["user", "project"],
            buckets=REFILL_BUCKETS,
            registry=registry,
        )
        self.execs = Counter(
            "slicebox_execs",
            "Execs and one-shot runs' commands by how they ended: ok, timed_out, oom_killed, "
            "abandoned, refused, failed.",
            ["user", "result"],
            registry=registry,
        )
        self.reaper_actions = Counter(
            "slicebox_reaper_actions",
            "Reaper actions carried out, by rule and outcome (ok, skipped, deferred, an error "
            "code).",
            ["rule", "result"],
            registry=registry,
        )

    def exec_ended(self, user: str, result: str) -> None:
        self.execs.labels(user=user, result=result).inc()

    def reaped(self, rule: str, result: str) -> None:
        self.reaper_actions.labels(rule=rule, result=result).inc()


NOWHERE = Instruments()  # the default of a part made without the agent's: counts unpublished
