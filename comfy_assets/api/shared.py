"""What the application and its routes share: the API's state (``Api``, reached as
``request.app[API]``), the client a request comes from (``request[CLIENT]``), and the JSON
answers (``json_response``, ``error``, ``Answer``).

Its own module so that ``app`` (which builds the routes' table) and the routes import it
and not each other.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from comfy_assets.api.publisher import Publisher
from comfy_assets.api.ratelimit import RateLimit
from comfy_assets.api.streams import Changes, StreamCap
from comfy_assets.api.tokens import Clients
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.store import Store
from comfy_assets.store.api_jobs import ApiLedger


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
