"""``comfy-assets health``: is each ComfyUI server up, and what the store holds against it.

``--server`` probes servers (``/system_stats`` and ``/queue``, one line each); ``--store``
adds each server's health as every process sharing that store judged it (quarantined
until when and why, on trial, strikes: ``store/health.py``), and with no ``--server``
lists the servers the store knows; ``--readmit NAME`` ends a server's quarantine by hand.
Without ``--store`` nothing but http.client is imported: a readiness probe every few
seconds starts in a blink.
"""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from comfy_assets.cli.options import add_command, bounded
from comfy_assets.comfy.servers import parse_servers

if TYPE_CHECKING:
    from comfy_assets.comfy.servers import ServerSpec
    from comfy_assets.store import Store
    from comfy_assets.store.health import ServerHealthRecord


def add_health(sub: argparse._SubParsersAction) -> None:
    """Register ``health [--server NAME=URL ...] [--store DIR [--db-url URL]]
    [--readmit NAME] [--timeout-s S]``."""
    p = add_command(
        sub,
        "health",
        "probe ComfyUI servers, one line each; with --store, their quarantines too",
    )
    p.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="gpu0=http://127.0.0.1:8188 (repeat, or comma-separate); a user:password@ "
        "in the URL is sent as basic auth, never printed",
    )
    p.add_argument(
        "--store",
        type=_store_arg,
        default=None,
        help="a result store (a folder, or s3://BUCKET/PREFIX with --db-url): each server's "
        "quarantine, trial and strikes as the processes sharing it judged them",
    )
    p.add_argument(
        "--db-url",
        metavar="URL",
        default=None,
        # The variable is named, not imported: the store's module loads SQLAlchemy.
        help="the store's database (default: $COMFY_ASSETS_DB_URL, else SQLite at "
        "<store>/store.db)",
    )
    p.add_argument(
        "--readmit",
        action="append",
        default=[],
        metavar="NAME",
        help="end the quarantine of server NAME by hand (needs --store; repeat for more)",
    )
    p.add_argument(
        "--timeout-s", type=bounded(float, 0, strict=True), default=3.0, help="per request (3 s)"
    )
    p.set_defaults(func=health)


def health(args: argparse.Namespace) -> int:
    """Probe every ``--server`` concurrently and print one line per server (its store
    state instead, with ``--store``, when it is quarantined or on trial); re-admit the
    ``--readmit`` servers. Exit 0 when at least one server is healthy and not
    quarantined (or, with ``--readmit`` alone, every server named is usable now, re-admitted
    or never quarantined), 1 otherwise, 2 for bad arguments."""
    specs = _check_args(args)
    if isinstance(specs, int):
        return specs
    records: dict[str, ServerHealthRecord] = {}
    code = 0
    if args.store is not None:
        read = _readmit_and_read(args)
        if isinstance(read, int):
            return read
        records, code = read
        if args.readmit and not specs:
            return code
    if not specs:
        return _print_records(records, args.store)
    return code or (0 if _probe(specs, records, args.timeout_s) else 1)


def _check_args(args: argparse.Namespace) -> list[ServerSpec] | int:
    """The ``--server`` specs, or exit code 2 after saying what is wrong."""
    try:
        specs = parse_servers(args.server) if args.server else []
    except ValueError as exc:
        print(f"comfy-assets health: {exc}", file=sys.stderr)
        return 2
    if args.readmit and args.store is None:
        print("comfy-assets health: --readmit needs --store DIR", file=sys.stderr)
        return 2
    if not specs and args.store is None:
        print("comfy-assets health: give --server NAME=URL, or --store DIR", file=sys.stderr)
        return 2
    return specs


def _readmit_and_read(args: argparse.Namespace) -> tuple[dict[str, ServerHealthRecord], int] | int:
    """Re-admits the ``--readmit`` servers, then reads every server's health record from
    ``--store``: (records by server, exit code so far), or the exit code of a store that
    does not open."""
    opened = _open(args)
    if isinstance(opened, int):
        return opened
    from comfy_assets.store.health import ok_record

    try:
        code = _readmit(opened, args.readmit)
        records = opened.server_health()
        # Servers that rendered and never failed have no health row: ok.
        for name in sorted(opened.server_leases()):
            records.setdefault(name, ok_record(name))
    finally:
        opened.close()
    return records, code


def _readmit(opened: Store, names: list[str]) -> int:
    """Re-admits each of ``names``, printing what changed; 2 if one is unknown, else 0."""
    from comfy_assets.store.health import UnknownServer

    code = 0
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    for name in names:
        try:
            change = opened.readmit_server(name, by)
        except UnknownServer as e:
            print(f"comfy-assets health: --readmit: {e}", file=sys.stderr)
            code = 2
            continue
        if change is None:  # usable already: what --readmit asks for holds
            print(f"{name} ok: not quarantined, no strikes now")
        else:
            print(f"{name} {change.detail}")
    return code


def _print_records(records: dict[str, ServerHealthRecord], store: object) -> int:
    """Prints the store's records alone: 0 when one server is usable (or none failed)."""
    if not records:
        print(f"no server has a failure on record in {store}", flush=True)
        return 0
    for record in records.values():
        print(record.line(), flush=True)
    return 0 if any(r.blocked() is None for r in records.values()) else 1


def _probe(
    specs: list[ServerSpec], records: dict[str, ServerHealthRecord], timeout_s: float
) -> bool:
    """Probes ``specs`` and prints a line each (with its store record); whether one is
    healthy and not blocked."""
    from comfy_assets.comfy.health import probe_all  # after the arguments are checked

    usable = False
    for result in probe_all(specs, timeout_s):
        record = records.get(result.spec.name)
        line = result.line()
        if record is not None and record.state != "ok":
            line = f"{record.line()} (probe: {line.removeprefix(result.spec.name + ' ')})"
        elif record is not None and record.line() != f"{record.server} ok":
            line += record.line().removeprefix(f"{record.server} ok")
        usable = usable or (result.healthy and (record is None or record.blocked() is None))
        print(line, flush=True)
    return usable


def _store_arg(text: str) -> str | Path:
    """``--store``'s type (``cli.run.store_arg``), imported when used: ``health`` without
    a store loads no SQLAlchemy."""
    from comfy_assets.cli.run import store_arg

    return store_arg(text)


def _open(args: argparse.Namespace) -> Store | int:
    """The store of ``--store`` (``open_store``: an exit code after saying why not)."""
    from comfy_assets.cli.run import open_store
    from comfy_assets.store.store import DB_URL_ENV

    args.db_url = args.db_url or os.environ.get(DB_URL_ENV) or None
    return open_store(args, existing=True)
