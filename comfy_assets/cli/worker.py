"""``comfy-assets enqueue`` and ``comfy-assets worker``: publishing a job file's jobs to a
RabbitMQ queue, and the worker service that renders them (``service.worker.Worker``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from comfy_assets.cli import worker_signals
from comfy_assets.cli.metrics_option import (
    add_steering_option,
    serve_metrics,
    track_metrics,
)
from comfy_assets.cli.options import (
    add_command,
    add_input_options,
    add_size_option,
    bad_input,
    bounded,
)
from comfy_assets.cli.run import (
    add_batch_options,
    add_server_options,
    add_store_options,
    batch_config,
    open_store,
    store_files,
)
from comfy_assets.comfy import event_loop
from comfy_assets.comfy.servers import parse_servers
from comfy_assets.jobs.inputs import rules_of
from comfy_assets.jobs.model import InputChanged, JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.stream import JobFileChanged
from comfy_assets.render.config import knob_doc
from comfy_assets.service import broker
from comfy_assets.service.messages import MAX_MESSAGE_BYTES, chained_problems
from comfy_assets.service.queue_file import scan_queue_file
from comfy_assets.service.sources import FileSource, JobSource, RabbitSource
from comfy_assets.service.worker import Worker
from comfy_assets.store import StoreUnavailable
from comfy_assets.store.base import folder_name
from comfy_assets.store.files import FileStoreFull, FileStoreUnavailable


def queue_name(text: str) -> str:
    """An argparse ``type`` for ``--queue``: a name RabbitMQ lets a client declare
    (1 to 255 bytes of UTF-8, not starting with the reserved ``amq.``); raises
    ``argparse.ArgumentTypeError`` otherwise."""
    if not text or len(text.encode()) > 255 or text.startswith("amq."):
        raise argparse.ArgumentTypeError(
            f"expected a queue name of 1 to 255 bytes not starting with 'amq.', got {text!r}"
        )
    return text


# Said after an enqueue that stopped part way, and in its --help.
PART_WAY = (
    "messages RabbitMQ confirmed stay queued; enqueue the same file again to "
    "finish: every job is published again and still renders once (a worker acks a copy "
    "of a job already done without rendering it)"
)
ENQUEUE_EPILOG = (
    "The whole file is validated before anything is published (exit 2, every error "
    "listed); its messages are then built and published a chunk at a time, each "
    "confirmed by RabbitMQ, so memory does not grow with the file. Stopped part way "
    "(killed, RabbitMQ lost, the file changed), the " + PART_WAY + "."
)


def add_enqueue_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``enqueue``: ``--rabbitmq URL --queue NAME --jobs FILE``."""
    p = add_command(
        subparsers, "enqueue", "validate a job file and publish its jobs to a RabbitMQ queue"
    )
    add_rabbitmq_option(p)
    p.add_argument(
        "--queue",
        required=True,
        type=queue_name,
        help="job queue (quorum); dead letters: QUEUE.dead",
    )
    p.add_argument("--jobs", type=Path, required=True, help="the job file (JSONL)")
    add_input_options(p)
    p.add_argument(
        "--partition",
        default=None,
        help="partition the worker renders them under (default: the file's stem, as in run)",
    )
    add_max_message_option(p, "a job whose message is larger is an error; nothing is sent")
    add_steering_option(p, "priority")
    p.epilog = ENQUEUE_EPILOG
    p.set_defaults(func=enqueue_command)


def add_rabbitmq_option(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    """``--rabbitmq URL``, by default ``$COMFY_ASSETS_RABBITMQ_URL`` (read when the
    parser is built), which keeps the password out of ``ps``."""
    p.add_argument(
        "--rabbitmq",
        metavar="URL",
        default=os.environ.get(broker.RABBITMQ_URL_ENV) or None,
        help=f"amqp://user:pass@host:5672/ (default: ${broker.RABBITMQ_URL_ENV}, which "
        "keeps the password out of ps)",
    )


def add_max_message_option(p: argparse.ArgumentParser, what: str) -> None:
    add_size_option(
        p,
        "--max-message-bytes",
        MAX_MESSAGE_BYTES,
        f"most bytes one message may have (4MiB); {what}",
    )


def needs_rabbitmq(args: argparse.Namespace) -> str | None:
    """What is missing when no RabbitMQ URL was given, by option or environment."""
    if args.rabbitmq:
        return None
    return f"no RabbitMQ URL: give --rabbitmq URL or set ${broker.RABBITMQ_URL_ENV}"


def enqueue_command(args: argparse.Namespace) -> int:
    """Publish every job of ``args.jobs`` to ``args.queue`` with confirms; print
    ``enqueued N jobs to NAME``. The whole file is validated first (``scan_queue_file``),
    then its messages are built and published a chunk at a time. Exit 0; 2 for an invalid
    file (every error printed, nothing published) or no RabbitMQ URL; 1 when RabbitMQ
    fails, or the file or an input file changes or cannot be read while it is published
    (the messages confirmed before stay queued: enqueueing the file again finishes it);
    143 when SIGTERM stops it part way (saying the same)."""
    missing = needs_rabbitmq(args)
    if missing:
        return bad_input(missing)
    try:
        if args.partition is not None:
            folder_name(args.partition, "--partition")
        found = scan_queue_file(
            args.jobs,
            args.max_message_bytes,
            args.partition,
            rules=rules_of(args),
            priority=args.priority,
        )
    except JobFileError as e:
        print(f"error: {args.jobs}: {len(e.errors)} problem(s), nothing enqueued", file=sys.stderr)
        for err in e.errors:
            print(f"  {err}", file=sys.stderr)
        return 2
    except JobFileChanged as e:
        print(f"error: {e}; nothing enqueued", file=sys.stderr)
        return 1
    except ValueError as e:  # the --partition name
        return bad_input(e)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        count = event_loop.run(broker.enqueue(args.rabbitmq, args.queue, found.messages()))
    except broker.BrokerError as e:
        print(f"error: {e}", file=sys.stderr)
        print(PART_WAY, file=sys.stderr)
        return 1
    except (OSError, InputChanged) as e:  # JobFileChanged, an input changed or unreadable
        print(f"error: {args.jobs}: {e}", file=sys.stderr)
        print(PART_WAY, file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(PART_WAY, file=sys.stderr)
        if e.args == (SIGTERM_STOP,):
            print("stopped by SIGTERM", file=sys.stderr)
            return 143
        # Ctrl+C part way: ``entry`` says "stopped by Ctrl+C" and exits 130.
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"enqueued {count} jobs to {args.queue}", flush=True)
    return 0


# What a SIGTERM raises while ``enqueue`` publishes (a container stop, ``timeout``).
SIGTERM_STOP = "SIGTERM"


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM stops ``enqueue`` as Ctrl+C does, saying what is left (exit 143)."""
    raise KeyboardInterrupt(SIGTERM_STOP)


def add_worker_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``worker``: a RabbitMQ queue (``--rabbitmq --queue``) or a job file
    (``--jobs``) over ``--server``s, with the retry knobs of ``run``."""
    p = add_command(subparsers, "worker", "run jobs from a RabbitMQ queue (or a job file)")
    src = p.add_mutually_exclusive_group()
    add_rabbitmq_option(src)
    src.add_argument("--jobs", type=Path, help="a job file instead of a queue")
    add_input_options(p)
    p.add_argument(
        "--queue", type=queue_name, help="job queue (with --rabbitmq); dead letters: QUEUE.dead"
    )
    add_server_options(p)
    add_store_options(p)
    p.add_argument(
        "--partition", default=None, help="store partition (default: the queue name or file stem)"
    )
    p.add_argument(
        "--grace-s",
        type=bounded(float, 0),
        default=60.0,
        help="running jobs' time to finish at shutdown (60 s)",
    )
    p.add_argument(
        "--workflows-dir",
        type=Path,
        default=Path("."),
        help="where messages that name their workflow by path find it, never outside (.); "
        "messages from enqueue carry theirs inline",
    )
    add_max_message_option(p, "a larger message is dead-lettered unparsed")
    p.add_argument(
        "--health-file",
        type=Path,
        default=None,
        help="touched every --heartbeat-s while alive; its folder must exist",
    )
    p.add_argument(
        "--heartbeat-s",
        type=bounded(float, 0, strict=True),
        default=5.0,
        help="health file interval (5 s)",
    )
    p.add_argument("--policy", choices=["delivery", "draft"], default=None, help=knob_doc("policy"))
    add_batch_options(p)
    add_steering_option(p, "metrics")
    add_steering_option(p, "metrics_host")
    p.set_defaults(func=worker_command)


@contextmanager
def service_logging() -> Iterator[None]:
    """While the worker runs, it logs to stderr, INFO and up, with times (in place of the
    one-line WARNING format of the other commands); the logging set-up it replaced comes
    back when it returns (in-process callers, tests, keep theirs)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def worker_command(args: argparse.Namespace) -> int:
    """Run the worker until SIGTERM/SIGINT (a queue) or the end of the file (``--jobs``).

    Exit 0 after a graceful stop (a signal at any moment: ``cli.worker_signals``) or a
    file whose jobs are all done; 1 when a file's job was dead-lettered, RabbitMQ failed
    or was lost, the store's database stayed away longer than ``--db-retry-s``, a disk
    was full (the store's or the outputs': the messages held are requeued), or a
    message's handling failed; 2 for bad arguments, an invalid job file or a
    ``--health-file`` whose folder does not exist.
    """
    with service_logging():
        return _worker(args)


def health_file_problem(path: Path) -> str | None:
    """Why the worker could not keep ``path`` as its health file, or None. Its folder is
    not made here: on Kubernetes it is the volume the liveness probe and the ComfyUI
    containers' preStop hooks read too, and a folder of the worker's own would hide
    from them that it is not mounted."""
    folder = path.parent
    if not folder.is_dir():
        return (
            f"--health-file {path}: folder {folder} does not exist (create it, or mount the "
            "volume the liveness probe reads there)"
        )
    if path.is_dir():
        return f"--health-file {path}: is a folder"
    if not os.access(folder, os.W_OK):
        return f"--health-file {path}: folder {folder} is not writable"
    return None


def _worker(args: argparse.Namespace) -> int:
    try:
        servers = parse_servers(args.server)
    except ValueError as e:
        return bad_input(e)
    files = store_files(args)
    if isinstance(files, int):
        return files
    source: JobSource
    if args.jobs is not None:
        try:
            job_file = load_job_file(args.jobs, rules=rules_of(args, files))
            chained = chained_problems(job_file)
            if chained:
                raise JobFileError(chained)
            source = FileSource(job_file, partition=args.partition)
        except JobFileError as e:
            return bad_input(f"{args.jobs}:\n{e}")
        except FileStoreUnavailable as e:  # reading an s3:// input: the store's failure
            print(f"error: {e}", file=sys.stderr)
            return 1
    else:
        missing = needs_rabbitmq(args)
        if missing:
            return bad_input(f"{missing}, or --jobs FILE")
        if not args.queue:
            return bad_input("--rabbitmq needs --queue")
        source = RabbitSource(args.rabbitmq, args.queue)
        if args.partition:
            source.partition = args.partition
    problem = args.health_file and health_file_problem(args.health_file)
    if problem:
        return bad_input(problem)
    failed = serve_metrics(args)
    if failed is not None:
        return failed
    store = open_store(args, existing=False, file_store=files)
    if isinstance(store, int):
        return store
    track_metrics(args, store, None)
    worker = Worker(
        source,
        servers=servers,
        store=store,
        config=batch_config(args),
        grace_s=args.grace_s,
        workflows_dir=args.workflows_dir,
        max_message_bytes=args.max_message_bytes,
        health_file=args.health_file,
        heartbeat_s=args.heartbeat_s,
    )
    try:
        event_loop.run(serve(worker))
    except (
        broker.BrokerError,
        StoreUnavailable,
        FileStoreUnavailable,
        FileStoreFull,
        OSError,
    ) as e:
        # RabbitMQ; the store (its database or its files) away past its budget, or full;
        # our disk (an output that cannot be written). The messages held went back to the
        # queue.
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if worker.stop_reason is None and isinstance(source, FileSource):
        dead = worker.counts["dead_lettered"] + worker.counts["dead_before"]
        return 1 if dead else 0
    return 0


async def serve(worker: Worker) -> None:
    """``worker.run()`` with SIGTERM and SIGINT asking it to stop gracefully; after it,
    a signal only says the worker is already stopping (``cli.worker_signals``)."""
    loop = asyncio.get_running_loop()
    previous = worker_signals.handlers()
    for sig in worker_signals.SIGNALS:
        loop.add_signal_handler(sig, worker.request_stop, sig.name)
    try:
        await worker.run()
    finally:
        # The loop gives each signal back to its default, and the next handler follows
        # a few microseconds later (a signal process-wide reaches any thread, so
        # blocking it in this one would not close that gap).
        for sig in worker_signals.SIGNALS:
            loop.remove_signal_handler(sig)
        worker_signals.after_serving(previous)
