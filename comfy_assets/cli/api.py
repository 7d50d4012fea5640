"""``comfy-assets api``: the HTTP API (``comfy_assets.api``) over a store and a queue."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from comfy_assets.cli.options import (
    add_command,
    add_size_option,
    bad_input,
    bounded,
    byte_size_text,
)
from comfy_assets.cli.run import add_store_options, open_store, store_files
from comfy_assets.cli.worker import add_rabbitmq_option, needs_rabbitmq, queue_name
from comfy_assets.service.messages import MAX_MESSAGE_BYTES

DEFAULT_LISTEN = "127.0.0.1:8380"
DEFAULT_QUEUE = "comfy-assets"
# One input file decoded, so that a job with one fits a message of the worker's default
# limit once in base64 (4 bytes per 3).
MAX_INPUT_BYTES = 3 * 1024**2
# Live event streams a client may hold open at once (``api.streams.StreamCap``).
MAX_STREAMS = 20

log = logging.getLogger("comfy_assets.api")


def listen_address(text: str) -> tuple[str, int]:
    """An argparse ``type`` for ``--listen``: ``HOST:PORT`` (``[::1]:8380`` for IPv6)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def add_api_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``api``."""
    p = add_command(sub, "api", "serve the HTTP API: submit jobs, follow them, fetch files")
    add_store_options(p)
    add_rabbitmq_option(p)
    p.add_argument(
        "--queue",
        type=queue_name,
        default=DEFAULT_QUEUE,
        help=f"the workers' job queue (default {DEFAULT_QUEUE}); dead letters: QUEUE.dead",
    )
    p.add_argument(
        "--listen",
        type=listen_address,
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"where to serve (default {DEFAULT_LISTEN})",
    )
    p.add_argument(
        "--tokens", type=Path, required=True, metavar="FILE", help="clients, one NAME:TOKEN a line"
    )
    p.add_argument(
        "--webhook-secret-file",
        type=Path,
        metavar="FILE",
        help="the secret webhooks are signed with (Standard Webhooks; whsec_<base64> or "
        "text); without it, a job with a webhook is refused",
    )
    p.add_argument(
        "--allow-private-webhooks",
        action="store_true",
        help="call webhooks on loopback, link-local and private addresses too",
    )
    p.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a ComfyUI server of the workers: GET /v1/servers shows its health, a cancel "
        "interrupts its prompt there (repeat)",
    )
    add_size_option(
        p,
        "--max-input-bytes",
        MAX_INPUT_BYTES,
        f"the largest input file of a job, decoded (default {byte_size_text(MAX_INPUT_BYTES)})",
    )
    add_size_option(
        p,
        "--max-message-bytes",
        MAX_MESSAGE_BYTES,
        "the largest queue message, as the workers' --max-message-bytes (default "
        f"{byte_size_text(MAX_MESSAGE_BYTES)})",
    )
    add_size_option(
        p,
        "--max-body-bytes",
        None,
        "the largest request body: larger gets 413 (default: twice --max-message-bytes)",
    )
    p.add_argument(
        "--rate-per-s",
        type=bounded(float, 0, strict=True),
        default=50.0,
        help="requests a second per client, beyond which 429 (50)",
    )
    p.add_argument(
        "--burst", type=bounded(int, 1), default=100, help="requests at once per client (100)"
    )
    p.add_argument(
        "--max-streams",
        type=bounded(int, 1),
        default=MAX_STREAMS,
        help="live event streams (text/event-stream) open at once per client, beyond "
        f"which 429 ({MAX_STREAMS})",
    )
    p.set_defaults(func=api_command)


def api_command(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl+C (exit 0). Exit 2 for bad input (no RabbitMQ URL, a
    tokens or secret file that cannot be used, a bad --server), 1 when the store cannot
    be opened or the address cannot be listened on."""
    from aiohttp import web

    from comfy_assets.api.app import Api, Limits, make_app
    from comfy_assets.api.publisher import Publisher
    from comfy_assets.api.signing import SecretError, load_key
    from comfy_assets.api.tokens import Clients, TokensError
    from comfy_assets.comfy import event_loop
    from comfy_assets.comfy.servers import parse_servers
    from comfy_assets.service.broker import safe_url
    from comfy_assets.store.api_jobs import ApiLedger

    files = store_files(args)  # an object store without --db-url: said first
    if isinstance(files, int):
        return files
    missing = needs_rabbitmq(args)
    if missing:
        return bad_input(missing)
    try:
        clients = Clients.load(args.tokens)
        key = load_key(args.webhook_secret_file) if args.webhook_secret_file else None
        servers = parse_servers(args.server) if args.server else []
    except (TokensError, SecretError, ValueError) as e:
        return bad_input(e)
    store = open_store(args, existing=False, file_store=files)
    if isinstance(store, int):
        return store
    limits = Limits(
        max_input_bytes=args.max_input_bytes,
        max_message_bytes=args.max_message_bytes,
        max_body_bytes=args.max_body_bytes or 2 * args.max_message_bytes,
        rate_per_s=args.rate_per_s,
        burst=args.burst,
        max_streams=args.max_streams,
    )
    api = Api(
        store=store,
        ledger=ApiLedger(store),
        publisher=Publisher(args.rabbitmq, args.queue),
        clients=clients,
        limits=limits,
        webhook_key=key,
        allow_private_webhooks=args.allow_private_webhooks,
        servers=servers,
    )
    logging.getLogger("comfy_assets.api").setLevel(logging.INFO)
    host, port = args.listen
    app = make_app(api)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            shown = f"[{host}]" if ":" in host else host
            print(
                f"api: serving http://{shown}:{port} ({len(clients.names)} "
                f"client{'' if len(clients.names) == 1 else 's'}, queue "
                f"{args.queue} on {safe_url(args.rabbitmq)}, webhooks "
                f"{'on' if key is not None else 'off'})",
                flush=True,
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            print("api: stopping", flush=True)
        finally:
            await runner.cleanup()

    try:
        event_loop.run(serve())
    except OSError as e:
        print(f"error: cannot serve on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return 0
