"""``comfy-assets <command>``: one function per subcommand.

To add a command: write ``add_<name>(sub)`` that registers its parser with
``set_defaults(func=<name>)`` and ``<name>(args) -> int``, then list ``add_<name>`` in
``COMMANDS``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence

from comfy_assets.cli.events import add_events_parser
from comfy_assets.cli.film import add_film_parser
from comfy_assets.cli.run import add_requeue_parser, add_run_parser
from comfy_assets.cli.worker import add_enqueue_parser, add_worker_parser
from comfy_assets.comfy.health import probe_all
from comfy_assets.comfy.servers import parse_servers


def add_health(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="probe ComfyUI servers, one line each")
    p.add_argument(
        "--server",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="gpu0=http://127.0.0.1:8188 (repeat, or comma-separate); a user:password@ "
        "in the URL is sent as basic auth, never printed",
    )
    p.add_argument("--timeout-s", type=float, default=3.0, help="per request (3 s)")
    p.set_defaults(func=health)


def health(args: argparse.Namespace) -> int:
    """Probe every server concurrently; print one line per server. Exit 0 when at least
    one is healthy, 1 otherwise, 2 for bad ``--server`` values."""
    try:
        specs = parse_servers(args.server)
    except ValueError as exc:
        print(f"comfy-assets health: {exc}", file=sys.stderr)
        return 2
    results = asyncio.run(probe_all(specs, args.timeout_s))
    for result in results:
        print(result.line(), flush=True)
    return 0 if any(r.healthy for r in results) else 1


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_health,
    add_run_parser,
    add_requeue_parser,
    add_events_parser,
    add_film_parser,
    add_enqueue_parser,
    add_worker_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comfy-assets",
        description="ComfyUI as a batch-rendering service: probe servers, run job files "
        "exactly once, build films, and run the RabbitMQ worker.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the command; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # `comfy-assets events ... | head`: the reader has what it wanted. Exit as a
        # program killed by SIGPIPE would (128 + 13), without a traceback or a failed
        # flush at exit. (`run` goes on rendering instead: commands.say.)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


if __name__ == "__main__":
    sys.exit(main())
