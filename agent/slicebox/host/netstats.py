"""Network bytes of a sandbox: rx + tx of every interface but loopback in its network namespace.

The OS boundary is :class:`NetCounters` (``bytes_for_pid``). :class:`NetnsCounters` reads it
over netlink with pyroute2: the calling thread enters the container's namespace just long enough
to open a netlink socket (a socket stays bound to the namespace it was created in) and returns
at once. No subprocess, no fork, no Docker call. A sandbox with network ``none`` has only ``lo``
and so reads a real ``0``; a sandbox whose init process is gone reads ``None``.

The counters are asked for with ``RTM_GETSTATS`` and the 64-bit link statistics alone, not with
a whole link dump: pyroute2 decodes every attribute of every link it is sent (some fifty for
each), and decoding a sandbox's interfaces was most of a destroy's final usage read, far more
than the statistics alone; see docs/benchmarks.md.
Statistics carry no name or flags; loopback is link 1 in every namespace (the kernel's
``LOOPBACK_IFINDEX``).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

from slicebox.model.errors import HostError

log = logging.getLogger(__name__)

LOOPBACK_INDEX = 1  # the kernel's LOOPBACK_IFINDEX: lo is link 1 in every network namespace
IFLA_STATS_LINK_64 = 1
STATS_LINK_64 = 1 << (IFLA_STATS_LINK_64 - 1)  # IFLA_STATS_FILTER_BIT: these statistics only
_GONE = frozenset({errno.ENOENT, errno.ESRCH})


class LinkCounters(NamedTuple):
    ifindex: int  # the link's index (``index`` is the tuple's own method)
    rx_bytes: int
    tx_bytes: int

    @property
    def loopback(self) -> bool:
        return self.ifindex == LOOPBACK_INDEX


class NetCounters(Protocol):
    def bytes_for_pid(self, pid: int) -> int | None:
        """rx+tx bytes of the non-loopback links in pid's netns; None when pid is gone."""
        ...


def total_bytes(links: Iterable[LinkCounters]) -> int:
    """rx + tx of every link but loopback (traffic to itself is not the sandbox's traffic)."""
    return sum(link.rx_bytes + link.tx_bytes for link in links if not link.loopback)


def link_counters(message: Any) -> LinkCounters:
    """One RTM_NEWSTATS message (pyroute2 ifstatsmsg, asked for ``STATS_LINK_64``) as counters;
    a link whose statistics are missing counts 0."""
    index, stats = int(message["ifindex"]), message.get_attr("IFLA_STATS_LINK_64")
    if not stats:
        return LinkCounters(index, 0, 0)
    return LinkCounters(index, int(stats["rx_bytes"] or 0), int(stats["tx_bytes"] or 0))


class NetnsCounters:
    """:class:`NetCounters` over netlink (pyroute2), given the container's init pid."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc

    def bytes_for_pid(self, pid: int) -> int | None:
        try:
            target = os.open(f"{self.proc}/{pid}/ns/net", os.O_RDONLY)
        except OSError as exc:
            if exc.errno in _GONE:
                return None
            raise HostError(f"cannot open the netns of pid {pid}: {exc}") from exc
        try:
            return total_bytes(self._links(target))
        finally:
            os.close(target)

    def _links(self, target: int) -> list[LinkCounters]:
        with _netlink_in(target) as ipr:
            try:
                return [link_counters(m) for m in ipr.stats("dump", filter_mask=STATS_LINK_64)]
            except Exception as exc:
                raise HostError(f"netlink link statistics dump failed: {exc}") from exc


@contextmanager
def _netlink_in(target: int) -> Iterator[Any]:
    """An IPRoute socket created inside the namespace ``target`` (an open ns fd)."""
    from pyroute2.iproute.linux import IPRoute  # the module, not the package (host/lean.py)
    from pyroute2.netns import setns

    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _enter(setns, target)
        try:
            ipr = IPRoute()
        finally:
            _return_home(setns, own)
    finally:
        os.close(own)
    try:
        yield ipr
    finally:
        ipr.close()


def _enter(setns: Any, target: int) -> None:
    try:
        setns(target, flags=0)
    except OSError as exc:
        raise HostError(f"cannot enter a sandbox's network namespace (root needed): {exc}") from exc


def _return_home(setns: Any, own: int) -> None:
    try:
        setns(own, flags=0)
    except OSError as exc:  # staying in a sandbox's netns would be far worse than failing
        raise HostError(f"could not return to the agent's network namespace: {exc}") from exc
