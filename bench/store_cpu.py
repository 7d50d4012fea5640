"""CPU per job with the S3 store against the folder store, side by side in one run.

Run:
    python bench/store_cpu.py                     # 100 and 500 jobs a side, 3 times
    python bench/store_cpu.py --small 100 --large 500 --repeat 3

Each side is a process of its own running one batch (``run_batch``, as ``comfy-assets
run`` does) of image jobs on its own fake (a separate process, no GPU time), its records
in SQLite in a folder of its own; the sides differ only in their files: ``folder``
writes each output under the store's folder, ``s3`` streams each output to a SeaweedFS
(``weed mini``, signatures checked; started by the bench on free ports) by its sha256
with a create-only PUT and confirms it before the done record. The two sides take turns,
``--small`` then ``--large`` jobs, ``--repeat`` times, every prompt of another colour (no
output stored twice). A process's CPU comes from ``wait4`` (user + system), start-up
included; the **marginal** CPU per job is (cpu(large) - cpu(small)) / (large - small) of
the medians of the repeats, which leaves start-up out.

Prints ``cpu_ms_per_job_folder``, ``cpu_ms_per_job_s3``, ``ratio`` (s3 / folder; the
issue's target: 1.3 at most), the medians ``cpu_s_*`` and ``wall_s_*`` of each side and
size, and ``weed_cpu_ms_per_job``: the SeaweedFS process's own CPU per job of the s3
side (the store's server, not the worker's cost; /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes, scratch_dir
from bench.farm import cpu_s, weed_pid
from bench.overhead import job_file, timed
from tests import s3_server

ACCESS_KEY = "bench-key"
SIDES = ("folder", "s3")


async def _child(side: str, url: str, jobs: Path, work: Path, location: str) -> None:
    """One batch of ``jobs`` on ``url`` (the child process's whole work)."""
    from comfy_assets.comfy.servers import ServerSpec
    from comfy_assets.jobs.parse import load_job_file
    from comfy_assets.render.config import BatchConfig
    from comfy_assets.render.run import run_batch
    from comfy_assets.store import Store
    from comfy_assets.store.files import file_store_for

    files = file_store_for(location if side == "s3" else work / "store")
    store = Store(work / "store", file_store=files)
    files.check()
    summary = await run_batch(
        load_job_file(jobs),
        partition="p",
        servers=[ServerSpec("gpu0", url)],
        store=store,
        config=BatchConfig(),
    )
    store.close()
    count = len(load_job_file(jobs).jobs)
    if summary.done != count:
        raise SystemExit(f"{side}: {summary.done} of {count} jobs done")


def side_run(
    side: str, url: str, jobs: Path, work: Path, location: str, env: dict[str, str]
) -> tuple[float, float]:
    """(cpu s, wall s) of a child process running ``side``'s batch."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    argv = [sys.executable, __file__, "--child", side, url, str(jobs), str(work), location]
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return timed(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        side, url, jobs, work, location = sys.argv[2:]
        asyncio.run(_child(side, url, Path(jobs), Path(work), location))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=100, help="jobs of the first run (100)")
    parser.add_argument("--large", type=int, default=500, help="jobs of the second run (500)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side and size (3)")
    args = parser.parse_args()
    if args.large <= args.small:
        parser.error("--large must be more than --small")
    work = Path(tempfile.mkdtemp(prefix="bench-store-cpu-"))
    out = scratch_dir()
    secret = uuid.uuid4().hex
    figures: dict[str, float] = {}
    weed_cpu = 0.0
    try:
        with (
            s3_server.seaweedfs(work / "seaweedfs", ACCESS_KEY, secret) as s3,
            fake_processes(2, 0.0, out) as fakes,
        ):
            bucket = "bench"
            s3.create_bucket(bucket)
            weed = weed_pid(int(s3.endpoint.rsplit(":", 1)[1]))
            env = {
                "AWS_ENDPOINT_URL": s3.endpoint,
                "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": secret,
            }
            runs: dict[str, list[float]] = {}
            offset = 0
            for n in range(args.repeat):
                for size in (args.small, args.large):
                    for side, fake in zip(SIDES, fakes, strict=True):
                        jobs = job_file(work / f"jobs-{side}-{size}", size, offset)
                        location = f"s3://{bucket}/run{n}-{size}"
                        before = cpu_s(weed)
                        cpu, wall = side_run(side, fake.url, jobs, work / side, location, env)
                        if side == "s3" and size == args.large:
                            weed_cpu += cpu_s(weed) - before
                        runs.setdefault(f"cpu_s_{side}_{size}", []).append(cpu)
                        runs.setdefault(f"wall_s_{side}_{size}", []).append(wall)
                    offset += size
        figures.update({key: statistics.median(values) for key, values in runs.items()})
        extra = args.large - args.small
        for side in SIDES:
            marginal = figures[f"cpu_s_{side}_{args.large}"] - figures[f"cpu_s_{side}_{args.small}"]
            figures[f"cpu_ms_per_job_{side}"] = marginal / extra * 1000
        figures["ratio"] = figures["cpu_ms_per_job_s3"] / figures["cpu_ms_per_job_folder"]
        for size in (args.small, args.large):
            figures[f"ratio_whole_{size}"] = (
                figures[f"cpu_s_s3_{size}"] / figures[f"cpu_s_folder_{size}"]
            )
        figures["weed_cpu_ms_per_job"] = weed_cpu / (args.large * args.repeat) * 1000
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    print(f"jobs_small={args.small}")
    print(f"jobs_large={args.large}")
    print(f"repeat={args.repeat}")
    for key, value in figures.items():
        print(f"{key}={value:.3f}")


if __name__ == "__main__":
    main()
