"""Moved to :mod:`slicebox.client` (``from slicebox.client import AsyncClient``); this name
stays for one release."""

from slicebox.client.aio import AsyncClient

__all__ = ["AsyncClient"]
