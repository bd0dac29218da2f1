"""host.tcpowner against this machine's own kernel: loopback connections and connections to
the machine's own LAN address, really made.

A child process made for the test connects (as another uid where the test may change its uid,
as root does); the kernel's sock_diag answer names that uid. The guest's metrics test holds a
real local user to their share of the listener with it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from slicebox.host.addresses import host_addresses
from slicebox.host.tcpowner import is_local, is_loopback, local_owner, peer_key, remote_key

NOBODY = 65534


@contextmanager
def listening(family: int = socket.AF_INET) -> Iterator[socket.socket]:
    host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((host, 0))
        server.listen()
        server.settimeout(10)  # a child that never connects fails the test, never hangs it
        yield server


@contextmanager
def connected_as(server: socket.socket, uid: int | None) -> Iterator[socket.socket]:
    """The server's side of a connection a child made (as ``uid`` when given), open while
    the block runs; the child holds its end until then."""
    hold_read, hold_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: connect, then wait for the parent to let go
        try:
            os.close(hold_write)
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            # A numeric address, connected as it is: no name look-up, whose codecs this uid
            # may not be able to import from where the test's Python lives.
            with socket.socket(server.family, socket.SOCK_STREAM) as client:
                client.connect(server.getsockname())
                os.read(hold_read, 1)
        finally:
            os._exit(0)
    os.close(hold_read)
    try:
        accepted, _ = server.accept()
        with accepted:
            yield accepted
    finally:
        os.close(hold_write)
        os.waitpid(pid, 0)


def test_the_far_end_s_owner_is_the_uid_that_made_its_socket() -> None:
    with listening() as server:
        with connected_as(server, None) as accepted:
            assert local_owner(accepted) == os.geteuid()
        if os.geteuid() == 0:  # root can be someone else for the child
            with connected_as(server, NOBODY) as accepted:
                assert local_owner(accepted) == NOBODY


def test_ipv6_loopback_is_looked_up_too() -> None:
    with listening(socket.AF_INET6) as server, connected_as(server, None) as accepted:
        assert local_owner(accepted) == os.geteuid()


def test_a_socket_with_no_far_end_has_no_owner() -> None:
    with listening() as server:
        assert local_owner(server) is None, "a listening socket"


def test_a_unix_socket_has_no_tcp_owner() -> None:
    left, right = socket.socketpair()
    with left, right:
        assert local_owner(left) is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("fe80::1%eth0", False),
        ("not an address", False),
    ],
)
def test_only_this_host_s_loopback_is_asked_about(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def lan_address() -> str:
    """One of this machine's own addresses besides loopback (the kernel's list)."""
    found = [str(net.network_address) for net in host_addresses() if not net.is_loopback]
    if not found:
        pytest.skip("this machine has no address but loopback")
    return found[0]


def test_a_local_user_on_the_host_s_own_lan_address_is_counted_under_its_uid() -> None:
    """Not only loopback: a local user connecting to the host's LAN address is on this host
    too, and the kernel names its uid (before, every such peer was one bucket, None)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind((lan_address(), 0))
        server.listen()
        server.settimeout(10)
        with connected_as(server, None) as accepted:
            assert peer_key(accepted) == os.geteuid()
        if os.geteuid() == 0:
            with connected_as(server, NOBODY) as accepted:
                assert peer_key(accepted) == NOBODY


def test_whether_an_address_is_the_host_s_own_is_the_kernel_s_answer() -> None:
    assert is_local("127.0.0.1")
    assert is_local("::1")
    assert is_local(lan_address())
    assert is_local(f"::ffff:{lan_address()}")
    assert not is_local("198.51.100.77"), "a documentation address no host holds"
    assert not is_local("2001:db8::77")
    assert not is_local("not an address")


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("203.0.113.5", "203.0.113.5"),
        ("::ffff:203.0.113.5", "203.0.113.5"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2::9", "2001:db8:1:2::/64"),  # one machine holds its /64 whole
        ("2001:db8:1:3::9", "2001:db8:1:3::/64"),
    ],
)
def test_a_peer_from_elsewhere_is_counted_under_its_own_address(host: str, key: str) -> None:
    assert remote_key(host) == key
