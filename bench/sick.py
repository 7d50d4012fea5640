"""A farm with a sick server, in each shape a farm shows: what it costs, against the
healthy servers alone.

Run: `python bench/sick.py [--jobs 30] [--servers 3] [--prompt-s 1.0] [--sick-s 0.1]
[--bad 6] [--shapes error,500,invalid,partial,oom,cuda,wedge]`. One batch per shape on fake
servers, each its own process and a fresh SQLite store:

- `<shape>`: `--servers` fakes, the last one sick in that shape (the fake's
  `--default-word`): `error` fails every prompt with the recorded IndexError (a node pack
  broken on one host), `500` answers every POST /prompt 500 (a proxy before a crashed
  ComfyUI), `invalid` answers 400 (another ComfyUI or node-pack version), `partial` 200
  with node_errors, `oom` fails every prompt out of memory, `cuda` with a CUDA fault,
  `wedge` sticks inside a node deaf to interrupts (a CUDA hang); good prompts `--prompt-s`;
- `healthy`: the same jobs on the `--servers - 1` healthy fakes alone (the makespan a
  sick server should not make worse than);
- `mixed`: the `error` farm again, `--bad` of the jobs of a workflow that fails on every
  server (ImageToMask of an alpha channel an RGB image lacks: the recorded IndexError).

Prints `name=value` lines: per batch its dead letters, jobs done, POST /prompt requests to
the sick server, prompts run in all, and the makespan; `<shape>_makespan_ratio` (that
batch / healthy).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import WORKFLOW, fake_processes, fake_requests, fake_runs
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.run import run_batch_sync
from comfy_assets.store import Store

NODES_EXECUTED = 4  # the fake sleeps --prompt-seconds per executed node of image.json

# image.json with a mask of the alpha channel: fails in node 5 on every server.
BAD = {
    **json.loads(WORKFLOW.read_text()),
    "5": {"class_type": "ImageToMask", "inputs": {"image": ["1", 0], "channel": "alpha"}},
    "6": {"class_type": "MaskToImage", "inputs": {"mask": ["5", 0]}},
    "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "mask"}},
}


def write_jobs(folder: Path, count: int, bad: int) -> Path:
    """``count`` image jobs, every ``count // bad``-th of them (``bad`` in all) of the
    workflow that fails everywhere."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "image.json").write_text(WORKFLOW.read_text())
    step = count // bad if bad else 0
    lines = []
    for i in range(count):
        job: dict[str, object] = {"id": str(uuid.uuid4()), "set": {"1.color": i}}
        job["workflow"] = BAD if step and i % step == 0 and i // step < bad else "image.json"
        lines.append(json.dumps(job))
    path = folder / "bench.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def batch(
    root: Path, name: str, servers: int, shape: str | None, args: argparse.Namespace, bad: int
) -> dict[str, float]:
    """One batch on fresh fakes and a fresh store, the last fake sick in ``shape`` (None:
    all healthy); its figures."""
    jobs = load_job_file(write_jobs(root / name, args.jobs, bad))
    store = Store(root / name / "store")
    extra = [[] for _ in range(servers)]
    if shape is not None:
        extra[-1] = ["--default-word", shape, "--prompt-seconds", str(args.sick_s)]
    per_node = args.prompt_s / NODES_EXECUTED
    with fake_processes(servers, per_node, root / name, extra) as specs:
        config = BatchConfig(poll_s=1.0, base_delay_s=0.5)
        started = time.monotonic()
        summary = run_batch_sync(
            jobs, partition=name, servers=specs, store=store, config=config, on_line=lambda _: None
        )
        makespan = time.monotonic() - started
        runs = fake_runs(specs)
        posts = fake_requests(specs[-1:]).get("POST /prompt", 0) if shape is not None else 0
    store.close()
    return {
        "dead_letters": summary.counts.get("failed_fatal", 0),
        "done": summary.counts.get("succeeded", 0),
        "posts_to_sick": posts,
        "prompts": sum(len(r) for r in runs.values()),
        "makespan_s": round(makespan, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=30)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--prompt-s", type=float, default=1.0)
    ap.add_argument("--sick-s", type=float, default=0.1)
    ap.add_argument("--bad", type=int, default=6)
    ap.add_argument("--shapes", default="error,500,invalid,partial,oom,cuda,wedge")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"jobs={args.jobs} servers={args.servers} prompt_s={args.prompt_s:g}")
    print(f"sick_s={args.sick_s:g} bad={args.bad}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shapes = [shape for shape in args.shapes.split(",") if shape]
        results = {"healthy": batch(root, "healthy", args.servers - 1, None, args, 0)}
        for shape in shapes:
            results[shape] = batch(root, f"sick_{shape}", args.servers, shape, args, 0)
        results["mixed"] = batch(root, "mixed", args.servers, "error", args, args.bad)
    for name, figures in results.items():
        for key, value in figures.items():
            print(f"{name}_{key}={value}", flush=True)
    for shape in [*shapes, "mixed"]:
        ratio = results[shape]["makespan_s"] / results["healthy"]["makespan_s"]
        print(f"{shape}_makespan_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
