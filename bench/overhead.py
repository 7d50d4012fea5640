"""Orchestration cost per job: ``comfy-assets run`` beside the bare websockets_api_example
pattern (bench/bare_client.py), each on a fake of its own, in one run.

Run:
    python bench/overhead.py                       # 200 and 1,200 jobs each
    python bench/overhead.py --small 200 --large 1200
    python bench/overhead.py --prompt-seconds 0.01  # fakes that take time (per node)
    COMFYUI_URL=http://127.0.0.1:8188 python bench/overhead.py   # also a real server

Each side runs as its own process, ``--small`` then ``--large`` jobs, ``--repeat`` times
(3), the two sides taking turns, each on its own fake (a separate process, no GPU time
unless ``--prompt-seconds`` says how long each node takes). The CPU a process used comes
from ``wait4`` (user + system), start-up included; the **marginal** CPU per job is (cpu(large) - cpu(small)) /
(large - small) of the medians of the repeats, which leaves start-up out (a single run
moves by a quarter on this shared machine). Lines: ``cpu_ms_per_job_ours``,
``cpu_ms_per_job_bare``, ``ratio`` (ours / bare), the medians ``cpu_s_*`` and
``wall_s_*`` of each side and size, and ``ratio_whole_<size>``: ours / bare of the whole
process's CPU at each size, start-up included (what a run of that many jobs costs). Both sides download every output and write it to disk; ours
also claims, records, checks and hashes (the product).

With ``COMFYUI_URL``: ``--real-jobs`` (100) tiny prompts of distinct colours through each
side on that server, one after the other: ``wall_ms_per_job_real_ours`` and
``wall_ms_per_job_real_bare``, start-up included; and from the server's own history of
those prompts (``status.messages`` timestamps, milliseconds), the time from the process's
start to its first prompt's ``execution_start`` (``start_s_real_*``), the median and mean
gap between one prompt's ``execution_success`` and the next one's ``execution_start``
(``gap_ms_median_real_*``, ``gap_ms_mean_real_*``: what the GPU waits between prompts),
and from the last ``execution_success`` to the process's exit (``end_s_real_*``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes, scratch_dir
from comfy_assets.cli.main import main as cli
from comfy_assets.jobs.parse import load_job_file

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = {
    "image": ROOT / "data" / "workflows" / "image.json",
}
TINY = {  # one 64-pixel image: the cheapest prompt a real server runs
    "1": {
        "class_type": "EmptyImage",
        "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0},
    },
    "2": {
        "class_type": "SaveImage",
        "inputs": {"images": ["1", 0], "filename_prefix": "overhead"},
    },
}


def job_file(folder: Path, count: int, offset: int, workflow: dict | None = None) -> Path:
    """``count`` jobs of image.json (or ``workflow``), colours from ``offset`` on, so no
    two prompts of a run are alike (ComfyUI's cache would skip them)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(workflow) if workflow else WORKFLOWS["image"].read_text()
    (folder / "w.json").write_text(text)
    path = folder / "jobs.jsonl"
    stamp = f"{time.time_ns():x}"[-8:]
    with path.open("w") as f:
        for i in range(count):
            n = offset + i
            job_id = f"{n:08x}-{stamp[:4]}-4000-8000-{stamp}{n % 10000:04d}"
            f.write(json.dumps({"id": job_id, "workflow": "w.json", "set": {"1.color": n}}))
            f.write("\n")
    return path


def run_in_process(url: str, work: Path, name: str, jobs: int, offset: int) -> None:
    """``comfy-assets run`` of ``jobs`` jobs (``job_file``) in this process, on the one
    server at ``url``, its store in ``work / name``, its printed lines dropped; raises
    SystemExit when it exits other than 0."""
    path = job_file(work / name, jobs, offset)
    argv = ["run", "--jobs", str(path), "--server", f"gpu0={url}", "--store", str(work / name)]
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(argv)
    if code != 0:
        raise SystemExit(f"run of {jobs} jobs exited {code}")


def timed(argv: list[str]) -> tuple[float, float]:
    """(cpu seconds, wall seconds) of running ``argv`` to its end; raises on failure."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {proc.returncode}: {err[-2000:]}")
    return usage.ru_utime + usage.ru_stime, wall


def ours(url: str, jobs: Path, work: Path) -> tuple[float, float]:
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    cli = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs)]
    return timed([*cli, "--server", f"gpu0={url}", "--store", str(store)])


def bare(url: str, jobs: Path, work: Path) -> tuple[float, float]:
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps([job.workflow for job in load_job_file(jobs).jobs]))
    out = work / "bare-out"
    shutil.rmtree(out, ignore_errors=True)
    return timed(
        [sys.executable, str(ROOT / "bench" / "bare_client.py"), url, str(prompts), str(out)]
    )


def executions(url: str, count: int) -> list[tuple[float, float]]:
    """(execution_start, execution_success) in epoch seconds of the ``count`` prompts the
    server ran last, by run number, from GET /history's ``status.messages`` (ComfyUI
    stamps them in milliseconds)."""
    with urllib.request.urlopen(f"{url}/history?max_items={count + 10}") as answer:
        history = json.loads(answer.read())
    entries = sorted(history.values(), key=lambda e: e["prompt"][0])[-count:]
    spans = []
    for entry in entries:
        stamps = {kind: data["timestamp"] / 1000 for kind, data in entry["status"]["messages"]}
        spans.append((stamps["execution_start"], stamps["execution_success"]))
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=200, help="jobs of the first run (200)")
    parser.add_argument("--large", type=int, default=1200, help="jobs of the second run (1200)")
    parser.add_argument("--real-jobs", type=int, default=100, help="jobs on COMFYUI_URL (100)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side and size (3)")
    parser.add_argument(
        "--prompt-seconds", type=float, default=0.0, help="seconds per node on the fakes (0)"
    )
    args = parser.parse_args()
    if args.large <= args.small:
        parser.error("--large must be more than --small")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    out = scratch_dir()
    figures: dict[str, float] = {}
    try:
        runs: dict[str, list[float]] = {}
        with fake_processes(2, args.prompt_seconds, out) as (ours_fake, bare_fake):
            offset = 0
            for _ in range(args.repeat):
                for size in (args.small, args.large):
                    for name, side, fake in (("ours", ours, ours_fake), ("bare", bare, bare_fake)):
                        jobs = job_file(work / f"{name}-{size}", size, offset)
                        cpu, wall = side(fake.url, jobs, work / name)
                        runs.setdefault(f"cpu_s_{name}_{size}", []).append(cpu)
                        runs.setdefault(f"wall_s_{name}_{size}", []).append(wall)
                    offset += size
        figures.update({key: statistics.median(values) for key, values in runs.items()})
        extra = args.large - args.small
        for name in ("ours", "bare"):
            marginal = figures[f"cpu_s_{name}_{args.large}"] - figures[f"cpu_s_{name}_{args.small}"]
            figures[f"cpu_ms_per_job_{name}"] = marginal / extra * 1000
        figures["ratio"] = figures["cpu_ms_per_job_ours"] / figures["cpu_ms_per_job_bare"]
        for size in (args.small, args.large):
            whole = figures[f"cpu_s_ours_{size}"] / figures[f"cpu_s_bare_{size}"]
            figures[f"ratio_whole_{size}"] = whole
        real = os.environ.get("COMFYUI_URL")
        if real:
            for name, side in (("ours", ours), ("bare", bare)):
                seed = time.time_ns() % (1 << 23)
                jobs = job_file(work / f"real-{name}", args.real_jobs, seed, TINY)
                started = time.time()
                _, wall = side(real, jobs, work / f"real-{name}")
                figures[f"wall_ms_per_job_real_{name}"] = wall / args.real_jobs * 1000
                spans = executions(real, args.real_jobs)
                gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
                figures[f"start_s_real_{name}"] = spans[0][0] - started
                figures[f"gap_ms_median_real_{name}"] = statistics.median(gaps) * 1000
                figures[f"gap_ms_mean_real_{name}"] = statistics.mean(gaps) * 1000
                figures[f"end_s_real_{name}"] = started + wall - spans[-1][1]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    for key, value in figures.items():
        print(f"{key}={value:.3f}")


if __name__ == "__main__":
    main()
