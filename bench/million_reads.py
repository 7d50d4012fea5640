"""The reads of a 1,000,000-job partition: ``status``, ``events``, the API's and the metrics'.

    python bench/million_reads.py                     # SQLite, 1,000,000 jobs
    python bench/million_reads.py --jobs 100000
    python bench/million_reads.py --db-url postgresql+psycopg://postgres@127.0.0.1:5432/bench_million

Fills a fresh store directly in SQL (not through rendering): ``--jobs`` jobs in one
partition, half of them succeeded (an attempt, a file and three events each), 8
rendering on 8 servers, 100 dead letters, 1,000 claimed by a live owner and the rest
pending (one event each), plus one small partition of 10 jobs; then times, each once
after one warm-up call, what a user's command or a scrape asks of the store, printing
``<what>_s=<seconds>`` lines and ``fill_s`` (``metrics_first_s``: a process's first
scrape, which waits a moment for the attempts' counts; ``metrics_s``: the next one;
``metrics_read_s``: one after that read ended; ``attempt_counts_s``: that read;
``events_partition``: ``events --partition`` without ``--shot``). Target: each
under 1 s on this kind of machine. ``--reuse`` times what an earlier run left in ``--db-url``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from comfy_assets.cli.events import DEFAULT_LIMIT, EARLIER_COUNTED
from comfy_assets.cli.status import gather
from comfy_assets.metrics import Metrics
from comfy_assets.store import Store, metadata

PARTITION = "million"
SERVERS = 8
DEAD = 100
CLAIMED = 1000
OWNER = "bench-owner"


def job_id(i: int) -> str:
    return str(uuid.UUID(int=i + 1))


def empty_and_fill(store: Store, jobs: int) -> None:
    """Empty ``store``'s tables (a PostgreSQL database is kept between runs, its ids
    started again) and ``fill`` it with ``jobs`` jobs."""
    if store.dialect == "postgresql":
        with store.engine.begin() as conn:
            names = ", ".join(t.name for t in metadata.sorted_tables)
            conn.execute(sa.text(f"TRUNCATE {names} RESTART IDENTITY"))
    fill(store, jobs)


def fill(store: Store, jobs: int) -> None:
    """``jobs`` jobs in ``PARTITION`` and 10 in ``small``, with their events, attempts and
    files, written in SQL (``generate_series`` on PostgreSQL, a recursive CTE on SQLite)."""
    done = jobs // 2
    pg = store.dialect == "postgresql"
    series = (
        "SELECT g AS i FROM generate_series(0, :n - 1) AS g"
        if pg
        else "WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < :n - 1) "
        "SELECT i FROM s"
    )
    uid = (
        "lpad(to_hex(i + 1), 32, '0')"
        if pg
        else "substr('00000000000000000000000000000000' || printf('%x', i + 1), -32)"
    )
    # A UUID's text: 8-4-4-4-12 hex digits.
    dashed = (
        f"substr({uid}, 1, 8) || '-' || substr({uid}, 9, 4) || '-' || substr({uid}, 13, 4)"
        f" || '-' || substr({uid}, 17, 4) || '-' || substr({uid}, 21, 12)"
    )
    state = (
        f"CASE WHEN i < {done} THEN 'succeeded' WHEN i < {done + SERVERS} THEN 'rendering' "
        f"WHEN i < {done + SERVERS + DEAD} THEN 'failed_fatal' ELSE 'pending' END"
    )
    claimed = f"CASE WHEN i >= {done} AND i < {done + SERVERS + CLAIMED} THEN '{OWNER}#1' END"
    server = f"CASE WHEN i >= {done} AND i < {done + SERVERS} THEN 'gpu' || (i - {done}) END"
    with store.engine.begin() as conn:
        if not pg:
            conn.exec_driver_sql("PRAGMA foreign_keys = OFF")
        for name, n, part in ((PARTITION, jobs, PARTITION), ("small", 10, "small")):
            offset = 0 if name == PARTITION else jobs
            conn.execute(
                sa.text(
                    "INSERT INTO comfy_jobs (job_id, partition, line, prompt_id, shot, optional,"
                    " duration_s, set_json, take, state, attempts, attempts_before, server,"
                    " reason, claimed_by, claim_expires_at, created_at, updated_at,"
                    " finished_at, seconds) "
                    f"SELECT {dashed.replace('i + 1', f'i + 1 + {offset}')}, :p, i + 1,"
                    f" {dashed.replace('i + 1', f'i + 7000001 + {offset}')}, NULL, false, NULL,"
                    f" '{{}}', 1, {state}, CASE WHEN i < {done} THEN 1 ELSE 0 END, 0, {server},"
                    f" CASE WHEN i >= {done + SERVERS} AND i < {done + SERVERS + DEAD}"
                    f" THEN 'bench: dead' END, {claimed}, CASE WHEN {claimed} IS NOT NULL"
                    " THEN 1e12 END, 1000.0, 1000.0 + i, CASE WHEN i < "
                    f"{done} THEN 1000.0 + i END, CASE WHEN i < {done} THEN 1.0 END FROM ({series}) AS s"
                ),
                {"n": n, "p": part},
            )
        conn.execute(
            sa.text(
                "INSERT INTO comfy_events (time, job_id, partition, from_state, to_state, server,"
                " attempt, detail) SELECT created_at, job_id, partition, NULL, 'pending', NULL,"
                " NULL, 'registered' FROM comfy_jobs"
            )
        )
        for to_state, from_state in (
            ("submitted", "pending"),
            ("rendering", "submitted"),
            ("succeeded", "rendering"),
        ):
            conn.execute(
                sa.text(
                    "INSERT INTO comfy_events (time, job_id, partition, from_state, to_state,"
                    " server, attempt, detail) SELECT updated_at, job_id, partition, :f, :t,"
                    " 'gpu0', 1, NULL FROM comfy_jobs WHERE state = 'succeeded'"
                ),
                {"f": from_state, "t": to_state},
            )
        conn.execute(
            sa.text(
                "INSERT INTO comfy_attempts (job_id, attempt, server, prompt_id, number,"
                " started_at, ended_at, seconds, queue_wait_s, gpu_seconds, outcome, reason)"
                " SELECT job_id, 1, 'gpu' || (line % 8), prompt_id, line, updated_at - 1,"
                " updated_at, 1.0, 0.0, 1.0, 'success', NULL FROM comfy_jobs"
                " WHERE state = 'succeeded'"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO comfy_files (job_id, path, prompt_id, sha256, bytes, node_id, key)"
                " SELECT job_id, 'image_00001_.png', prompt_id, :sha, 1000, '9', 'images'"
                " FROM comfy_jobs WHERE state = 'succeeded'"
            ),
            {"sha": "ab" * 32},
        )
    store.register_owner(OWNER, host="bench", pid=1)
    if pg:
        with store.engine.connect() as conn:
            # What autovacuum does after such inserts: the visibility map lets a count
            # be an index-only scan.
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE")
    else:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")


def partition_events(store: Store, before: int | None) -> int:
    """What ``events --partition PARTITION [--before ID]`` reads: the latest
    ``DEFAULT_LIMIT`` events, and the count of the earlier ones (up to
    ``EARLIER_COUNTED`` + 1); that count."""
    events = store.events(partition=PARTITION, limit=DEFAULT_LIMIT, before=before)
    if not events:
        return 0
    return store.count_events(partition=PARTITION, before=events[0].id, at_most=EARLIER_COUNTED + 1)


def timed(name: str, call: Callable[[], Any], *, warm: bool = True) -> None:
    """Print ``<name>_s``: the seconds of one ``call``, after one warm-up call (``warm``)."""
    if warm:
        call()
    started = time.perf_counter()
    call()
    print(f"{name}_s={time.perf_counter() - started:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000, help="jobs of the partition")
    parser.add_argument("--db-url", help="a scratch PostgreSQL database (emptied first)")
    parser.add_argument(
        "--reuse", action="store_true", help="with --db-url: time the jobs a run left there"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-million-") as tmp:
        store = Store(Path(tmp), args.db_url)
        started = time.perf_counter()
        if not (args.reuse and args.db_url):
            empty_and_fill(store, args.jobs)
        print(f"backend={store.dialect}")
        print(f"jobs={args.jobs}")
        print(f"fill_s={time.perf_counter() - started:.1f}", flush=True)
        some = job_id(args.jobs // 4)  # a succeeded job
        metrics = Metrics()
        metrics.track_store(store, PARTITION)
        timed("status", lambda: gather(store))
        timed("status_partition", lambda: gather(store, PARTITION))
        timed("events_job", lambda: store.events(job_id=some))
        timed("events_shot", lambda: store.events(partition=PARTITION, shot=17))
        # ``events --partition P``: the latest DEFAULT_LIMIT, and how many came before.
        timed("events_partition", lambda: partition_events(store, None))
        # ``--before ID`` from the middle of the partition's events: the page before.
        ids = [e.id or 0 for e in store.events(partition=PARTITION, limit=1)]
        timed("events_partition_before", lambda: partition_events(store, sum(ids) // 2))
        timed("api_job", lambda: (store.get(some), store.files(some), store.events(some)))
        timed("api_servers", lambda: (store.server_leases(), store.server_health()))
        # The first scrape waits SLOW_READ_S for the attempts' counts read aside; the next
        # ones answer from the last read while it is read again aside (``_Lagging``).
        timed("metrics_first", lambda: list(metrics.collect()), warm=False)
        timed("metrics", lambda: list(metrics.collect()), warm=False)
        for lagging in list(metrics._tries.values()):
            reading = lagging._thread
            if reading is not None:
                reading.join()
        # A scrape once the first read of the attempts ended: the counts it answers.
        timed("metrics_read", lambda: list(metrics.collect()), warm=False)
        timed("attempt_counts", lambda: store.attempt_outcome_counts([PARTITION]))
        timed("counts", lambda: store.counts(PARTITION))
        store.close()


if __name__ == "__main__":
    main()
