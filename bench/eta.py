"""The estimate of the time left (``render/eta.py``): its error at 25%, 50% and 75% done.

Run: `python bench/eta.py [--jobs 60] [--servers 2] [--prompt-s 0.1] [--load-s 1.0]`.

Fakes started as processes with `--models m0.safetensors,m1.safetensors,m2.safetensors
--model-load-s LOAD --resident 1`; text-to-image jobs (data/workflows/text_to_image.json),
each its own seed, through ``run_batch`` with an ``on_progress`` that notes each
progress's estimate and when it came. Once the batch is over, the error at a fraction
done is ``|estimate - actual| / actual``, ``actual`` the seconds from that progress to
the batch's end, taken at the first progress with at least that fraction of the jobs
ended. Two batches, each on fakes started afresh:

1. homogeneous: every job the same checkpoint (`homogeneous_error_25`, `_50`, `_75`);
2. mixed-model: three checkpoints in a shuffled order (a fixed seed), each server holding
   one at a time, so loads happen through the batch (`mixed_error_25`, `_50`, `_75`).

The target is an error within 0.25 at 50% done. Prints `name=value` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes, scratch_dir
from bench.models import NODES_EXECUTED, model_names, write_model_jobs
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.progress import Progress
from comfy_assets.render.run import run_batch
from comfy_assets.store import Store

FRACTIONS = (0.25, 0.5, 0.75)


def errors(seen: list[tuple[float, Progress]], end: float) -> dict[float, float | None]:
    """The estimate's relative error at each of ``FRACTIONS`` (None: no estimate then)."""
    out: dict[float, float | None] = {}
    for fraction in FRACTIONS:
        out[fraction] = None
        for at, p in seen:
            if p.ended >= fraction * p.total and p.estimate_s is not None:
                actual = end - at
                out[fraction] = abs(p.estimate_s - actual) / actual if actual > 0 else None
                break
    return out


async def one_batch(jobs: Path, servers: int, prompt_s: float, load_s: float) -> dict:
    """Run the batch of ``jobs`` on fresh fakes; the errors at each fraction."""
    node_s = prompt_s / NODES_EXECUTED
    models = ",".join(model_names(3))
    extra = [["--models", models, "--model-load-s", str(load_s), "--resident", "1"]] * servers
    out = scratch_dir()
    seen: list[tuple[float, Progress]] = []
    try:
        with fake_processes(servers, node_s, out, extra) as specs:
            with tempfile.TemporaryDirectory() as store_dir:
                await run_batch(
                    load_job_file(jobs),
                    partition="bench",
                    servers=specs,
                    store=Store(Path(store_dir)),
                    config=BatchConfig(poll_s=1.0, base_delay_s=0.1),
                    on_line=lambda line: None,
                    on_progress=lambda p: seen.append((time.monotonic(), p)),
                )
                end = time.monotonic()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return errors(seen, end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--prompt-s", type=float, default=0.1)
    parser.add_argument("--load-s", type=float, default=1.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = Path(tempfile.mkdtemp(prefix="bench-eta-"))
    try:
        names = model_names(3)
        homogeneous = write_model_jobs(folder / "h", [names[0]] * args.jobs)
        mixed = [names[i % 3] for i in range(args.jobs)]
        random.Random(7).shuffle(mixed)
        mixed_file = write_model_jobs(folder / "m", mixed)
        for label, path in (("homogeneous", homogeneous), ("mixed", mixed_file)):
            found = asyncio.run(one_batch(path, args.servers, args.prompt_s, args.load_s))
            for fraction, error in found.items():
                shown = "none" if error is None else f"{error:.3f}"
                print(f"{label}_error_{int(fraction * 100)}={shown}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
