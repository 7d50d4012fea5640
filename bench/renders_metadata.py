"""The metadata of a 1,000,000-job partition of ``renders``: its time, peak RSS and size.

    python bench/renders_metadata.py                    # SQLite, 1,000,000 jobs, both ways
    python bench/renders_metadata.py --jobs 100000 --ways paged
    python bench/renders_metadata.py --db-url postgresql+psycopg://postgres@127.0.0.1:5432/bench_meta

Fills a fresh store as ``bench/million_reads.py`` does (half the jobs succeeded with one
picture each, 8 rendering, 100 dead letters, the rest pending) and writes the pictures
of the first ``SHEET_TILES`` done jobs; then, each in a process of its own, builds what
``renders`` shows after its batch (``farm/assets.py: render_partition``): the job table,
the contact sheet, the servers table, the dead letters' check table and the data
version. ``paged`` is the way it does now (``farm/partition_view.py: read_view``, the
store read a page at a time); ``whole`` the way it did at 938a8a1 (every record, file,
failed attempt and model try read at once, every done job's files asked one job at a
time for the contact sheet, a table frame of every job). Prints per way
``<way>_s`` (the build), ``<way>_peak_rss_mb`` (the process's, imports included),
``<way>_rss_before_mb`` (after the imports), ``<way>_metadata_bytes`` (the
materialization's metadata as Dagster serializes it into the event log) and
``<way>_data_version``.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WAYS = ("whole", "paged")


def rss_mb() -> float:
    """The process's peak resident set so far, MB (Linux gives KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def file_ids(jobs: int) -> Any:
    """The partition's job ids in line order, as a scanned job file holds them."""
    from bench.million_reads import job_id
    from comfy_assets.jobs.stream import JobIds

    ids = bytearray(16 * jobs)  # not a list of a million bytes: the peak is the build's
    for i in range(jobs):
        ids[16 * i : 16 * i + 16] = uuid.UUID(job_id(i)).bytes
    return JobIds(bytes(ids))


def write_pictures(store: Any, partition: str, count: int) -> None:
    """A 32 px picture for each of the first ``count`` succeeded jobs' one output."""
    from PIL import Image

    from bench.million_reads import job_id

    for i in range(count):
        (record,) = store.files(job_id(i))
        path = store.file_store.output_path(partition, record.job_id, record)
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 32), (i * 4 % 256, 80, 160)).save(path)


def whole(store: Any, partition: str, job_ids: Any) -> dict[str, Any]:
    """What render_partition read and built at 938a8a1 (its sheet's loop too)."""
    from comfy_assets.farm.metadata import PICTURE_SUFFIXES, job_frame, node_order
    from comfy_assets.jobs.states import DONE
    from comfy_assets.render.results import JobResults, last_model_tries

    in_file = set(job_ids)
    current = [r for r in store.jobs(partition) if r.job_id in in_file]
    outputs = store.partition_files(partition)
    tries = [t for t in store.model_loads(partition) if t.job_id in in_file]
    failed_on = store.failed_on(partition)
    done = sorted(
        (r for r in current if r.state in DONE), key=lambda r: (r.shot is None, r.shot or 0, r.line)
    )
    picks, pictures, jobs = [], 0, 0
    from comfy_assets.farm import metadata

    for record in done:
        files = [
            f for f in store.files(record.job_id) if Path(f.path).suffix.lower() in PICTURE_SUFFIXES
        ]
        files.sort(key=lambda f: (node_order(f.node_id), f.path))
        pictures += len(files)
        jobs += 1 if files else 0
        if files and len(picks) < metadata.SHEET_TILES:
            picks.append((record, files))
    digest = hashlib.sha256()
    for record in sorted(current, key=lambda r: r.job_id):
        digest.update(f"{record.job_id} {record.prompt_id} {record.state}\n".encode())
        for file in outputs.get(record.job_id, []):
            digest.update(f"  {file.path} {file.sha256}\n".encode())
    servers: dict[str, int] = {}
    for record in current:
        if record.state in DONE and record.server:
            servers[record.server] = servers.get(record.server, 0) + 1
    frame = job_frame(JobResults.of(current, outputs, job_ids, last_model_tries(tries), failed_on))
    return {
        "frame": frame,
        "sheet": (picks, pictures, jobs),
        "servers": servers,
        "data_version": digest.hexdigest(),
        "shown": None,
    }


def paged(store: Any, partition: str, job_ids: Any) -> dict[str, Any]:
    """What render_partition reads and builds now (``read_view``)."""
    from comfy_assets.farm.metadata import job_frame
    from comfy_assets.farm.partition_view import read_view
    from comfy_assets.render.results import results_key
    from comfy_assets.store.files.local import file_location

    view = read_view(store, partition, job_ids, store.counts(partition))
    where = file_location(store.file_store, results_key(partition), resolved=True)
    return {
        "frame": job_frame(view.rows),
        "sheet": (view.sheet, view.outputs, view.output_jobs),
        "servers": view.done_by_server,
        "data_version": view.data_version,
        "shown": view.shown_line(where) if view.cut() else None,
    }


def child(way: str, folder: Path, db_url: str | None, jobs: int, partition: str) -> None:
    """Build the metadata one ``way`` in this process and print its figures."""
    from dagster import AssetMaterialization, MetadataValue
    from dagster._serdes import serialize_value

    from comfy_assets.farm.metadata import (
        JOB_COLUMNS,
        column_schema,
        job_table,
        outputs_contact_sheet,
        servers_metadata,
        stored_picture,
        table,
    )
    from comfy_assets.store import Store

    job_ids = file_ids(jobs)
    store = Store(folder, db_url)
    before = rss_mb()
    started = time.perf_counter()
    built = (whole if way == "whole" else paged)(store, partition, job_ids)
    sheet = outputs_contact_sheet(store, partition, *built["sheet"])
    assert sheet is not None
    frame = built["frame"]
    dead = frame[frame["state"] == "failed_fatal"][["job", "reason", "job_id"]]
    metadata: dict[str, Any] = {
        "contact_sheet": MetadataValue.md(
            stored_picture(store.file_store, sheet.key, sheet.caption(), 480, None)
        ),
        "pictures": sheet.caption(),
        "counts": MetadataValue.json(store.counts(partition)),
        "job_table": job_table(frame),
        **servers_metadata([f"gpu{i}" for i in range(8)], built["servers"], {}),
        "dead_letters": table(dead, column_schema(dead, JOB_COLUMNS)),
    }
    if built["shown"]:
        metadata["job_table_shown"] = built["shown"]
    size = len(
        serialize_value(AssetMaterialization("renders", partition=partition, metadata=metadata))
    )
    seconds = time.perf_counter() - started
    store.close()
    print(f"{way}_s={seconds:.1f}")
    print(f"{way}_rss_before_mb={before:.0f}")
    print(f"{way}_peak_rss_mb={rss_mb():.0f}")
    print(f"{way}_metadata_bytes={size}")
    print(f"{way}_job_table_rows={len(metadata['job_table'].records)}")
    print(f"{way}_sheet={sheet.caption()}")
    print(f"{way}_data_version={built['data_version']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000, help="jobs of the partition")
    parser.add_argument("--db-url", help="a scratch PostgreSQL database (emptied first)")
    parser.add_argument("--ways", default=",".join(WAYS), help="whole, paged or both")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from bench.million_reads import PARTITION

    if args.child:
        child(args.child, Path(args.folder), args.db_url, args.jobs, PARTITION)
        return
    from bench.million_reads import empty_and_fill
    from comfy_assets.farm.metadata import SHEET_TILES
    from comfy_assets.store import Store

    with tempfile.TemporaryDirectory(prefix="bench-renders-metadata-") as tmp:
        store = Store(Path(tmp), args.db_url)
        started = time.perf_counter()
        empty_and_fill(store, args.jobs)
        write_pictures(store, PARTITION, SHEET_TILES)
        store.close()
        print(f"backend={store.dialect}")
        print(f"jobs={args.jobs}")
        print(f"fill_s={time.perf_counter() - started:.1f}", flush=True)
        for way in args.ways.split(","):
            command = [sys.executable, __file__, "--child", way, "--folder", tmp]
            command += ["--jobs", str(args.jobs)]
            command += ["--db-url", args.db_url] if args.db_url else []
            subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
