"""The HTTP/1.1 + JSON API on the agent's unix socket.

Routes are data (``Route``): the same list builds the router and the OpenAPI document,
so the document cannot drift from what is served. Every answer that is not a success is the
``ErrorBody`` envelope with a stable code — malformed JSON, unknown fields, wrong types, huge
bodies, unknown routes and wrong methods included; an unexpected exception is logged and
answered as ``internal`` without details.

The caller's identity is taken from the connection (SO_PEERCRED) for every request; a request
body never names who the caller is.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

import slicebox
from slicebox.core import nesting
from slicebox.host.identity import (
    ADMIN_GROUP,
    CachedUsers,
    Identity,
    PeerCredentials,
    SocketOptions,
    UserDirectory,
    peer_credentials,
    resolve,
)
from slicebox.model.api import ErrorBody, Health
from slicebox.model.codes import CODES
from slicebox.model.config import CallersConfig
from slicebox.model.errors import InvalidRequest, SliceboxError
from slicebox.model.limits import human_bytes
from slicebox.model.socketcaps import SocketConfig
from slicebox.model.validation import refusal
from slicebox.server.pools import POOLS, Pools, pools_of, run_in
from slicebox.web.app import AppKey, Application, Handler, HTTPError, Middleware
from slicebox.web.limits import Limits
from slicebox.web.request import Request
from slicebox.web.response import Response, StreamResponse, json_response

log = logging.getLogger(__name__)

API_PREFIX = "/v1"
MAX_BODY_BYTES = 1024 * 1024
# An exec carries its stdin as base64 (4/3 of the bytes) in JSON: 4 MiB of body is about 3 MiB
# of stdin. Only the exec and run routes take this much; larger inputs belong in a workspace.
MAX_EXEC_BODY_BYTES = 4 * 1024 * 1024
IDENTITY_KEY = "slicebox.identity"  # the caller's, in each request's state
Model = TypeVar("Model", bound=BaseModel)


class Route(NamedTuple):
    """One route; ``nested``: a nested sandbox's own socket serves it too (core.nesting)."""

    method: str
    path: str
    handler: Handler
    summary: str
    body: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    query: type[BaseModel] | None = None  # the query string's model
    raw_body: bool = False  # the body is bytes (a file, a tar stream), not JSON
    raw_answer: bool = False  # so is the success answer
    prefix: str = API_PREFIX  # "" for what is served outside the API (``/metrics``)
    answer_types: tuple[str, ...] = ()  # a raw answer's media types (default: tar, bytes)
    nested: bool = False


class Callers(NamedTuple):
    """Who may call, as the configuration in force says (a reload changes it): ``CALLERS``."""

    current: Callable[[], CallersConfig] = CallersConfig


CALLERS = AppKey("slicebox.callers", Callers)


class Measure(Protocol):
    """What counts each answer (``server.metrics.Requests``): ``MEASURE`` in the app."""

    def observe(self, route: str, method: str, status: int, seconds: float) -> None: ...


MEASURE = AppKey("slicebox.measure", Measure)  # type: ignore[type-abstract]


class Owned(Protocol):
    sandbox_id: str
    uid: int
    gid: int


class Nested(Protocol):
    """Whose requests come in on a nested sandbox's socket (``server.inner``): ``NESTED``."""

    def owner_of(self, listener: str) -> Owned | None: ...


NESTED = AppKey("slicebox.nested", Nested)  # type: ignore[type-abstract]


def error_response(status: int, code: str, message: str, field: str | None = None) -> Response:
    body = ErrorBody(code=code, message=message, field=field)
    return json_response(body.model_dump(exclude_none=True), status=status)


def json_ok(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json().encode(), status=status)


async def parse_body(request: Request, model: type[Model], limit: int = MAX_BODY_BYTES) -> Model:
    """The request body as ``model``: bad JSON and every schema error name what to fix."""
    raw = await request.read(limit)
    try:
        data = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(
            f"the body is not valid JSON ({exc}); send a JSON object", code="malformed_json"
        ) from exc
    except ValueError as exc:  # Python refuses ints of more than 4300 digits (CVE-2020-10735)
        raise InvalidRequest(
            "the body holds a number of more than 4300 digits, which the agent does not read; "
            "send a smaller value",
            code="malformed_json",
        ) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise refusal(exc) from exc


def parse_query(request: Request, model: type[Model]) -> Model:
    """The query string as ``model``: every schema error names what to fix, as a body's."""
    try:
        return model.model_validate(dict(request.query))
    except ValidationError as exc:
        raise refusal(exc) from exc


def identity_of(request: Request) -> Identity:
    identity: Identity = request[IDENTITY_KEY]
    return identity


def _peer(request: Request) -> PeerCredentials | None:
    transport = request.transport
    sock: SocketOptions | None = transport.get_extra_info("socket") if transport else None
    if sock is None:
        return None
    try:
        return peer_credentials(sock)
    except OSError:
        return None


def make_middlewares(users: UserDirectory) -> list[Middleware]:
    async def measured(request: Request, handler: Handler) -> StreamResponse:
        """Each answer counted by its route's pattern (``MEASURE``, when the app has one)."""
        started = time.monotonic()
        answer = await handler(request)
        if MEASURE in request.app:
            elapsed = time.monotonic() - started
            request.app[MEASURE].observe(request.route, request.method, answer.status, elapsed)
        return answer

    async def envelope(request: Request, handler: Handler) -> StreamResponse:
        try:
            creds = _peer(request)
            if creds is None:
                return error_response(403, "no_peer_credentials", "connect over the unix socket")
            within = ""
            if request.listener:  # a nested sandbox's socket: its user's, from its labels
                owner = (
                    request.app[NESTED].owner_of(request.listener)
                    if NESTED in request.app
                    else None
                )
                if owner is None:
                    raise nesting.refuse_route()
                creds = creds.model_copy(update={"uid": owner.uid, "gid": owner.gid})
                within = owner.sandbox_id
            # NSS may be slow (LDAP, sssd): look-ups run on a worker thread and are cached.
            callers = request.app.get(CALLERS, Callers()).current()
            identity = await run_in(
                pools_of(request).calls, resolve, creds, users, ADMIN_GROUP, callers
            )
            request[IDENTITY_KEY] = identity.within_sandbox(within) if within else identity
            return await handler(request)
        except SliceboxError as exc:
            answer = error_response(exc.http_status, exc.code, exc.message, exc.field)
            if exc.retry_after is not None:  # a bound that was full (busy, a share)
                answer.headers["Retry-After"] = str(exc.retry_after)
            return answer
        except HTTPError as exc:
            return http_error(exc.status, exc.reason)
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path)
            return error_response(500, "internal", "the agent failed; see its journal")

    return [measured, envelope]


_HTTP_CODES = {
    404: "unknown_route",
    405: "method_not_allowed",
    413: "body_too_large",
    429: "too_many_requests",  # a cap of the socket's (web.limits)
}
# Any other status of the HTTP layer's: a request it cannot read as HTTP (a malformed head, a
# head over 64 KiB, a transfer coding other than chunked), answered before any route sees it.
_OTHER_HTTP_CODE = "bad_request"
_HTTP_HINTS = {
    404: "no such route; see GET /v1/openapi.json",
    405: "this route does not take that method; see GET /v1/openapi.json",
    413: f"the body is larger than this route takes ({human_bytes(MAX_BODY_BYTES)}; exec and run "
    f"{human_bytes(MAX_EXEC_BODY_BYTES)}, about {human_bytes(MAX_EXEC_BODY_BYTES * 3 // 4)} of "
    "stdin): send less, or put large inputs in the sandbox's workspace",
}


def http_error(status: int, reason: str) -> Response:
    """The envelope of an answer the HTTP layer gives: a route missing, a body too large, a
    request that is not HTTP."""
    code = _HTTP_CODES.get(status, _OTHER_HTTP_CODE)
    return error_response(status, code, _HTTP_HINTS.get(status, reason))


# The socket's caps and time limits (web.limits); the health is answered over the caps.
SOCKET_LIMITS = Limits(always=frozenset({("GET", API_PREFIX + "/health")}))


def socket_limits(config: SocketConfig) -> Limits:
    """``SOCKET_LIMITS`` with the caps of the config's ``[socket]``."""
    return SOCKET_LIMITS._replace(
        connections_per_uid=config.connections_per_uid,
        connections=config.connections,
        in_flight_per_uid=config.in_flight_per_uid,
        in_flight=config.in_flight,
        body_bytes_per_uid=config.body_bytes_per_uid_bytes,
        body_bytes=config.body_bytes_bytes,
    )


# The container engine the agent uses, as found (``FoundEngine.describe``), for the health.
ENGINE = AppKey("slicebox.engine", str)


async def health(request: Request) -> StreamResponse:
    identity = identity_of(request)
    return json_ok(
        Health(
            status="ok",
            version=slicebox.__version__,
            user=identity.user_name,
            admin=identity.is_admin,
            engine=request.app.get(ENGINE, ""),
        )
    )


def base_routes() -> list[Route]:
    return [
        Route(
            "GET",
            "/health",
            health,
            "Liveness, the agent's version and who you are",
            None,
            Health,
            nested=True,
        ),
    ]


def openapi_document(routes: Sequence[Route]) -> dict[str, Any]:
    """OpenAPI 3.1 for ``routes``; request and response schemas come from the pydantic models."""
    schemas: dict[str, Any] = {"ErrorBody": ErrorBody.model_json_schema()}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation: dict[str, Any] = {
            "summary": route.summary,
            "responses": {"default": _ref_response("ErrorBody", "an error")},
        }
        if route.query is not None:
            operation["parameters"] = _parameters(route.query)
        if route.raw_body:
            operation["requestBody"] = {"required": True, "content": _RAW}
        elif route.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _ref(route.body, schemas)}},
            }
        if route.raw_answer:
            content = dict.fromkeys(route.answer_types, _BINARY) if route.answer_types else _RAW
            operation["responses"]["200"] = {"description": "success", "content": content}
        elif route.response is not None:
            operation["responses"]["200"] = {
                "description": "success",
                "content": {"application/json": {"schema": _ref(route.response, schemas)}},
            }
        paths.setdefault(route.prefix + route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "slicebox agent API", "version": slicebox.__version__},
        "paths": paths,
        "components": {"schemas": schemas},
        "x-error-codes": _error_codes(),
    }


def _error_codes() -> dict[str, dict[str, Any]]:
    """Every code the agent answers, with its status and what the caller should do."""
    return {
        entry.code: {"status": entry.status, "when": entry.when, "action": entry.action}
        for entry in CODES
        if entry.status is not None
    }


def _ref(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


# Bytes as they are: a tar stream (format=tar) or one file's contents (format=file).
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_RAW = dict.fromkeys(("application/x-tar", "application/octet-stream"), _BINARY)


def _parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    schema = model.model_json_schema()
    required = set(schema.get("required", ()))
    defs = schema.get("$defs", {})
    return [
        {
            "name": name,
            "in": "query",
            "required": name in required,
            "schema": {
                **defs.get(field.get("$ref", "").rpartition("/")[2], {}),
                **{key: value for key, value in field.items() if key != "$ref"},
            },
        }
        for name, field in schema["properties"].items()
    ]


def _ref_response(name: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }


def build_app(
    routes: Sequence[Route],
    users: UserDirectory,
    state: Mapping[AppKey[Any], object] | None = None,
) -> Application:
    """The app serving ``routes``; ``state`` is what their handlers find in ``request.app``."""
    app = Application(
        middlewares=make_middlewares(CachedUsers(users)),
        client_max_size=MAX_BODY_BYTES,
        error_response=http_error,
    )
    for key, value in (state or {}).items():
        app[key] = value
    owned = POOLS not in app
    if owned:
        app[POOLS] = Pools()
    pools = app[POOLS]

    async def shut_down(app: Application) -> None:
        # Every handler has returned by now: what they left to finish after their answers
        # (one-shot removals) is all started, and still has its threads.
        await pools.after_answer.drain()
        if owned:
            pools.shutdown()

    app.on_cleanup.append(shut_down)
    # Made at its first request, not at start: it builds every model's JSON schema, a large
    # part of the agent's start when made there (docs/benchmarks.md), and few callers ask.
    document: list[dict[str, Any]] = []

    async def openapi(request: Request) -> StreamResponse:
        if not document:
            document.append(openapi_document(routes))
        return json_response(document[0])

    app.router.add_get(API_PREFIX + "/openapi.json", openapi)
    for route in routes:
        handler = route.handler if route.nested else _host_only(route.handler)
        app.router.add_route(route.method, route.prefix + route.path, handler)
    return app


def _host_only(handler: Handler) -> Handler:
    """A route a nested sandbox's socket does not serve: refused ``nested_refused`` there."""

    async def host_only(request: Request) -> StreamResponse:
        if identity_of(request).within:
            raise nesting.refuse_route()
        return await handler(request)

    return host_only
