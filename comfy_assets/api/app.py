"""The aiohttp application: its state, the middlewares every request passes (errors as
JSON, bearer tokens, a rate per client) and the routes' table.

Every answer that is not a file or an event stream is JSON; an error is
``{"message": ...}`` (422 adds ``"errors": [{"field", "message"}]``). A request the
handlers did not foresee is logged with its traceback here and answered 500 with a
message only: a client never sees a traceback. A store that stays away longer than its
retry budget answers 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from comfy_assets.api.outbox import Outbox
from comfy_assets.api.publisher import Publisher, republish_loop
from comfy_assets.api.ratelimit import RateLimit
from comfy_assets.api.streams import Changes, StreamCap
from comfy_assets.api.tokens import Clients, partition_of
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.store import Store, StoreUnavailable
from comfy_assets.store.api_jobs import ApiLedger

log = logging.getLogger("comfy_assets.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Liveness, readiness and the API's own description: nothing of any client's.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json"})


@dataclass
class Limits:
    """What one request may be: ``max_input_bytes`` per input file (decoded),
    ``max_message_bytes`` per queue message (what a worker accepts),
    ``max_body_bytes`` per request body; ``rate_per_s`` requests a second per client and
    ``burst`` at once; ``max_streams`` event streams open at once per client."""

    max_input_bytes: int
    max_message_bytes: int
    max_body_bytes: int
    rate_per_s: float = 50.0
    burst: int = 100
    max_streams: int = 20


@dataclass
class Api:
    """Everything the handlers share (``request.app[API]``)."""

    store: Store
    ledger: ApiLedger
    publisher: Publisher
    clients: Clients
    limits: Limits
    webhook_key: bytes | None = None
    allow_private_webhooks: bool = False
    servers: list[ServerSpec] = field(default_factory=list)
    probe_timeout_s: float = 3.0
    rate: RateLimit = field(init=False)
    streams: StreamCap = field(init=False)
    changes: Changes = field(init=False)
    background: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rate = RateLimit(self.limits.rate_per_s, self.limits.burst)
        self.streams = StreamCap(self.limits.max_streams)
        self.changes = Changes(self.ledger)


API = web.AppKey("api", Api)
CLIENT = web.RequestKey("client", str)


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """``body`` as JSON (UTF-8) with ``status``."""
    return web.json_response(body, status=status, headers=headers, dumps=_dumps)


def error(status: int, message: str, **extra: Any) -> web.Response:
    """An error answer: ``{"message": message, **extra}``."""
    return json_response({"message": message, **extra}, status=status)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


class Answer(Exception):
    """Raised by a helper of a handler to answer with ``response`` at once (a 404 for a
    job that is not the client's, say)."""

    def __init__(self, response: web.Response) -> None:
        self.response = response
        super().__init__(response.status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """HTTP errors as JSON; the store away as 503; anything else logged and 500 without
    a traceback."""
    try:
        return await handler(request)
    except Answer as a:
        return a.response
    except web.HTTPException as e:
        if e.status < 400:
            raise
        messages = {
            404: f"no route {request.path}",
            405: f"{request.method} is not a method of {request.path}",
            413: "the request body is over the limit of "
            f"{request.app[API].limits.max_body_bytes} bytes (--max-body-bytes)",
        }
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        body = {"message": messages.get(e.status, e.reason)}
        return json_response(body, status=e.status, headers=headers or None)
    except StoreUnavailable as e:
        return error(503, f"the store is unavailable: {e}")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.error("%s %s failed: %r", request.method, request.path, e, exc_info=e)
        return error(500, "internal error (logged by the API)")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every path but ``OPEN_PATHS`` needs a known bearer token (401); its client goes to
    ``request["client"]``; a client over its rate gets 429."""
    if request.path in OPEN_PATHS:
        return await handler(request)
    api = request.app[API]
    client = api.clients.client(request.headers.get("Authorization"))
    if client is None:
        return json_response(
            {"message": "a known bearer token is needed: Authorization: Bearer TOKEN"},
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="comfy-assets"'},
        )
    wait_s = api.rate.take(client)
    if wait_s > 0:
        return json_response(
            {"message": f"too many requests: at most {api.limits.rate_per_s:g} a second"},
            status=429,
            headers={"Retry-After": RateLimit.retry_after(wait_s)},
        )
    request[CLIENT] = client
    return await handler(request)


def make_app(api: Api, *, background: bool = True) -> web.Application:
    """The application over ``api``. With ``background``, it also publishes unconfirmed
    jobs again and, when webhooks are on, runs the outbox, while it serves."""
    from comfy_assets.api import openapi, routes_jobs, routes_read

    app = web.Application(
        middlewares=[errors_middleware, auth_middleware],
        client_max_size=api.limits.max_body_bytes,
    )
    app[API] = api
    routes_jobs.add_routes(app)
    routes_read.add_routes(app)
    openapi.add_routes(app)
    if background:
        app.on_startup.append(_start_background)
    app.on_cleanup.append(_stop)
    return app


async def _start_background(app: web.Application) -> None:
    from comfy_assets.api.routes_jobs import cancel_loop

    api = app[API]
    api.background.append(asyncio.create_task(republish_loop(api.ledger, api.publisher)))
    api.background.append(asyncio.create_task(cancel_loop(api)))
    if api.webhook_key is not None:
        outbox = Outbox(
            api.ledger,
            api.webhook_key,
            partitions=[partition_of(name) for name in api.clients.names],
            allow_private=api.allow_private_webhooks,
        )
        api.background.append(asyncio.create_task(outbox.run()))
    for task in api.background:
        task.add_done_callback(_background_done)


def _background_done(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.error("api: a background task failed: %r", exc, exc_info=exc)


async def _stop(app: web.Application) -> None:
    api = app[API]
    for task in api.background:
        task.cancel()
    await asyncio.gather(*api.background, return_exceptions=True)
    await api.changes.close()
    await api.publisher.close()
