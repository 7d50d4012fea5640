"""A results.csv write of a 1,000,000-job partition: time and peak RSS, before and after
results.csv was built from segments.

    python bench/results.py                     # SQLite, 1,000,000 jobs
    python bench/results.py --jobs 100000
    python bench/results.py --db-url postgresql+psycopg://postgres@127.0.0.1:5432/bench_results

Fills a fresh store as ``bench/million_reads.py`` does (half the jobs succeeded with a
file, the rest pending, dead or rendering), then runs each write in a process of its own
(its peak RSS its own) and prints ``<write>_s`` and ``<write>_rss_mb`` lines:
``whole`` (the table read whole and written, as every write was before segments),
``first`` (a first write from segments: every segment read), ``changed`` (after 1,000
jobs in line order moved on: the segments holding them read again), ``unchanged``
(nothing changed: the file joined again from the segments, nothing read) and
``whole_changed`` (the whole-table write after the same change).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sqlalchemy as sa

from comfy_assets.store import Store

PARTITION = "million"
CHANGED = 1_000


def write(kind: str, folder: str, db_url: str | None) -> None:
    """One write of ``kind`` in this process; prints its seconds and peak RSS."""
    from comfy_assets.render.results import JobResults, results_key, write_results, write_table

    with Store(Path(folder), db_url) as store:
        started = time.perf_counter()
        if kind.startswith("whole"):
            table = JobResults.read(store, PARTITION).table()
            write_table(store.file_store, results_key(PARTITION), table)
        else:
            write_results(store, PARTITION, sample=False)
        took = time.perf_counter() - started
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{kind}_s={took:.2f}")
    print(f"{kind}_rss_mb={rss_mb:.0f}", flush=True)


def change(store: Store, jobs: int) -> None:
    """``CHANGED`` pending jobs in line order from the middle of the partition succeed,
    each with a file, at the database's time now."""
    first = jobs // 2 + 1_000
    now = store.now()
    with store.engine.begin() as conn:
        ids = [
            r.job_id
            for r in conn.execute(
                sa.text(
                    "SELECT job_id FROM comfy_jobs WHERE partition = :p AND line >= :a"
                    " AND line < :b"
                ),
                {"p": PARTITION, "a": first, "b": first + CHANGED},
            )
        ]
        conn.execute(
            sa.text(
                "UPDATE comfy_jobs SET state = 'succeeded', attempts = 1, updated_at = :now,"
                " finished_at = :now, seconds = 1.0, claimed_by = NULL"
                " WHERE partition = :p AND line >= :a AND line < :b"
            ),
            {"now": now, "p": PARTITION, "a": first, "b": first + CHANGED},
        )
        conn.execute(
            sa.text(
                "INSERT INTO comfy_files (job_id, path, prompt_id, sha256, bytes, node_id, key)"
                " VALUES (:j, 'image_00001_.png', 'p', :sha, 1000, '9', 'images')"
            ),
            [{"j": i, "sha": "cd" * 32} for i in ids],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000, help="jobs of the partition")
    parser.add_argument("--db-url", help="a scratch PostgreSQL database (emptied first)")
    parser.add_argument("--write", help=argparse.SUPPRESS)  # one write, in a process of its own
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        write(args.write, args.folder, args.db_url)
        return
    from million_reads import empty_and_fill

    with tempfile.TemporaryDirectory(prefix="bench-results-") as tmp:
        store = Store(Path(tmp), args.db_url)
        started = time.perf_counter()
        empty_and_fill(store, args.jobs)
        print(f"backend={store.dialect}")
        print(f"jobs={args.jobs}")
        print(f"fill_s={time.perf_counter() - started:.1f}", flush=True)

        def run(kind: str) -> None:
            command = [sys.executable, __file__, "--write", kind, "--folder", tmp]
            if args.db_url:
                command += ["--db-url", args.db_url]
            subprocess.run(command, check=True)

        run("whole")
        run("first")
        change(store, args.jobs)
        run("changed")
        run("unchanged")
        run("whole_changed")
        size = (Path(tmp) / PARTITION / "results.csv").stat().st_size
        print(f"results_csv_mb={size / 1e6:.0f}")
        store.close()


if __name__ == "__main__":
    main()
