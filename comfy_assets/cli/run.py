"""``comfy-assets run`` and ``comfy-assets requeue``: a job file without Dagster."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from comfy_assets.cli.metrics_option import add_steering_option, serve_metrics, track_metrics
from comfy_assets.cli.options import (
    add_command,
    add_input_options,
    bad_input,
    bounded,
    byte_size,
    byte_size_text,
)
from comfy_assets.comfy.servers import ServerSpec, parse_servers
from comfy_assets.jobs.inputs import rules_of
from comfy_assets.jobs.model import JobFile, JobFileError, is_job_id
from comfy_assets.jobs.stream import JobScan, scan_job_file
from comfy_assets.render.config import KNOBS, BatchConfig, knob_doc
from comfy_assets.store import (
    DB_URL_ENV,
    BadDbUrl,
    NoStore,
    PartitionConflict,
    Store,
    StoreUnavailable,
)
from comfy_assets.store.base import folder_name
from comfy_assets.store.files import (
    FileStore,
    FileStoreFull,
    FileStoreRefused,
    FileStoreUnavailable,
    file_store_for,
)
from comfy_assets.store.location import (
    NoDatabase,
    OtherStoresDatabase,
    check_database,
    store_location,
)
from comfy_assets.store.retry import DEFAULT_RETRY_S

if TYPE_CHECKING:
    from comfy_assets.render.summary import BatchSummary

NOT_RUN_NAMED = 5  # jobs the summary names of those not run (results.csv has them all)


def add_batch_options(p: argparse.ArgumentParser) -> None:
    """Retry, deadline and lease knobs shared by ``run`` and ``worker`` (seconds).

    Out-of-range values are argparse errors (exit 2) naming the option: attempts and
    max queue >= 1, delays >= 0, timeouts, polls and leases > 0, sizes >= 1 byte.
    """
    at_least_one = bounded(int, 1)
    not_negative = bounded(float, 0)
    positive = bounded(float, 0, strict=True)
    for name, kind in [
        ("attempts", at_least_one),
        ("base_delay_s", not_negative),
        ("max_delay_s", not_negative),
        ("timeout_s", positive),
        ("stall_factor", not_negative),
        ("wedge_s", positive),
        ("poll_s", positive),
        ("lease_s", positive),
        ("server_lease_s", positive),
        ("probe_timeout_s", positive),
        ("unhealthy_wait_s", positive),
        ("catch_up_s", not_negative),
        ("files_wait_s", not_negative),
        ("max_queue", at_least_one),
    ]:
        add_knob_option(p, name, kind)
    p.add_argument("--no-jitter", action="store_true", help="exact exponential delays")
    add_knob_option(p, "max_output_bytes", byte_size, metavar="SIZE")


def add_knob_option(
    p: argparse.ArgumentParser,
    name: str,
    kind: Callable[[str], object],
    metavar: str | None = None,
) -> None:
    """``--name-with-dashes`` for BatchConfig's field ``name``: its default, and its doc
    with that default as the help."""
    default = KNOBS[name].default
    if default is None:
        shown = "none"
    elif isinstance(default, float):
        shown = f"{default:g}" + (" s" if name.endswith("_s") else "")
    else:
        if kind is byte_size and isinstance(default, int):
            shown = byte_size_text(default)
        else:
            shown = str(default)
    p.add_argument(
        f"--{name.replace('_', '-')}",
        type=kind,
        default=default,
        metavar=metavar,
        help=f"{knob_doc(name)} Default: {shown}.",
    )


def batch_config(args: argparse.Namespace) -> BatchConfig:
    """A BatchConfig from the options of ``add_batch_options`` (and ``run``'s
    ``--unreachable-timeout-s``; a service that waits for its servers has none)."""
    given = vars(args)  # each option is named after its BatchConfig field
    values = {f.name: given[f.name] for f in dataclasses.fields(BatchConfig) if f.name in given}
    values["jitter"] = not args.no_jitter
    values.setdefault("unreachable_timeout_s", None)
    return BatchConfig(**values)


STORE_HELP = "result store: a folder, or s3://BUCKET/PREFIX (needs --db-url)"
# What the commands that only read or change an existing store say of --store.
EXISTING_STORE_HELP = "the result store: a folder holding store.db, or s3://BUCKET/PREFIX"


def store_arg(text: str) -> str | Path:
    """The argparse ``type`` of ``--store``: ``store.location.store_location`` (a
    folder's Path, or the ``s3://`` text as given); another URL scheme is an argparse
    error (exit 2) naming the option."""
    try:
        return store_location(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--store {text}: ")) from e


def add_store_options(
    p: argparse.ArgumentParser, *, help: str = STORE_HELP, retry: bool = True
) -> None:
    """``--store DIR`` (required, shown with ``help``) and ``--db-url URL``, and with
    ``retry`` ``--db-retry-s SECONDS``: where a command's store is (``open_store``)."""
    p.add_argument("--store", type=store_arg, required=True, help=help)
    add_db_url_option(p)
    if retry:
        add_db_retry_option(p)


def add_db_url_option(p: argparse.ArgumentParser) -> None:
    """``--db-url URL``, by default ``$COMFY_ASSETS_DB_URL`` (read when the parser is
    built), else None: SQLite at ``<store>/store.db``."""
    p.add_argument(
        "--db-url",
        metavar="URL",
        default=os.environ.get(DB_URL_ENV) or None,
        help=f"the store's database, postgresql+psycopg://user:pass@host/db (default: "
        f"${DB_URL_ENV}, which keeps the password out of ps; else SQLite at "
        "<store>/store.db)",
    )


def add_db_retry_option(p: argparse.ArgumentParser) -> None:
    """``--db-retry-s SECONDS``: the store's retry budget (``Store.retry_s``)."""
    p.add_argument(
        "--db-retry-s",
        type=bounded(float, 0),
        default=DEFAULT_RETRY_S,
        metavar="SECONDS",
        help="how long the store's database may be unreachable (a restart, a failover), at "
        "start-up or later, before the command stops; meanwhile it waits "
        f"({DEFAULT_RETRY_S:g} s)",
    )


def store_files(args: argparse.Namespace) -> FileStore | int:
    """The file store of ``--store`` (``file_store_for``), for what a command reads
    before it opens the store (a job line's ``s3://`` inputs), or the exit code 2 after
    saying why not: an object store without ``--db-url``, a location no file store
    reads. Give it to ``open_store``."""
    try:
        check_database(args.store, args.db_url)
        return file_store_for(args.store)
    except (NoDatabase, FileStoreRefused) as e:
        return bad_input(e)


def open_store(
    args: argparse.Namespace, *, existing: bool, file_store: FileStore | None = None
) -> Store | int:
    """The store of ``--store`` / ``--db-url`` (``Store.existing`` when ``existing``: no
    empty store is created; ``file_store``: its files, from ``store_files``), its files
    checked (``FileStore.check``: a folder made, a bucket reached), or the exit code
    after saying why not on stderr in one line: 2 for no ``store.db``, a URL that is not
    a database URL, an object store without ``--db-url``, a database holding another
    object store's records, a wrong endpoint, bucket or credential; 1 for a database
    that refuses us, stays unreachable for ``--db-retry-s``, or has no disk space left,
    or files that do not answer."""
    retry_s = getattr(args, "db_retry_s", DEFAULT_RETRY_S)
    try:
        if existing:
            store = Store.existing(args.store, args.db_url, retry_s=retry_s, file_store=file_store)
        else:
            store = Store(args.store, args.db_url, retry_s=retry_s, file_store=file_store)
    except (NoStore, BadDbUrl, NoDatabase, OtherStoresDatabase, FileStoreRefused) as e:
        return bad_input(e)
    except StoreUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the SQLite store's folder: a file there, no permission
        print(f"error: cannot open the store folder {args.store}: {e.strerror}", file=sys.stderr)
        return 1
    try:
        store.file_store.check()
    except FileStoreRefused as e:
        store.close()
        return bad_input(e)
    except (FileStoreUnavailable, FileStoreFull) as e:
        store.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    return store


def add_server_options(p: argparse.ArgumentParser) -> None:
    """``--server NAME=URL`` (repeated), as ``run`` and ``worker`` take it."""
    p.add_argument(
        "--server",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="gpu0=http://host:port (repeat); a user:password@ in the URL is sent as basic "
        "auth, never printed",
    )


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "run", "run a job file over the servers, without Dagster")
    p.add_argument("--jobs", type=Path, required=True, help="the job file (JSONL)")
    add_input_options(p)
    add_server_options(p)
    add_store_options(p)
    p.add_argument("--partition", default=None, help="partition name (default: file stem)")
    p.add_argument("--policy", choices=["delivery", "draft"], default=None, help=knob_doc("policy"))
    add_steering_option(p, "priority")
    p.add_argument(
        "--events", action="store_true", help="also print every state transition as JSON"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log scheduling and protocol steps")
    add_batch_options(p)
    add_knob_option(p, "unreachable_timeout_s", bounded(float, 0, strict=True))
    add_steering_option(p, "metrics")
    add_steering_option(p, "metrics_host")
    p.set_defaults(func=run_command)


def show_logs(args: argparse.Namespace) -> None:
    """Route the scheduler's and the state machine's log lines to stdout on request."""
    handler = LineHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    if getattr(args, "events", False):
        events = logging.getLogger("comfy_assets.jobs.events")
        events.setLevel(logging.INFO)
        events.addHandler(handler)
        events.propagate = False
    if getattr(args, "verbose", False):
        for name in ("comfy_assets.pool", "comfy_assets.render.attempt"):
            logging.getLogger(name).setLevel(logging.INFO)
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).propagate = False


def print_line(line: str) -> None:
    """Print one line of ``run``'s output. When the reader has gone away (``run | head``)
    the run goes on without its lines (one note on stderr): the renders, the store and
    results.csv matter more than the progress lines nobody reads any more."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        _to_devnull(sys.stdout)  # later lines, and the exit flush, go nowhere
        try:
            print(
                "comfy-assets: standard output was closed; the run goes on without progress lines",
                file=sys.stderr,
                flush=True,
            )
        except BrokenPipeError:  # `run ... 2>&1 | head`: the same reader had both
            _to_devnull(sys.stderr)


def _to_devnull(stream: TextIO) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


class LineHandler(logging.Handler):
    """A log handler printing each record as a line of ``run``'s output (``print_line``):
    once the reader has gone away the records go nowhere, as the job lines do, instead
    of a "Logging error" traceback each."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        print_line(line)


def _load(args: argparse.Namespace) -> tuple[FileStore, list[ServerSpec], JobFile | JobScan] | int:
    """``run``'s store files, servers and job file (its ``s3://`` inputs read through
    those files), or exit code 2 after saying why not."""
    files = store_files(args)
    if isinstance(files, int):
        return files
    try:
        servers = parse_servers(args.server)
        # Validated whole in one pass, its jobs not held: taken a chunk at a time.
        job_file = scan_job_file(args.jobs, rules=rules_of(args, files))
    except (JobFileError, ValueError, OSError) as e:
        return bad_input(e)
    except FileStoreUnavailable as e:  # reading an s3:// input: the store's, not the file's
        print(f"error: {e}", file=sys.stderr)
        return 1
    return files, servers, job_file


def run_command(args: argparse.Namespace) -> int:
    """Exit 0 when every job is done, 1 when any is dead-lettered or not run, 2 for bad
    input, 130 on Ctrl+C and 143 on SIGTERM (after cleaning up: prompts interrupted and
    removed from their servers, claims and server leases released).

    The store's database away (a restart, a failover), at start-up or during the run, is
    waited for up to ``--db-retry-s``. A store unreachable for longer, or a full disk
    (the store's or the outputs'), stops the run with one ``error:`` line naming what
    could not be written where, and exit 1; results.csv is written if there is room."""
    loaded = _load(args)
    if isinstance(loaded, int):
        return loaded
    files, servers, job_file = loaded
    partition = args.jobs.stem if args.partition is None else args.partition
    try:
        folder_name(partition, "partition")  # a partition that can't be a folder: bad input
    except ValueError as e:
        return bad_input(e)
    failed = serve_metrics(args)
    if failed is not None:
        return failed
    stopped_by = ["Ctrl+C"]
    try:
        with stopped_by_signals() as stopped_by:  # opening may wait for the database
            store = open_store(args, existing=False, file_store=files)
    except KeyboardInterrupt:
        print(
            f"stopped by {stopped_by[0]} while opening the store; nothing was run", file=sys.stderr
        )
        return 143 if stopped_by[0] == "SIGTERM" else 130
    if isinstance(store, int):
        return store
    show_logs(args)
    track_metrics(args, store, partition)
    # The batch (aiohttp, websockets) and the bar (tqdm) are imported by the command that
    # runs them: ``requeue``, ``events`` and ``worker`` build their parsers here too.
    from comfy_assets.render.run import run_batch_sync

    bar = None
    if sys.stdout.isatty():  # a progress bar, the lines above it; elsewhere the lines alone
        from comfy_assets.cli.progress_bar import ProgressBar

        bar = ProgressBar(job_count(job_file), sys.stdout)
    with stopped_by_signals() as stopped_by:
        ended: BaseException | None = None
        try:
            summary = run_batch_sync(
                job_file,
                partition=partition,
                servers=servers,
                store=store,
                config=batch_config(args),
                on_line=bar.line if bar else print_line,
                on_progress=bar.update if bar else None,
                priority=args.priority,
            )
        except (
            PartitionConflict,
            KeyboardInterrupt,
            StoreUnavailable,
            FileStoreUnavailable,
            FileStoreFull,
            OSError,
        ) as e:
            ended = e
        finally:
            if bar:
                bar.close()  # before any line below: they go under the bar, not into it
        if ended is not None:
            return _stopped(ended, store, partition, job_file, stopped_by[0])
    try:
        # Dead letters too: the table is where their reasons are read afterwards. Written
        # before the lines below, which say whether it holds the dead letters not named.
        path, not_written = results_table(store, partition, job_file)
    finally:
        store.close()
    for name, why in summary.unreachable.items():
        print_line(f"server {name}: {why}")
    print_line(summary.line())
    from comfy_assets.cli.status import dead_letters_where

    for line in summary.dead_letter_lines(dead_letters_where(args, path, partition)):
        print_line(line)
    if summary.stopped:
        print_line(f"  {summary.stopped}")
    not_done = summary.not_done
    if not_done:
        print_line(not_run_line(summary))
    if not_written:  # the table is the run's result: without it the run is not done
        print(f"error: {not_written}", file=sys.stderr)
        return 1
    print_line(f"results: {path}")
    return 0 if summary.dead_lettered == 0 and not_done == 0 else 1


def not_run_line(summary: BatchSummary) -> str:
    """The summary's line of the jobs neither done nor dead-lettered, naming the first."""
    left = [j for j in summary.jobs if not j.done and j.state != "failed_fatal"]
    shown = left[:NOT_RUN_NAMED]
    named = ", ".join(f"{j.job_id} ({j.state})" for j in shown)
    rest = summary.not_done - len(shown)
    more = f" and {rest} more" if rest else ""
    if not shown:  # a batch stopped before registering them: none has a record
        named, more = "not registered yet (the next run registers them)", ""
    return f"  {summary.not_done} not run: {named}{more}"


def _stopped(
    ended: BaseException,
    store: Store,
    partition: str,
    job_file: JobFile | JobScan,
    signal_name: str,
) -> int:
    """What ``run`` says and returns when its batch did not end by itself: 2 for a job
    file registered under another partition, 130/143 when stopped by Ctrl+C/SIGTERM
    (results.csv written first), 1 when the store or our disk failed."""
    if isinstance(ended, PartitionConflict):
        print(
            f"error: {ended}; to render these jobs under their first partition, pass "
            f"--partition {next(iter(ended.conflicts.values()))}",
            file=sys.stderr,
        )
        return 2
    # The table of what is done so far: every run writes it, a stopped one too.
    path, not_written = results_table(store, partition, job_file)
    store.close()
    if path:
        print_line(f"results: {path}")
    if isinstance(ended, KeyboardInterrupt):
        if not_written:
            print(not_written, file=sys.stderr)
        print(
            f"stopped by {signal_name}: each job's line above says whether its prompt "
            "was removed and its claim released; run again to finish (done jobs are not "
            "rendered again)",
            file=sys.stderr,
        )
        return 143 if signal_name == "SIGTERM" else 130
    # The store, or our disk under it (an output folder we may not write, a full disk),
    # failed: no fault of a job, so the batch stops rather than fail them. One line says
    # it all, results.csv's fate included.
    also = f"; also {not_written}" if not_written else ""
    print(
        f"error: {ended}{also}; the run stopped: each job's line above says what became of "
        "its prompt; run again to finish (done jobs are not rendered again)",
        file=sys.stderr,
    )
    return 1


def job_count(job_file: JobFile | JobScan) -> int:
    """How many jobs ``job_file`` has."""
    return job_file.count if isinstance(job_file, JobScan) else len(job_file.jobs)


def job_ids(job_file: JobFile | JobScan) -> Sequence[str]:
    """The job ids of ``job_file``, in line order."""
    if isinstance(job_file, JobScan):
        return job_file.job_ids()
    return [job.id for job in job_file.jobs]


def results_table(
    store: Store, partition: str, job_file: JobFile | JobScan
) -> tuple[str | None, str | None]:
    """Write results.csv: (its path, None); or (None, why it could not be written:
    ``<path> not written: <why>``), for the caller to say."""
    from comfy_assets.render.results import results_location, write_results
    from comfy_assets.store import StoreError

    try:
        path, _ = write_results(store, partition, job_ids(job_file))
    except (StoreError, OSError) as e:  # the database's or the files' (StoreUnavailable...)
        # A write cut short by a full disk raises an OSError that names no file.
        return None, f"{results_location(store, partition)} not written: {e}"
    return path, None


@contextmanager
def stopped_by_signals() -> Iterator[list[str]]:
    """Ctrl+C and SIGTERM (a container stop, ``timeout``) raise KeyboardInterrupt in the
    main thread, which ``run_batch_sync`` turns into a clean cancellation. Only the first
    one: a signal while the run cleans up is said on stderr, not raised, so the cleanup
    the first one asked for (prompts interrupted and removed, claims released,
    results.csv) is not cut short (``kill -9`` stops at once, leaving them). Yields a
    one-item list naming the signal that stopped the run."""
    stopped_by = ["Ctrl+C"]
    raised: list[bool] = []

    def on_signal(signum: int, frame: object) -> None:
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl+C"
        # Marked before anything else: a second signal can run this again inside the
        # print below, and must find the run stopping.
        first = not raised
        raised.append(True)
        if first:
            stopped_by[0] = name
        try:
            print(
                f"{name}: {'stopping' if first else 'already stopping'}: removing our "
                "prompts from their servers and releasing the claims (kill -9 stops at "
                "once, leaving them)",
                file=sys.stderr,
                flush=True,
            )
        except BrokenPipeError:  # nobody reads stderr any more: nothing to tell
            _to_devnull(sys.stderr)
        if first:
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopped_by
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def add_requeue_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``requeue JOB_ID... --store DIR [--db-url URL]``."""
    p = add_command(sub, "requeue", "clear dead letters and degraded jobs so they render again")
    p.add_argument(
        "job_id",
        nargs="+",
        metavar="JOB_ID",
        help="the job id (UUID) of a dead letter, or of a job degraded under the draft policy",
    )
    add_store_options(p, help=EXISTING_STORE_HELP, retry=False)
    p.set_defaults(func=requeue_command)


def requeue_command(args: argparse.Namespace) -> int:
    """Exit 0 when every named job was a dead letter or degraded and is pending again (the
    next run of its file renders it), 1 otherwise;
    2 for a job id that is not a lowercase UUID, or a ``--store`` folder without
    ``store.db`` (and no ``--db-url``): nothing is created or changed then."""
    bad = [job_id for job_id in args.job_id if not is_job_id(job_id)]
    if bad:
        return bad_input(f"not a job id (a lowercase UUID): {', '.join(bad)}")
    store = open_store(args, existing=True)
    if isinstance(store, int):
        return store
    code = 0
    try:
        for job_id in args.job_id:
            if store.requeue(job_id):
                print(f"job {job_id}: requeued (pending)")
            else:
                rec = store.get(job_id)
                why = (
                    f"neither a dead letter nor degraded ({rec.state})"
                    if rec
                    else "no such job in the store"
                )
                print(f"job {job_id}: {why}", file=sys.stderr)
                code = 1
    finally:
        store.close()
    return code
