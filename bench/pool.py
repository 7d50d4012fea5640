"""Pool utilization and the gap between prompts: 400 jobs on 8 fake servers.

Run: `python bench/pool.py [--jobs 400] [--servers 8] [--prompt-ms 250] [--db-url URL]`.
Prints `name=value` lines measured from the fake servers' own records.
Targets (on a 2-core machine; docs/performance.md): utilization >= 0.97, gap_ms_median <= 10.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes, fake_runs, utilization_and_gaps, write_jobs
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.run import run_batch
from comfy_assets.store import Store

NODES_EXECUTED = 4  # the fake sleeps --prompt-seconds per executed node of image.json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--prompt-ms", type=float, default=250.0)
    ap.add_argument("--db-url", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        job_file = load_job_file(write_jobs(root / "jobs", args.jobs))
        store = Store(root / "store", args.db_url)
        per_node = args.prompt_ms / 1000 / NODES_EXECUTED
        with fake_processes(args.servers, per_node, root) as specs:
            config = BatchConfig(poll_s=1.0, base_delay_s=0.1)
            t0 = time.monotonic()
            summary = asyncio.run(
                run_batch(
                    job_file,
                    partition="bench",
                    servers=specs,
                    store=store,
                    config=config,
                    on_line=lambda line: None,
                )
            )
            wall = time.monotonic() - t0
            figures = utilization_and_gaps(fake_runs(specs))
    print(f"jobs={args.jobs}")
    print(f"servers={args.servers}")
    print(f"prompt_ms={args.prompt_ms:g}")
    print(f"store={'postgresql' if args.db_url else 'sqlite'}")
    print(f"done={summary.done}")
    print(f"wall_s={wall:.2f}")
    for name, value in figures.items():
        print(f"{name}={value:.4f}" if name == "utilization" else f"{name}={value:.2f}")


if __name__ == "__main__":
    main()
