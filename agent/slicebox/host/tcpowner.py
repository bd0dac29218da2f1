"""Who opened the far end of a loopback TCP connection, as the kernel knows it.

A unix socket names its peer (``SO_PEERCRED``); a TCP socket does not. But a connection from
this host's loopback has its other end on this host too, and the kernel keeps the uid of whoever
made that socket (its ``sk_uid``, set when the socket was made and never changed by what the
process does after). One ``sock_diag`` request (``SOCK_DIAG_BY_FAMILY``, an exact look-up by
the connection's four-tuple, not a dump) asks the kernel for that socket and answers its uid.

So a TCP listener on loopback can hold each local user to caps of their own, as the agent's
socket does: one user cannot take every connection a scraper needs. A peer elsewhere (a listener
on another address), or one gone before the look-up, has no owner known here: ``None``.
"""

from __future__ import annotations

import socket
import struct
from ipaddress import ip_address

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


def loopback_owner(sock: socket.socket) -> int | None:
    """The uid owning the far end of ``sock``, a connected TCP socket, when that end is on
    this host's loopback; None when it is not, is gone, or the kernel does not say."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        peer, local = sock.getpeername(), sock.getsockname()
    except OSError:
        return None
    if not is_loopback(peer[0]):
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
