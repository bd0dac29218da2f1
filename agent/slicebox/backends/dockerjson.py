"""The Engine API calls of an exec, on the agent's event loop: no thread, no requests session.

Every exec makes three small JSON calls beside its output stream (the container's inspect when
it is looked up, the exec's create, the exec's inspect for its exit code). Through docker-py
each one was a trip to a worker thread and through requests' and http.client's pure-Python
layers, which were a large part of the agent's CPU when many execs ran at once (see
docs/benchmarks.md). Here they go over one keep-alive connection pool
(:mod:`slicebox.web.client`) on the loop that already reads the exec's output.

What the answers mean is the Docker backend's (:func:`slicebox.backends.dockererrors.map_status`);
this module only speaks HTTP to the daemon, at the API version the backend's client settled.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from slicebox.backends.dockerapi import StatusMapper, answer_json, call_failed
from slicebox.backends.dockerendpoint import DockerEndpoint
from slicebox.web.client import ClientResponse, HttpClient
from slicebox.web.message import ProtocolError

CALL_TIMEOUT = 120.0  # as the backend's own client: a daemon that busy is answered as failed
# Connections kept to the daemon: as many as calls run at once on the loop, in practice.
KEPT_CONNECTIONS = 16


class DockerJsonApi:
    """JSON calls to the daemon at ``endpoint``. Each event loop that calls gets its own
    connection pool, made at its first call (a pool's connections belong to their loop): the
    agent's loop and the core loop its worker threads call through
    (:func:`slicebox.core.blocking.from_thread`). ``aclose`` ends the running loop's."""

    def __init__(self, endpoint: DockerEndpoint, refusal: StatusMapper) -> None:
        self._endpoint = endpoint
        self._refusal = refusal
        self._lock = threading.Lock()
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, HttpClient]
        self._clients = weakref.WeakKeyDictionary()

    async def get(self, path: str, what: str) -> Any:
        """The JSON answer to GET ``path`` (``/v1.45/...``; ``/version`` has no version)."""
        return await self._call("GET", path, what, None)

    async def post(self, path: str, what: str, body: Mapping[str, Any]) -> Any:
        return await self._call("POST", path, what, body)

    async def open(
        self, method: str, path: str, headers: Mapping[str, str] | None = None
    ) -> ClientResponse:
        """An answer whose body its caller reads as it comes (a pull's progress), bounded by
        the caller's own timeout; it closes the answer when done."""
        try:
            return await self._pool().request(method, path, headers=headers)
        except (ProtocolError, OSError) as exc:
            raise call_failed(self._endpoint, exc, CALL_TIMEOUT) from exc

    async def aclose(self) -> None:
        with self._lock:
            client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    async def _call(self, method: str, path: str, what: str, body: Mapping[str, Any] | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if body is not None else None
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                answer = await self._pool().request(method, path, body=data, headers=headers)
                status, text = answer.status, (await answer.read()).decode(errors="replace")
        except (ProtocolError, OSError) as exc:  # TimeoutError is an OSError
            raise call_failed(self._endpoint, exc, CALL_TIMEOUT) from exc
        return answer_json(status, text, what, self._refusal)

    def _pool(self) -> HttpClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.get(loop)
            if client is None:
                endpoint = self._endpoint
                if endpoint.scheme == "unix":
                    client = HttpClient.unix(endpoint.address, limit=KEPT_CONNECTIONS)
                else:
                    client = HttpClient.tcp(endpoint.address, endpoint.port, limit=KEPT_CONNECTIONS)
                self._clients[loop] = client
        return client
