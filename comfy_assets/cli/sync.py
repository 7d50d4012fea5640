"""``comfy-assets sync``: copy a partition's outputs from the store (a folder or an
object store) to a folder of this machine, only what is new or changed since the last
sync (``store.files.sync``), for people who want the files on their desk.

Register it in ``cli.COMMANDS`` as ``add_sync_parser``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from comfy_assets.cli.options import add_command, bad_input
from comfy_assets.cli.run import add_store_options, open_store

EXIT_OK = 0
EXIT_NOT_ALL_COPIED = 1


def add_sync_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``sync`` on the ``comfy-assets`` subparsers."""
    p = add_command(
        sub, "sync", "copy a partition's outputs to a folder, only what is new or changed"
    )
    add_store_options(p)
    p.add_argument("--partition", required=True, help="the partition (a job file's stem)")
    p.add_argument(
        "--to",
        type=Path,
        required=True,
        metavar="DIR",
        help="the folder to copy to: <DIR>/<job id>/<file>; files already there with the "
        "store's size and sha256 are not copied again, files the store does not list are "
        "left alone",
    )
    p.set_defaults(func=sync_command)


def sync_command(args: argparse.Namespace) -> int:
    """Copy the current outputs of every job of ``--partition`` to ``--to``.

    Prints one line of counts (``sync P -> DIR: 3 new, 1 changed, 5 unchanged, 0 failed
    (12345 bytes copied)``), before it one line on stderr per file not copied. Exit 0
    when every output is in ``--to`` as recorded; 1 when one could not be copied (gone
    from the store, or not as recorded there), or the store or the folder failed midway
    (what was copied stays: a sync again goes on from there); 2 for bad input: no store
    at ``--store``, a partition holding no jobs, a ``--to`` that is a file.
    """
    from comfy_assets.store import StoreUnavailable
    from comfy_assets.store.files import FileStoreFull, FileStoreUnavailable
    from comfy_assets.store.files.sync import sync_outputs

    to: Path = args.to
    if to.exists() and not to.is_dir():
        return bad_input(f"--to {to} is a file: give a folder")
    store = open_store(args, existing=True)
    if isinstance(store, int):
        return store
    try:
        records = store.jobs(args.partition)
        if not records:
            return bad_input(
                f"partition {args.partition!r} of {args.store} holds no jobs: name a partition "
                "that was rendered (a job file's stem, or the API's api-<client>)"
            )
        by_job = store.partition_files(args.partition)
        outputs = [
            (record.job_id, f)
            for record in records
            for f in by_job.get(record.job_id, [])
            if f.prompt_id == record.prompt_id  # the job's current inputs only
        ]
        counts = sync_outputs(store.file_store, args.partition, outputs, to)
    except (StoreUnavailable, FileStoreUnavailable, FileStoreFull, OSError, ValueError) as e:
        print(f"error: sync of {args.partition} to {to} stopped: {e}", file=sys.stderr)
        return EXIT_NOT_ALL_COPIED
    finally:
        store.close()
    for line in counts.failed:
        print(f"not copied: {line}", file=sys.stderr)
    print(counts.line(args.partition, to))
    return EXIT_NOT_ALL_COPIED if counts.failed else EXIT_OK
