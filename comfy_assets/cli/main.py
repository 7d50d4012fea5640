"""``comfy-assets <command>``: one function per subcommand.

To add a command: write ``add_<name>(sub)`` that registers its parser with
``set_defaults(func=<name>)`` and ``<name>(args) -> int``, then name its module and
``add_<name>`` in ``COMMANDS``.

A command's module is imported only when that command runs (or for ``--help`` of the
whole program): ``health`` as a readiness probe every few seconds pays for argparse and
http.client, not for an event loop, aiohttp, pandas, SQLAlchemy, PyAV or aio-pika.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

# command name -> (module, function registering its parser), in the order of --help
COMMANDS: dict[str, tuple[str, str]] = {
    "health": ("comfy_assets.cli.health", "add_health"),
    "run": ("comfy_assets.cli.run", "add_run_parser"),
    "requeue": ("comfy_assets.cli.run", "add_requeue_parser"),
    "events": ("comfy_assets.cli.events", "add_events_parser"),
    "status": ("comfy_assets.cli.status", "add_status_parser"),
    "film": ("comfy_assets.cli.film", "add_film_parser"),
    "sync": ("comfy_assets.cli.sync", "add_sync_parser"),
    "enqueue": ("comfy_assets.cli.worker", "add_enqueue_parser"),
    "worker": ("comfy_assets.cli.worker", "add_worker_parser"),
    "api": ("comfy_assets.cli.api", "add_api_parser"),
}


def _adder(name: str) -> Callable[[argparse._SubParsersAction], None]:
    module, function = COMMANDS[name]
    return getattr(importlib.import_module(module), function)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The program's parser with every command's subparser, or with ``command``'s only
    (a name of ``COMMANDS``: then only its module is imported)."""
    parser = argparse.ArgumentParser(
        prog="comfy-assets",
        description="ComfyUI as a batch-rendering service: probe servers, run job files "
        "exactly once, build films, run the RabbitMQ worker and serve the HTTP API.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in [command] if command else COMMANDS:
        _adder(name)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The program has no options of its own, so a command's name comes first. Anything
    # else (no command, -h, a misspelt name) gets the whole parser and its message.
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # `comfy-assets events ... | head`: the reader has what it wanted. Exit as a
        # program killed by SIGPIPE would (128 + 13), without a traceback or a failed
        # flush at exit. (`run` goes on rendering instead: cli.run.print_line.)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


def entry() -> NoReturn:
    """The program (``comfy-assets``, ``python -m comfy_assets.cli``): ``main``, then the
    process ends at once with its exit code. Every command has closed what it opened by
    then (the store, sockets, files, threads of its own), so what is skipped is only the
    interpreter's teardown of the libraries a command loaded (SQLAlchemy, pandas,
    aiohttp), which would otherwise add to the end of every batch's wall time. Logging
    and output are flushed first. Ctrl+C before a command set up its own stop (while
    its libraries load, say) ends it with exit 130 and one line, not a traceback."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("stopped by Ctrl+C", file=sys.stderr)
        code = 130
    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader went away after the command's last line
        code = code or 141
    os._exit(code)


if __name__ == "__main__":
    entry()
