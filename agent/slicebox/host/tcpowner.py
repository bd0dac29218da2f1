"""Who opened the far end of a TCP connection from this host, as the kernel knows it.

A unix socket names its peer (``SO_PEERCRED``); a TCP socket does not. But a connection from
one of this host's own addresses (loopback, or its LAN address: a local user may connect to
either) has its other end on this host too, and the kernel keeps the uid of whoever made that
socket (its ``sk_uid``, set when the socket was made and never changed by what the process does
after). One ``sock_diag`` request (``SOCK_DIAG_BY_FAMILY``, an exact look-up by the connection's
four-tuple, not a dump) asks the kernel for that socket and answers its uid. Whether an address
is the host's own is the kernel's answer too: a socket can be bound to it.

So a TCP listener can hold each local user to caps of their own, as the agent's socket does,
and each peer elsewhere to caps of its address (an IPv6 one's /64, which one machine holds
whole): one user, or one remote machine, cannot take every connection a scraper needs
(:func:`peer_key`).
"""

from __future__ import annotations

import socket
import struct
from ipaddress import ip_address, ip_network

SOCK_DIAG_BY_FAMILY = 20
NETLINK_SOCK_DIAG = 4
NLM_F_REQUEST = 1
NO_COOKIE = 0xFFFFFFFF
ALL_STATES = 0xFFFFFFFF

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
# inet_diag_req_v2: family, protocol, extensions, pad, states; then inet_diag_sockid.
_REQUEST = struct.Struct("=BBBBI")
_PORTS = struct.Struct(">HH")  # the socket id's ports are in network order
_TAIL = struct.Struct("=III")  # interface, cookie (two halves)
# inet_diag_msg: 4 bytes of family/state/timer/retrans, the 48-byte socket id, then expires,
# rqueue and wqueue (4 bytes each): its uid is at 64.
_UID = struct.Struct("=I")
_UID_AT = _HEADER.size + 64
TIMEOUT = 1.0  # seconds: the kernel answers at once; a listener never waits on it longer


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address as ``getpeername`` gives it) is this host's loopback,
    IPv4-mapped included."""
    try:
        address = ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


def is_local(host: str) -> bool:
    """Whether ``host`` is one of this host's own addresses (loopback included), as the
    kernel says: a socket of its family can be bound to it."""
    if is_loopback(host):
        return True
    try:
        address = ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    address = getattr(address, "ipv4_mapped", None) or address
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
    except OSError:  # EADDRNOTAVAIL: not this host's (a link-local one needs its scope: too)
        return False
    return True


def peer_key(sock: socket.socket) -> int | str | None:
    """Who ``sock``'s connection counts against (``web.limits.PeerKey``): the uid owning its
    far end when that end is on this host; else the peer's address (an IPv6 one's /64); None
    when the socket has no peer."""
    try:
        host = sock.getpeername()[0]
    except (OSError, IndexError):
        return None
    owner = local_owner(sock) if is_local(host) else None
    return owner if owner is not None else remote_key(host)


def remote_key(host: str) -> str:
    """A remote peer's bucket: its IPv4 address, or its IPv6 address's /64."""
    try:
        address = ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    address = getattr(address, "ipv4_mapped", None) or address
    if address.version == 4:
        return str(address)
    return str(ip_network(f"{address}/64", strict=False))


def local_owner(sock: socket.socket) -> int | None:
    """The uid owning the far end of ``sock``, a connected TCP socket, whose peer is on this
    host (the caller checked: :func:`is_local`); None when it is gone or the kernel does not
    say."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        peer, local = sock.getpeername(), sock.getsockname()
    except OSError:
        return None
    # The far end's own socket: its source is our peer, its destination us.
    request = _REQUEST.pack(sock.family, socket.IPPROTO_TCP, 0, 0, ALL_STATES)
    request += _PORTS.pack(peer[1], local[1])
    request += _packed(sock.family, peer[0]) + _packed(sock.family, local[0])
    request += _TAIL.pack(0, NO_COOKIE, NO_COOKIE)
    message = _HEADER.pack(_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    try:
        answer = _asked(message + request)
    except OSError:
        return None
    return _uid_of(answer)


def _packed(family: int, host: str) -> bytes:
    """An address as the socket id holds it: 16 bytes, an IPv4 one in the first four."""
    return socket.inet_pton(family, host.split("%", 1)[0]).ljust(16, b"\0")


def _asked(message: bytes) -> bytes:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as diag:
        diag.settimeout(TIMEOUT)
        diag.sendto(message, (0, 0))
        return diag.recv(8192)


def _uid_of(answer: bytes) -> int | None:
    """The uid in the kernel's answer; None for an error (``NLMSG_ERROR``: ENOENT, no such
    socket, once its owner closed it)."""
    if len(answer) < _HEADER.size:
        return None
    _, kind, _, _, _ = _HEADER.unpack_from(answer)
    if kind != SOCK_DIAG_BY_FAMILY or len(answer) < _UID_AT + _UID.size:
        return None
    (uid,) = _UID.unpack_from(answer, _UID_AT)
    return int(uid)
