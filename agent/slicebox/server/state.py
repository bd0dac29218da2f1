"""The Service the ``/v1`` handlers answer with, held in the app's typed state.

The daemon puts the agent's :class:`~slicebox.core.service.Service` under ``SERVICE`` (the
tests their own), and every handler finds it with :func:`service_of`. The key has a module of
its own so that each table of handlers (``routes``, ``fileroutes``) reads it without importing
the other.
"""

from __future__ import annotations

from slicebox.core.service import Service
from slicebox.web.app import AppKey
from slicebox.web.request import Request

SERVICE = AppKey("slicebox.service", Service)


def service_of(request: Request) -> Service:
    """The Service of the app ``request`` came to."""
    return request.app[SERVICE]
