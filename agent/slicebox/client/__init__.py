"""slicebox's Python clients: ``Client`` (standard library only) and ``AsyncClient``
(asyncio), one method per route of the agent's unix-socket API, taking and returning the
agent's own models (``slicebox.model``); both stream exec output and files. They share one
sans-IO layer (``wire``: a route's request, its answer's parsing, the error envelope), so a
route is described once for both.

    from slicebox.client import Client
    from slicebox.model.api import CreateSandbox

    with Client() as agent:              # on exit, destroys what it created
        box = agent.create(CreateSandbox(project="web"))

``AsyncClient`` is imported when first asked for: a program that uses ``Client`` alone (the
``slicebox`` CLI) does not pay for asyncio's import.
"""

from typing import TYPE_CHECKING, Any

from slicebox.client.sync import DEFAULT_SOCKET, Client

if TYPE_CHECKING:
    from slicebox.client.aio import AsyncClient

__all__ = ["DEFAULT_SOCKET", "AsyncClient", "Client"]


def __getattr__(name: str) -> Any:
    if name == "AsyncClient":
        from slicebox.client.aio import AsyncClient

        return AsyncClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
