"""Moved to :mod:`slicebox.client` (``from slicebox.client import Client``); this name stays for
one release."""

from slicebox.client.sync import DEFAULT_SOCKET, Client

__all__ = ["DEFAULT_SOCKET", "Client"]
