"""``comfy-assets events``: what happened to one job, or to shot 17, as one command.

Reads the event rows of a result store (every state transition, oldest first) and prints
one line per event, or one JSON object per line with ``--json``: the latest ``--limit``
of them (1,000 unless told), then on stderr how many earlier ones were not printed
(counted up to ``EARLIER_COUNTED``).

Register it in ``cli.COMMANDS`` as ``add_events_parser``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime

from comfy_assets.cli.options import add_command, bad_input
from comfy_assets.cli.run import EXISTING_STORE_HELP, add_store_options, open_store
from comfy_assets.jobs.events import Event, event_json
from comfy_assets.jobs.model import is_job_id
from comfy_assets.jobs.strict_json import MAX_SHOT, is_shot

EXIT_OK = 0
EXIT_NOTHING = 1
# Events printed unless ``--limit`` says otherwise: a million-job partition has
# millions of them.
DEFAULT_LIMIT = 1000
# Earlier events counted at most (a count in bounded time): past it, "over 100,000".
EARLIER_COUNTED = 100_000


def _shot(text: str) -> int:
    """An argparse ``type`` for ``--shot``: an integer from 0 to MAX_SHOT, as in job files."""
    try:
        value: object = int(text)
    except ValueError:
        value = None
    if not is_shot(value):
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {MAX_SHOT}, got {text!r}")
    return int(text)


# The largest integer a store's query takes (SQLite's INTEGER, PostgreSQL's BIGINT).
MAX_COUNT = 2**63 - 1


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum``, at most ``MAX_COUNT``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        if value > MAX_COUNT:
            raise argparse.ArgumentTypeError(f"expected an integer <= {MAX_COUNT}, got {text!r}")
        return value

    return parse


def add_events_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``events --store DIR [--db-url URL] (--job ID | --partition P [--shot N])
    [--limit N] [--before ID] [--json]`` on the ``comfy-assets`` subparsers."""
    p = add_command(
        sub, "events", "what happened to a job or a shot: its state transitions, oldest first"
    )
    add_store_options(p, help=EXISTING_STORE_HELP, retry=False)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", metavar="JOB_ID", help="one job's events")
    which.add_argument("--partition", help="the events of a partition's jobs")
    p.add_argument(
        "--shot", type=_shot, default=None, help="with --partition: only this shot's job"
    )
    p.add_argument(
        "--limit",
        type=_count(0),
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"print the latest N events, oldest first (default {DEFAULT_LIMIT}; 0: all); how"
        " many earlier ones there are is said on stderr",
    )
    p.add_argument(
        "--before",
        type=_count(1),
        metavar="EVENT_ID",
        help="only events older than this one (an id of --json or of the note on stderr):"
        " the page before",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per event and line")
    p.set_defaults(func=events_command)


def events_command(args: argparse.Namespace) -> int:
    """Print the latest ``--limit`` matching events (all with 0) older than ``--before``,
    oldest first; when earlier ones match too, say on stderr how many (up to
    ``EARLIER_COUNTED``) and how to print them: ``over 100,000 earlier events not
    printed: --before 2499001 prints the 1,000 before these, --limit 0 prints every
    one``.

    Exit 0 when at least one event matches; 1 when none does (an unknown job, partition
    or shot); 2 for bad input: ``--shot`` without ``--partition``, a ``--job`` that is
    not a lowercase UUID, or no ``store.db`` under ``--store`` (and no ``--db-url``).
    """
    if args.shot is not None and args.partition is None:
        return bad_input("--shot needs --partition (shot numbers are per job file)")
    if args.job is not None and not is_job_id(args.job):
        return bad_input(f"--job {args.job!r} is not a job id (a lowercase UUID)")
    store = open_store(args, existing=True)
    if isinstance(store, int):
        return store
    which = {"job_id": args.job, "partition": args.partition, "shot": args.shot}
    limit = args.limit or None
    try:
        events = store.events(**which, limit=limit, before=args.before)
        earlier = 0
        if events and limit is not None and len(events) == limit:
            earlier = store.count_events(**which, before=events[0].id, at_most=EARLIER_COUNTED + 1)
    finally:
        store.close()
    if not events:
        print(f"no events for {_query(args)} in {args.store}", file=sys.stderr)
        return EXIT_NOTHING
    # Several jobs share the output of a partition query: name each line's job there.
    many_jobs = len({event.job_id for event in events}) > 1
    for event in events:
        print(event_json(event) if args.json else event_line(event, with_job=many_jobs))
    if earlier:
        # On stderr: stdout stays one event a line (``--json`` stays JSON lines).
        sys.stdout.flush()
        if earlier == 1:
            said = f"1 earlier event not printed: --before {events[0].id} prints it"
        else:
            many = f"over {EARLIER_COUNTED:,}" if earlier > EARLIER_COUNTED else f"{earlier:,}"
            said = (
                f"{many} earlier events not printed: --before {events[0].id} prints the"
                f" {min(earlier, len(events)):,} before these"
            )
        print(f"{said}, --limit 0 prints every one", file=sys.stderr)
    return EXIT_OK


def event_line(event: Event, *, with_job: bool = False) -> str:
    """``2025-01-31T12:00:00.123+00:00 pending → submitted gpu0 attempt 1 detail``.

    The time is UTC ISO 8601 (milliseconds); ``-`` stands for no previous state (the
    job's registration), no server or no attempt. ``with_job`` puts the job id after
    the time.
    """
    when = datetime.fromtimestamp(event.time, tz=UTC).isoformat(timespec="milliseconds")
    parts = [when]
    if with_job:
        parts.append(f"job {event.job_id}")
    parts += [
        event.from_state or "-",
        "→",
        event.to_state,
        event.server or "-",
        "-" if event.attempt is None else f"attempt {event.attempt}",
    ]
    if event.detail:
        parts.append(event.detail)
    return " ".join(parts)


def _query(args: argparse.Namespace) -> str:
    if args.job is not None:
        which = f"job {args.job}"
    elif args.shot is not None:
        which = f"shot {args.shot} of partition {args.partition!r}"
    else:
        which = f"partition {args.partition!r}"
    return which if args.before is None else f"{which} before event {args.before}"
