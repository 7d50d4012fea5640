"""Jobs per second and peak memory, end to end: a large job file, many fakes, no GPU time.

Run:
    python bench/throughput.py                        # 2,000 then 10,000 jobs, 16 servers
    python bench/throughput.py --jobs 10000 --servers 16
    python bench/throughput.py --db-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres

The fake servers are separate processes started with ``--prompt-seconds 0``: every second
measured is ours (job file, store, pool, HTTP, socket, downloads) or the fakes' own HTTP
work, on the same 2 cores. End to end = ``load_job_file`` + ``run_batch`` (registration,
every job claimed, posted, followed, downloaded and recorded, the summary) until it
returns.

With ``--db-url`` the store is on PostgreSQL: the bench creates a scratch database on that
server (the URL's database is only used to connect) and drops it at the end, so every run
starts from the same empty tables. Default: SQLite in a temporary folder.

Without ``--jobs`` each size of ``--sizes`` runs in a fresh process (peak RSS only grows
within a process) and the scaling lines compare them.

Prints ``name=value`` lines. Memory: ``peak_rss_mb`` is ``getrusage(RUSAGE_SELF)`` of the
process that ran the batch: **the fake servers (children) are not included**;
``fake_peak_rss_mb`` is ``getrusage(RUSAGE_CHILDREN)`` after they exited, which is the
largest single fake, not their sum.
Targets (on a 2-core machine; docs/performance.md): jobs_per_s >= 300, peak_rss_mb <= 300.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    fake_processes,
    fake_requests,
    fake_runs,
    fakes_cpu_s,
    scratch_dir,
    write_jobs,
)
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.run import run_batch
from comfy_assets.store import Store

TARGET_JOBS_PER_S = 300.0
TARGET_RSS_MB = 300.0


@contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database on the server of ``server_url``, dropped at the end."""
    import sqlalchemy as sa

    url = sa.make_url(server_url)
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"comfy_assets_bench_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def store_url(db_url: str | None) -> Iterator[str | None]:
    if db_url is None:
        yield None
    else:
        with scratch_database(db_url) as url:
            yield url


def mb(kilobytes: int) -> float:
    return kilobytes / 1024  # Linux ru_maxrss is in KiB


def one_size(args: argparse.Namespace) -> None:
    """Run ``args.jobs`` jobs in this process and print the figures."""
    logging.basicConfig(level=logging.WARNING)
    # Our structured JSON event lines (one per state change) go to the log at INFO: a
    # deployment keeps them, the bench drops them with WARNING like bench/pool.py.
    with tempfile.TemporaryDirectory() as tmp, store_url(args.db_url) as url:
        root = Path(tmp)
        path = write_jobs(root / "jobs", args.jobs)
        store = Store(root / "store", url)
        before = resource.getrusage(resource.RUSAGE_SELF)
        rss_before_mb = mb(before.ru_maxrss)
        cpu_before = before.ru_utime + before.ru_stime
        fakes_out = scratch_dir()
        with fake_processes(args.servers, 0.0, fakes_out) as specs:
            config = BatchConfig(poll_s=1.0, base_delay_s=0.1)
            fakes_cpu_before = fakes_cpu_s()
            t0 = time.perf_counter()
            job_file = load_job_file(path)
            t1 = time.perf_counter()
            summary = asyncio.run(
                run_batch(
                    job_file,
                    partition="throughput",
                    servers=specs,
                    store=store,
                    config=config,
                    on_line=lambda line: None,
                )
            )
            wall = time.perf_counter() - t0
            fakes_cpu = fakes_cpu_s() - fakes_cpu_before
            runs = fake_runs(specs)
            requests = fake_requests(specs)
        shutil.rmtree(fakes_out)
        store.close()
    executed = sum(len(r) for r in runs.values())
    busiest = max(len(r) for r in runs.values())
    idlest = min(len(r) for r in runs.values())
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    self_mb = mb(me.ru_maxrss)
    children_mb = mb(kids.ru_maxrss)
    jobs_per_s = args.jobs / wall
    print(f"jobs={args.jobs}")
    print(f"servers={args.servers}")
    print(f"store={'postgresql' if args.db_url else 'sqlite'}")
    print(f"done={summary.done}")
    print(f"executed={executed}")
    print(f"prompts_per_server_min={idlest}")
    print(f"prompts_per_server_max={busiest}")
    print("prompts_per_server=" + ",".join(str(len(r)) for r in runs.values()))
    print(f"load_s={t1 - t0:.3f}")
    print(f"wall_s={wall:.2f}")
    print(f"jobs_per_s={jobs_per_s:.1f}")
    print(f"us_per_job={wall / args.jobs * 1e6:.0f}")
    # Where the 2 cores went: this process (the batch) and the fake servers.
    print(f"cpu_s_batch_process={me.ru_utime + me.ru_stime - cpu_before:.2f}")
    print(f"cpu_s_fakes={kids.ru_utime + kids.ru_stime:.2f}")  # their start included
    print(f"cpu_ms_per_job_fakes={fakes_cpu / args.jobs * 1000:.2f}")  # while the batch ran
    print(
        f"cpu_ms_per_job_batch_process={(me.ru_utime + me.ru_stime - cpu_before) / args.jobs * 1000:.2f}"
    )
    for route, n in sorted(requests.items()):  # e.g. requests_per_job_GET_/view=2.000
        print(f"requests_per_job_{route.replace(' ', '_')}={n / args.jobs:.3f}")
    print(f"rss_at_start_mb={rss_before_mb:.1f}")
    print(f"peak_rss_mb={self_mb:.1f}")
    print("peak_rss_includes_children=no")
    print(f"fake_peak_rss_mb={children_mb:.1f}")
    print(f"meets_jobs_per_s_target={'yes' if jobs_per_s >= TARGET_JOBS_PER_S else 'no'}")
    print(f"meets_rss_target={'yes' if self_mb <= TARGET_RSS_MB else 'no'}")
    if summary.done != args.jobs or executed != args.jobs:
        print(f"error=expected {args.jobs} jobs done and executed once each", file=sys.stderr)
        sys.exit(1)


def parse_figures(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def several_sizes(args: argparse.Namespace) -> None:
    """Each size in a fresh process; then how time and memory grew with the size."""
    sizes = [int(s) for s in args.sizes.split(",")]
    figures = {}
    for size in sizes:
        cmd = [sys.executable, __file__, "--jobs", str(size), "--servers", str(args.servers)]
        if args.db_url:
            cmd += ["--db-url", args.db_url]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            sys.exit(done.returncode)
        figures[size] = parse_figures(done.stdout)
        for line in done.stdout.splitlines():
            print(f"jobs{size}_{line}" if not line.startswith("jobs=") else line)
    small, large = sizes[0], sizes[-1]
    fs, fl = figures[small], figures[large]
    # Linear: the time per job stays put and memory grows by a fixed amount per job.
    print(f"scaling_jobs_ratio={large / small:.2f}")
    print(f"scaling_wall_ratio={float(fl['wall_s']) / float(fs['wall_s']):.2f}")
    print(f"scaling_us_per_job_ratio={float(fl['us_per_job']) / float(fs['us_per_job']):.2f}")
    grown = float(fl["peak_rss_mb"]) - float(fs["peak_rss_mb"])
    print(f"scaling_rss_growth_mb={grown:.1f}")
    print(f"scaling_rss_kb_per_extra_job={grown * 1024 / (large - small):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=None, help="one size, in this process")
    ap.add_argument("--sizes", default="2000,10000", help="without --jobs (2000,10000)")
    ap.add_argument("--servers", type=int, default=16)
    ap.add_argument("--db-url", default=None, help="PostgreSQL server to make a scratch db on")
    args = ap.parse_args()
    if args.jobs is None:
        several_sizes(args)
    else:
        one_size(args)


if __name__ == "__main__":
    main()
