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
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from comfy_assets.api import openapi, routes_jobs, routes_read
from comfy_assets.api.outbox import Outbox
from comfy_assets.api.publisher import republish_loop
from comfy_assets.api.ratelimit import RateLimit
from comfy_assets.api.shared import API, CLIENT, Answer, Api, Limits, error, json_response
from comfy_assets.api.tokens import partition_of
from comfy_assets.store import StoreUnavailable

# Api and Limits are built by whoever serves the application (cli/api.py, the tests).
__all__ = ["API", "CLIENT", "Answer", "Api", "Limits", "error", "json_response", "make_app"]

log = logging.getLogger("comfy_assets.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Liveness, readiness and the API's own description: nothing of any client's.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json"})


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
    api = app[API]
    api.background.append(asyncio.create_task(republish_loop(api.ledger, api.publisher)))
    api.background.append(asyncio.create_task(routes_jobs.cancel_loop(api)))
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
