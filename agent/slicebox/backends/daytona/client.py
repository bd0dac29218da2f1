"""The Daytona API as the backend reaches it: the SDK, imported when first needed; its asyncio
client, one per event loop; and its errors as slicebox's, scrubbed of the API key.

The key is a secret: no repr, str, message or log line of this package shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import threading
import weakref
from typing import Any, Protocol

from slicebox.model.errors import HostError, SandboxNotFound, SliceboxError, Unavailable

UNAVAILABLE = "backend_unavailable"
NO_SDK = "the daytona SDK is not installed: install slicebox[daytona]"
CALL_TIMEOUT = 30.0  # seconds for one API call that is not an exec


def import_sdk() -> Any:
    """The daytona SDK's module, imported now; ImportError when it is not installed."""
    return importlib.import_module("daytona")


class ClientFactory(Protocol):
    """Makes the SDK's asyncio client, ``daytona.AsyncDaytona`` (what the backend does
    without one)."""

    def __call__(self, *, api_url: str, api_key: str, target: str | None) -> Any: ...


def status(exc: BaseException) -> int | None:
    """The HTTP status an SDK error carries, if any."""
    code = getattr(exc, "status_code", None)
    return code if isinstance(code, int) else None


def kind_of(exc: BaseException, *names: str) -> bool:
    """Whether ``exc`` is one of the SDK's error classes named (matched by name: this package
    holds no import of the SDK)."""
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def is_transport(exc: BaseException) -> bool:
    """A connection that failed or timed out, here or anywhere down the error's chain (the
    SDK wraps urllib3's and aiohttp's errors in a plain ``DaytonaError``)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        names = ("DaytonaConnectionError", "DaytonaTimeoutError", "MaxRetryError")
        if kind_of(cause, *names) or isinstance(cause, OSError | TimeoutError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class _Key:
    """The API key, which no repr, str or log line shows."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__


class DaytonaApi:
    """One Daytona API (its URL, key and target): the SDK's asyncio client of each event loop
    that calls it, as the client's HTTP session belongs to its loop, and the slicebox error
    each SDK error means."""

    def __init__(
        self,
        api_url: str,
        api_key: str,
        target: str | None = None,
        factory: ClientFactory | None = None,
    ) -> None:
        self.api_url = api_url
        self.target = target
        self._key = _Key(api_key)
        self._factory = factory
        self._lock = threading.Lock()
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]
        self._clients = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"DaytonaApi(api_url={self.api_url!r}, target={self.target!r})"

    def sdk(self) -> Any:
        """The SDK's module; ``backend_unavailable`` when it is not installed."""
        try:
            return import_sdk()
        except ImportError:
            raise Unavailable(NO_SDK, code=UNAVAILABLE) from None

    def client(self) -> Any:
        """The running loop's asyncio client, made at its first call there."""
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.get(loop)
            if client is None:
                client = self._clients[loop] = self._make()
            return client

    def _make(self) -> Any:
        sdk = self.sdk()
        try:
            if self._factory is not None:
                return self._factory(
                    api_url=self.api_url, api_key=self._key.value, target=self.target
                )
            config = sdk.DaytonaConfig(
                api_key=self._key.value, api_url=self.api_url, target=self.target
            )
            return sdk.AsyncDaytona(config)
        except SliceboxError:
            raise
        except Exception as exc:
            raise self.failure(exc, "making its client") from None

    async def aclose(self) -> None:
        """Close every client made (their HTTP sessions), each on its own loop: the running
        loop's here, another running loop's (the core loop's) handed to it. A client of a loop
        that has ended is dropped with it; the next call makes a new one."""
        here = asyncio.get_running_loop()
        with self._lock:
            held = list(self._clients.items())
            self._clients.clear()
        for loop, client in held:
            if loop is here:
                await client.close()
            elif loop.is_running():
                closed = asyncio.run_coroutine_threadsafe(client.close(), loop)
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(CALL_TIMEOUT):
                        await asyncio.wrap_future(closed)

    def scrub(self, text: str) -> str:
        """``text`` with the key blanked out."""
        return text.replace(self._key.value, "***") if self._key.value else text

    def failure(self, exc: BaseException, what: str) -> SliceboxError:
        """An SDK error as the slicebox error it means, its text scrubbed of the key (one of
        slicebox's own, such as the SDK missing, as it is)."""
        if isinstance(exc, SliceboxError):
            return exc
        text = self.scrub(str(exc)) or type(exc).__name__
        code = status(exc)
        if code == 404:
            return SandboxNotFound(f"no such Daytona sandbox ({what}): {text}")
        if code in (401, 403):
            return Unavailable(
                f"the Daytona API at {self.api_url} refused the API key on {what}: {text}; "
                "check the key and its organization",
                code=UNAVAILABLE,
            )
        if is_transport(exc) or (code is not None and (code >= 500 or code == 429)):
            return Unavailable(
                f"the Daytona API at {self.api_url} did not answer {what}: {text}; "
                "check the API URL and the network to it",
                code=UNAVAILABLE,
            )
        where = f" (HTTP {code})" if code is not None else ""
        return HostError(f"the Daytona API failed on {what}{where}: {text}")
