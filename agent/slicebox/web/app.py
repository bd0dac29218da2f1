"""What the server answers with: the routes, the middlewares around them, and typed app state.

An ``Application`` is aiohttp.web's in the subset the agent's handlers use: a ``Router`` of
literal and ``{name}`` path segments, middlewares composed once (the first outermost) with
routing innermost, so a middleware answers 404 and 405 like any other error, ``AppKey``-typed
state, and what runs when serving stops. ``HTTPError`` is an answer of a status, raised by the
routing and by the server (``Request.read``, the body memory budget).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast
from urllib.parse import unquote

from slicebox.web.message import phrase
from slicebox.web.response import plain_error

if TYPE_CHECKING:
    from slicebox.web.request import Request
    from slicebox.web.response import StreamResponse

T = TypeVar("T")

Handler = Callable[["Request"], Awaitable["StreamResponse"]]
Middleware = Callable[["Request", Handler], Awaitable["StreamResponse"]]
ErrorResponse = Callable[[int, str], "StreamResponse"]
Cleanup = Callable[["Application"], Awaitable[None]]


class AppKey(Generic[T]):
    """A typed key of an ``Application``'s state: ``app[key]`` is a ``kind``."""

    __slots__ = ("kind", "name")

    def __init__(self, name: str, kind: type[T]) -> None:
        self.name = name
        self.kind = kind

    def __repr__(self) -> str:
        return f"<AppKey {self.name}>"


class HTTPError(Exception):
    """An answer of ``status``; raised by routing (404, 405) and by ``Request.read`` (413)."""

    def __init__(self, status: int, reason: str | None = None) -> None:
        self.status = status
        self.reason = reason or phrase(status)
        super().__init__(f"{status} {self.reason}")


class Router:
    """Path patterns of literal segments and ``{name}`` segments (one non-empty segment)."""

    def __init__(self) -> None:
        self._routes: list[tuple[str, list[str], Handler]] = []

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        if not path.startswith("/"):
            raise ValueError(f"a route's path starts with /: {path!r}")
        self._routes.append((method.upper(), path.split("/")[1:], handler))

    def add_get(self, path: str, handler: Handler) -> None:
        self.add_route("GET", path, handler)

    def resolve(self, method: str, raw_path: str) -> tuple[Handler, dict[str, str], str]:
        """The handler of ``method`` on ``raw_path``, what its pattern matched, and the pattern
        (``/v1/sandboxes/{id}``: what the request is counted under, never the path, whose ids
        are no label values); else HTTPError 405 (the path is served, not that method) or
        404."""
        segments = [unquote(segment) for segment in raw_path.split("/")[1:]]
        if any("/" in segment or "\x00" in segment for segment in segments):
            raise HTTPError(400, "a path segment holds an encoded / (%2F) or NUL; name it plainly")
        served = False
        for verb, pattern, handler in self._routes:
            matched = _match(pattern, segments)
            if matched is not None and verb == method:
                return handler, matched, "/" + "/".join(pattern)
            served = served or matched is not None
        raise HTTPError(405 if served else 404)


def _match(pattern: list[str], segments: list[str]) -> dict[str, str] | None:
    if len(pattern) != len(segments):
        return None
    matched = {}
    for part, segment in zip(pattern, segments, strict=True):
        if part.startswith("{") and part.endswith("}") and segment:
            matched[part[1:-1]] = segment
        elif part != segment:
            return None
    return matched


class Application:
    """Routes, the middlewares around them, typed state, and what runs when serving stops.

    ``error_response`` builds the answers the server itself gives: to a request it cannot
    read as HTTP, and to an HTTPError no middleware answered."""

    def __init__(
        self,
        middlewares: Sequence[Middleware] = (),
        client_max_size: int = 1024 * 1024,
        error_response: ErrorResponse | None = None,
    ) -> None:
        self.router = Router()
        self.on_cleanup: list[Cleanup] = []
        self.client_max_size = client_max_size
        self.error_response: ErrorResponse = error_response or plain_error
        self._middlewares = tuple(middlewares)
        self._state: dict[AppKey[Any], object] = {}
        self._chain: Handler | None = None

    def __getitem__(self, key: AppKey[T]) -> T:
        return cast(T, self._state[key])

    def __setitem__(self, key: AppKey[T], value: T) -> None:
        self._state[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def get(self, key: AppKey[T], default: T) -> T:
        return cast(T, self._state.get(key, default))

    async def handle(self, request: Request) -> StreamResponse:
        """``request`` through the middlewares (the first outermost) to its route."""
        if self._chain is None:
            self._chain = self._route
            for middleware in reversed(self._middlewares):
                self._chain = _through(middleware, self._chain)
        return await self._chain(request)

    async def _route(self, request: Request) -> StreamResponse:
        handler, request.match_info, request.route = self.router.resolve(
            request.method, request._target_path
        )
        return await handler(request)


def _through(middleware: Middleware, inner: Handler) -> Handler:
    async def handler(request: Request) -> StreamResponse:
        return await middleware(request, inner)

    return handler
