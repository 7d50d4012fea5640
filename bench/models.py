"""Model loads: a batch planned for the fewest loads, against the order the jobs came in.

Run: `python bench/models.py [--jobs 240] [--servers 4] [--models 3] [--prompt-s 0.25]
[--load-s 2] [--skip-fifo]`.

Fakes started with `--models m0.safetensors,... --model-load-s LOAD --resident 1` (each a
process of its own, as real servers are), every server holding every model; a job file of
`--jobs` text-to-image jobs (data/workflows/text_to_image.json), as many per checkpoint, in
a shuffled order (a fixed seed), each its own seed and prompt text. The fake spends
`--prompt-seconds` per node it executes: 4 nodes of a job whose checkpoint the server
holds (the positive prompt's encoding, KSampler, VAEDecode, SaveImage; the loader, the
negative prompt and the latent are cached), so `--prompt-s / 4` per node; a job that
loads a checkpoint runs 2 more (the loader, after `--load-s`, and the negative prompt).

Scenarios, each on fakes started afresh (nothing loaded):

1. the batch in one process, planned (`pool/plan.py`): `makespan_s` (first prompt's start
   to last prompt's end, from the fakes' own records), `model_loads` (the fakes'
   `model_loads`), `lower_bound_s` = (jobs x prompt + max(models, servers) x load) /
   servers, `ratio` = makespan / lower bound (target <= 1.25);
2. the same batch without the plan (`Pool(planned=False)`: the oldest job on any free
   server, the pool's behaviour before the plan): `fifo_makespan_s`, `fifo_model_loads`,
   `fifo_over_planned` (target >= 3);
3. two `comfy-assets run` processes at once sharing the servers and a SQLite store, each
   with half the jobs: `two_process_makespan_s`, `two_process_model_loads`,
   `two_process_loads_over_one` (their loads over scenario 1's, target <= 1.5);
4. a heterogeneous pool, checkpoint i on servers i and i+1 only: `hetero_makespan_s`,
   `hetero_model_loads`, `hetero_ratio` (against the same lower bound).

Prints `name=value` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes, fake_runs, scratch_dir, utilization_and_gaps
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.model import JobFile
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.pool.pool import Pool
from comfy_assets.render.batch import Batch
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.owners import new_owner
from comfy_assets.store import Store

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "data" / "workflows" / "text_to_image.json"
NODES_EXECUTED = 4  # per prompt whose checkpoint the server holds (see the docstring)


def model_names(count: int) -> list[str]:
    return [f"m{i}.safetensors" for i in range(count)]


def write_model_jobs(folder: Path, names: list[str], name: str = "jobs.jsonl") -> Path:
    """A job per checkpoint of ``names`` (in that order), each its own seed and text."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORKFLOW, folder / WORKFLOW.name)
    with (folder / name).open("w") as f:
        for i, model in enumerate(names):
            job = {
                "id": str(uuid.uuid4()),
                "workflow": WORKFLOW.name,
                "set": {
                    "4.ckpt_name": model,
                    "3.seed": i,
                    "6.text": f"shot {i}",
                    "5.width": 64,  # small pictures: the fakes' CPU is not what is measured
                    "5.height": 64,
                },
            }
            f.write(json.dumps(job) + "\n")
    return folder / name


def loads_and_makespan(specs: list[ServerSpec], prefix: str = "") -> tuple[int, float]:
    """Model loads (the fakes' ``model_loads``) and makespan in seconds (first start to
    last end of their runs); prints where the time went (``<prefix>busy_s``: the servers'
    summed run time; ``<prefix>gap_ms_median``; ``<prefix>loads_per_server``)."""
    per_server = []
    for s in specs:
        with urllib.request.urlopen(f"{s.url}/fake/stats") as r:
            per_server.append(sum(len(t) for t in json.load(r)["model_loads"].values()))
    runs = fake_runs(specs)
    figures = utilization_and_gaps(runs)
    busy = sum(r["end"] - r["start"] for rs in runs.values() for r in rs if r.get("end"))
    print(f"{prefix}busy_s={busy:.2f}")
    print(f"{prefix}utilization={figures['utilization']:.3f}")
    print(f"{prefix}gap_ms_median={figures['gap_ms_median']:.1f}")
    print(f"{prefix}loads_per_server={','.join(map(str, per_server))}")
    return sum(per_server), figures["makespan_s"]


async def run_in_process(
    job_file: JobFile, specs: list[ServerSpec], store: Store, planned: bool
) -> int:
    """The batch over a pool of ``specs`` (``planned``: with the plan); jobs done."""
    config = BatchConfig(poll_s=1.0, base_delay_s=0.1)
    owner = new_owner()
    store.register_jobs("bench", job_file.jobs)
    async with Pool(specs, store, owner=owner, settings=config, planned=planned) as pool:
        batch = Batch(
            job_file.jobs,
            partition="bench",
            pool=pool,
            store=store,
            config=config,
            owner=owner,
            on_line=lambda line: None,
        )
        await batch.run()
    return batch.progress.done


def run_two_processes(files: list[Path], specs: list[ServerSpec], store: Path) -> list[int]:
    """``comfy-assets run`` on each file at once, sharing ``specs`` and ``store``; their
    exit statuses."""
    servers = [a for s in specs for a in ("--server", f"{s.name}={s.url}")]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "comfy_assets.cli",
                "run",
                "--jobs",
                str(f),
                *servers,
                "--store",
                str(store),
                "--partition",
                f"half{i}",
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, f in enumerate(files)
    ]
    return [p.wait() for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=240)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--models", type=int, default=3)
    ap.add_argument("--prompt-s", type=float, default=0.25)
    ap.add_argument("--load-s", type=float, default=2.0)
    ap.add_argument("--skip-fifo", action="store_true", help="leave out scenario 2")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    models = model_names(args.models)
    names = [models[i % len(models)] for i in range(args.jobs)]
    random.Random(25).shuffle(names)
    per_node = args.prompt_s / NODES_EXECUTED
    everything = ["--models", ",".join(models), "--model-load-s", str(args.load_s)]
    everything += ["--resident", "1"]
    lower = (args.jobs * args.prompt_s + max(len(models), args.servers) * args.load_s) / (
        args.servers
    )
    out: dict[str, float | int | str] = {
        "jobs": args.jobs,
        "servers": args.servers,
        "models": len(models),
        "prompt_s": args.prompt_s,
        "load_s": args.load_s,
        "lower_bound_s": round(lower, 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        job_file = load_job_file(write_model_jobs(root / "jobs", names))

        def scenario(name: str, planned: bool, extra: list[list[str]]) -> tuple[int, float]:
            with fake_processes(args.servers, per_node, scratch_dir(), extra) as specs:
                store = Store(root / f"store-{name}")
                done = asyncio.run(run_in_process(job_file, specs, store, planned))
                if done != args.jobs:
                    raise SystemExit(f"{name}: {done} of {args.jobs} jobs done")
                return loads_and_makespan(specs, "" if name == "planned" else f"{name}_")

        loads, makespan = scenario("planned", True, [everything] * args.servers)
        out.update(makespan_s=round(makespan, 2), model_loads=loads)
        out["ratio"] = round(makespan / lower, 3)
        if not args.skip_fifo:
            fifo_loads, fifo_makespan = scenario("fifo", False, [everything] * args.servers)
            out.update(fifo_makespan_s=round(fifo_makespan, 2), fifo_model_loads=fifo_loads)
            out["fifo_over_planned"] = round(fifo_makespan / makespan, 2)

        halves = [
            write_model_jobs(root / f"half{i}", names[i::2], name=f"half{i}.jsonl")
            for i in range(2)
        ]
        with fake_processes(
            args.servers, per_node, scratch_dir(), [everything] * args.servers
        ) as specs:
            started = time.monotonic()
            codes = run_two_processes(halves, specs, root / "store-two")
            if codes != [0, 0]:
                raise SystemExit(f"two processes: exit statuses {codes}")
            two_loads, two_makespan = loads_and_makespan(specs, "two_process_")
            out["two_process_wall_s"] = round(time.monotonic() - started, 2)
        out.update(two_process_makespan_s=round(two_makespan, 2), two_process_model_loads=two_loads)
        out["two_process_loads_over_one"] = round(two_loads / loads, 2)

        hetero = []
        for server in range(args.servers):
            held = [m for i, m in enumerate(models) if server in (i, (i + 1) % args.servers)]
            hetero.append(["--models", ",".join(held), "--model-load-s", str(args.load_s)])
        hetero_loads, hetero_makespan = scenario("hetero", True, hetero)
        out.update(hetero_makespan_s=round(hetero_makespan, 2), hetero_model_loads=hetero_loads)
        out["hetero_ratio"] = round(hetero_makespan / lower, 3)
        out["hetero_servers"] = " ".join(f"gpu{i}={','.join(e[1:2])}" for i, e in enumerate(hetero))
    for name, value in out.items():
        print(f"{name}={value}")


if __name__ == "__main__":
    main()
