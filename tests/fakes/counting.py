"""Count the calls made through a boundary (Docker, systemd): the cost of an operation as the
number of calls it makes, which a test can pin, instead of wall time, which it cannot.

``counting(fake, counts, "docker")`` stands for ``fake`` and adds one to ``counts["docker.find"]``
for each call of ``find`` made through it; calls the fake makes to itself are not counted.
Calls may come from several threads.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar, cast

T = TypeVar("T")
# A backend's questions about itself, answered from what it knows without a call through its
# boundary: which kind of backend runs a request, whether a sandbox is on this host.
ANSWERED_HERE = frozenset({"resolve", "has_host"})


class _Counting:
    def __init__(self, inner: object, counts: Counter[str], prefix: str) -> None:
        self._inner = inner
        self._counts = counts
        self._prefix = prefix
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name.startswith("_") or not callable(value) or name in ANSWERED_HERE:
            return value
        return self._counted(f"{self._prefix}.{name}", value)

    def _counted(self, key: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._counts[key] += 1
            return method(*args, **kwargs)

        return call


def counting(inner: T, counts: Counter[str], prefix: str) -> T:
    """``inner`` with each call through it counted in ``counts`` as ``prefix.method``."""
    return cast(T, _Counting(inner, counts, prefix))
