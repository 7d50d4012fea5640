"""``comfy-assets run`` and ``comfy-assets requeue``: a job file without Dagster."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from comfy_assets.batch import BatchConfig, run_batch_sync
from comfy_assets.comfy.servers import parse_servers
from comfy_assets.jobfile import JobFileError, load_job_file
from comfy_assets.store import Store


def add_batch_options(p: argparse.ArgumentParser) -> None:
    """Retry, deadline and lease knobs shared by ``run`` and ``worker`` (seconds)."""
    p.add_argument("--attempts", type=int, default=4, help="attempts per job (4)")
    p.add_argument("--base-delay-s", type=float, default=2.0, help="backoff base (2 s)")
    p.add_argument("--max-delay-s", type=float, default=60.0, help="backoff cap (60 s)")
    p.add_argument("--no-jitter", action="store_true", help="exact exponential delays")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-attempt deadline")
    p.add_argument("--poll-s", type=float, default=1.0, help="/history poll interval")
    p.add_argument("--lease-s", type=float, default=3600.0, help="job claim lease")
    p.add_argument("--server-lease-s", type=float, default=30.0, help="server lease")
    p.add_argument("--max-queue", type=int, default=None, help="skip servers this busy")


def batch_config(args: argparse.Namespace) -> BatchConfig:
    """A BatchConfig from the options of ``add_batch_options``."""
    return BatchConfig(
        attempts=args.attempts,
        base_delay_s=args.base_delay_s,
        max_delay_s=args.max_delay_s,
        jitter=not args.no_jitter,
        timeout_s=args.timeout_s,
        poll_s=args.poll_s,
        lease_s=args.lease_s,
        server_lease_s=args.server_lease_s,
        max_queue=args.max_queue,
        policy=getattr(args, "policy", None),
    )


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a job file over the servers, without Dagster")
    p.add_argument("--jobs", type=Path, required=True, help="the job file (JSONL)")
    p.add_argument("--server", action="append", required=True, help="gpu0=http://host:port")
    p.add_argument("--store", type=Path, required=True, help="result store folder")
    p.add_argument("--db-url", default=None, help="PostgreSQL URL (default: SQLite)")
    p.add_argument("--partition", default=None, help="partition name (default: file stem)")
    p.add_argument("--policy", choices=["delivery", "draft"], default=None)
    p.add_argument(
        "--events", action="store_true", help="also print every state transition as JSON"
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log scheduling and protocol steps"
    )
    add_batch_options(p)
    p.set_defaults(func=run_command)


def show_logs(args: argparse.Namespace) -> None:
    """Route the scheduler's and the state machine's log lines to stdout on request."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    if getattr(args, "events", False):
        events = logging.getLogger("comfy_assets.events")
        events.setLevel(logging.INFO)
        events.addHandler(handler)
        events.propagate = False
    if getattr(args, "verbose", False):
        for name in ("comfy_assets.pool", "comfy_assets.runner"):
            logging.getLogger(name).setLevel(logging.INFO)
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).propagate = False


def run_command(args: argparse.Namespace) -> int:
    """Exit 0 when every job is done, 1 when any is dead-lettered, 2 for bad input."""
    try:
        servers = parse_servers(args.server)
        job_file = load_job_file(args.jobs)
    except (JobFileError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    store = Store(args.store, args.db_url)
    partition = args.partition or args.jobs.stem
    show_logs(args)
    summary = run_batch_sync(
        job_file,
        partition=partition,
        servers=servers,
        store=store,
        config=batch_config(args),
        on_line=lambda line: print(line, flush=True),
    )
    for name, why in summary.unreachable.items():
        print(f"server {name}: {why}")
    print(summary.line())
    for job_id, reason in summary.dead_letters:
        print(f"  dead letter {job_id}: {reason}")
    if summary.stopped:
        print(f"  {summary.stopped}")
    not_done = len(summary.jobs) - summary.done - summary.dead_lettered
    if not_done:
        print(f"  {not_done} not run")
    return 0 if summary.dead_lettered == 0 and not_done == 0 else 1


def add_requeue_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("requeue", help="clear a dead letter so the job can run again")
    p.add_argument("job_id", nargs="+")
    p.add_argument("--store", type=Path, default=Path("store"))
    p.add_argument("--db-url", default=None)
    p.set_defaults(func=requeue_command)


def requeue_command(args: argparse.Namespace) -> int:
    """Exit 0 when every named job was a dead letter and is pending again, 1 otherwise."""
    store = Store(args.store, args.db_url)
    code = 0
    for job_id in args.job_id:
        if store.requeue(job_id):
            print(f"job {job_id}: requeued (pending)")
        else:
            rec = store.get(job_id)
            state = rec.state if rec else "unknown job"
            print(f"job {job_id}: not a dead letter ({state})", file=sys.stderr)
            code = 1
    return code
