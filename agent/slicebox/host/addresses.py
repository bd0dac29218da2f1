"""The host's own IPv4 addresses, as the kernel's routing tables list them: no egress entry or
resolver answer may point at one (core.egress).

``/proc/net/fib_trie`` holds every local address of the agent's network namespace (a leaf
followed by ``/32 host LOCAL``), whatever its interface, in one read and without netlink.
"""

from __future__ import annotations

from contextlib import suppress
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

FIB_TRIE = Path("/proc/net/fib_trie")


def local_addresses(text: str) -> tuple[IPv4Network, ...]:
    """The local addresses of a ``fib_trie`` listing, each as a /32 (pure; table-tested)."""
    found: dict[IPv4Network, None] = {}
    leaf: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|--"):
            leaf = stripped.removeprefix("|--").strip()
        elif leaf is not None and stripped.startswith("/32 host LOCAL"):
            with suppress(ValueError):
                found[IPv4Network(IPv4Address(leaf))] = None
    return tuple(found)


def host_addresses(path: Path = FIB_TRIE) -> tuple[IPv4Network, ...]:
    """This namespace's local addresses; none when the listing cannot be read."""
    try:
        return local_addresses(path.read_text(encoding="ascii", errors="replace"))
    except OSError:
        return ()
