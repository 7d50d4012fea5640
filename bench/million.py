"""A big job file through ``comfy-assets run``: time to the first prompt, peak memory, jobs/s.

Run:
    python bench/million.py                              # 10,000 then 100,000 jobs
    python bench/million.py --sizes 10000,1000000        # the issue's comparison, one run
    python bench/million.py --sizes 100000 --window-s 30
    python bench/million.py --sizes 1000000 --kill-after 20000   # exactly once at that size

Each size: a JSONL file of text-to-image jobs sharing one small workflow (bench/common.py's
``write_jobs``: image.json, each job its own colour), 8 fake servers (separate processes,
``--prompt-seconds 0``: zero-length prompts, so every second is ours or the fakes' HTTP), and
``comfy-assets run`` as a subprocess with its default settings (SQLite store in a temporary
folder). Figures:

- ``first_prompt_s``: from the start of ``run`` to the first POST /prompt a fake recorded
  (its ``/fake/stats`` ``posts``, polled until one is there; same machine, same clock);
- ``rss_at_first_prompt_mb``: the run's resident memory then (``/proc/<pid>/status`` VmRSS);
- ``peak_rss_mb``: the run's VmHWM, read last just before it ends or is stopped;
- ``jobs_per_s``: jobs succeeded (the run's ``succeeded`` lines) per second, between
  ``--warm-s`` after the first prompt and the end of the window (``--window-s``, or the run's
  last ``succeeded`` line when it ends sooner). A run still going at the end of the window is
  stopped with SIGKILL (a 1,000,000-job file would take hours at these rates), so its
  ``peak_rss_mb`` is the peak until then and ``finished=no`` says so.

With several sizes the last lines compare the largest to the smallest
(``jobs_per_s_ratio``: target >= 0.9; ``peak_rss_mb`` of the largest: target <= 500 for
1,000,000 jobs; ``first_prompt_s``: target <= 10). Jobs files are written once per size under
``--cache`` (default /tmp/bench-million) and reused.

``--kill-after N``: per size, exactly once after a SIGKILL instead. ``comfy-assets run`` (the
same command) is killed with SIGKILL once the fakes recorded ``N`` POST /prompt, started
again on the same store and fakes, and stopped with SIGKILL ``--window-s`` seconds after its
first prompt. Figures, from the fakes' records (``/fake/stats`` ``prompts``: each prompt_id's
``posted`` and ``executed`` counts, and the ``posts`` times): ``posted_before_kill`` (read
after the kill), ``posted_after_restart``, ``restart_first_prompt_s`` (from the second start
to its first POST /prompt), and ``posted_twice`` / ``executed_twice``: prompt_ids posted or
executed more than once across both runs (target 0); and ``restart_peak_rss_mb``: the
restarted run's VmHWM, read until it is stopped.

The killed run's servers stay leased to it until its owner is found gone, ``OWNER_DEAD_S``
(10 s) after its last heartbeat (``store/owners.py``): started again at once, as by default,
the restart's first prompt waits for that, whatever it does itself. ``--restart-after-s S``
starts it ``S`` seconds after the kill instead (12: the owner is gone by then), so
``restart_first_prompt_s`` is the restart's own time to its first prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes, scratch_dir, write_jobs
from comfy_assets.comfy.servers import ServerSpec

TARGET_FIRST_PROMPT_S = 10.0
TARGET_RSS_MB = 500.0
TARGET_RATIO = 0.9


def job_file(cache: Path, jobs: int) -> Path:
    """The job file of ``jobs`` jobs, written once under ``cache``."""
    folder = cache / f"jobs{jobs}"
    path = folder / "bench.jsonl"
    done = folder / "complete"
    if not done.exists():
        shutil.rmtree(folder, ignore_errors=True)
        write_jobs(folder, jobs)
        done.write_text("")
    return path


def first_post(specs: list[ServerSpec]) -> float | None:
    """The epoch time of the earliest POST /prompt any fake recorded, or None."""
    times = []
    for s in specs:
        with urllib.request.urlopen(f"{s.url}/fake/stats") as r:
            times += [p["time"] for p in json.load(r)["posts"]]
    return min(times) if times else None


def status_kb(pid: int, field: str) -> int:
    """``field`` (VmRSS, VmHWM) of ``/proc/<pid>/status``, in KiB; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


class Lines:
    """Reads the run's stdout on a thread: when each ``succeeded`` line came."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.succeeded: list[float] = []
        self.last: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if ": succeeded" in line:
                self.succeeded.append(time.time())
            else:
                self.last = (self.last + [line.rstrip()])[-5:]


def run_command(path: Path, store: Path, specs: list[ServerSpec]) -> list[str]:
    """``comfy-assets run`` of ``path`` into ``store`` over the fakes ``specs``."""
    servers = [a for s in specs for a in ("--server", f"{s.name}={s.url}")]
    run = ["run", "--jobs", str(path), "--store", str(store), *servers]
    return [sys.executable, "-m", "comfy_assets.cli", *run]


def one_size(jobs: int, args: argparse.Namespace) -> dict[str, str]:
    path = job_file(Path(args.cache), jobs)
    size_mb = path.stat().st_size / 1e6
    out: dict[str, str] = {"jobs": str(jobs), "file_mb": f"{size_mb:.1f}"}
    fakes_out = scratch_dir()
    with (
        tempfile.TemporaryDirectory() as tmp,
        fake_processes(args.servers, 0.0, fakes_out) as specs,
    ):
        cmd = run_command(path, Path(tmp) / "store", specs)
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = Lines(proc)
        first: float | None = None
        rss_first = 0
        peak = 0
        while first is None and proc.poll() is None:
            peak = max(peak, status_kb(proc.pid, "VmHWM"))
            first = first_post(specs)
            if first is None:
                time.sleep(0.05)
            else:
                rss_first = status_kb(proc.pid, "VmRSS")
        window_end = (first or start) + args.window_s
        while proc.poll() is None and time.time() < window_end:
            peak = max(peak, status_kb(proc.pid, "VmHWM"))
            time.sleep(0.2)
        finished = proc.poll() is not None
        if not finished:
            peak = max(peak, status_kb(proc.pid, "VmHWM"))
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        stderr = proc.stderr.read() if proc.stderr else ""
        lines.thread.join(10)
        shutil.rmtree(fakes_out, ignore_errors=True)
    if first is None:
        sys.stderr.write(stderr + "\n".join(lines.last))
        raise SystemExit(f"jobs={jobs}: no prompt was posted (exit {proc.returncode})")
    warm = first + args.warm_s
    done = [t for t in lines.succeeded if t >= warm]
    span = (done[-1] if finished and done else min(time.time(), window_end)) - warm
    out["first_prompt_s"] = f"{first - start:.2f}"
    out["rss_at_first_prompt_mb"] = f"{rss_first / 1024:.1f}"
    out["peak_rss_mb"] = f"{peak / 1024:.1f}"
    out["succeeded"] = str(len(lines.succeeded))
    out["jobs_per_s"] = f"{len(done) / span:.1f}" if span > 0 and done else "nan"
    out["window_s"] = f"{span:.1f}"
    out["finished"] = "yes" if finished else "no"
    if finished and proc.returncode != 0:
        sys.stderr.write(stderr[-2000:])
        out["exit"] = str(proc.returncode)
    return out


def fake_prompts(specs: list[ServerSpec]) -> tuple[dict[str, list[int]], list[float]]:
    """Every prompt_id the fakes recorded with its ``[posted, executed]`` counts summed
    over them, and the times of every POST /prompt."""
    counts: dict[str, list[int]] = {}
    times: list[float] = []
    for s in specs:
        with urllib.request.urlopen(f"{s.url}/fake/stats") as r:
            stats = json.load(r)
        for prompt_id, c in stats["prompts"].items():
            both = counts.setdefault(prompt_id, [0, 0])
            both[0] += c["posted"]
            both[1] += c["executed"]
        times += [p["time"] for p in stats["posts"]]
    return counts, times


def posted(specs: list[ServerSpec]) -> int:
    """POST /prompt the fakes recorded so far."""
    return sum(c[0] for c in fake_prompts(specs)[0].values())


def kill_and_restart(jobs: int, args: argparse.Namespace) -> dict[str, str]:
    """``run`` killed with SIGKILL after ``args.kill_after`` prompts, run again for
    ``args.window_s`` seconds after its first prompt: the figures of the module docstring."""
    path = job_file(Path(args.cache), jobs)
    out: dict[str, str] = {"jobs": str(jobs), "kill_after": str(args.kill_after)}
    fakes_out = scratch_dir()
    with (
        tempfile.TemporaryDirectory() as tmp,
        fake_processes(args.servers, 0.0, fakes_out) as specs,
    ):
        cmd = run_command(path, Path(tmp) / "store", specs)
        start = time.time()
        first_run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        while posted(specs) < args.kill_after:
            if first_run.poll() is not None:
                raise SystemExit(f"run exited {first_run.returncode} before the kill")
            time.sleep(1.0)
        first_run.send_signal(signal.SIGKILL)
        first_run.wait()
        killed_at = time.time()
        before = posted(specs)
        time.sleep(args.restart_after_s)
        restart = time.time()
        second = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        first: float | None = None
        peak = 0
        while first is None and second.poll() is None:
            time.sleep(0.5)
            peak = max(peak, status_kb(second.pid, "VmHWM"))
            later = [t for t in fake_prompts(specs)[1] if t >= restart]
            first = min(later) if later else None
        end = (first or restart) + args.window_s
        while second.poll() is None and time.time() < end:
            time.sleep(0.5)
            peak = max(peak, status_kb(second.pid, "VmHWM"))
        if second.poll() is None:
            second.send_signal(signal.SIGKILL)
        second.wait()
        counts, _ = fake_prompts(specs)
        shutil.rmtree(fakes_out, ignore_errors=True)
    if first is None:
        sys.stderr.write((second.stderr.read() if second.stderr else b"").decode()[-2000:])
        raise SystemExit(f"jobs={jobs}: the restarted run posted nothing")
    total = sum(c[0] for c in counts.values())
    out["killed_at_s"] = f"{killed_at - start:.1f}"
    out["restarted_after_kill_s"] = f"{restart - killed_at:.1f}"
    out["posted_before_kill"] = str(before)
    out["restart_first_prompt_s"] = f"{first - restart:.2f}"
    out["posted_after_restart"] = str(total - before)
    out["restart_peak_rss_mb"] = f"{peak / 1024:.1f}"
    out["prompt_ids"] = str(len(counts))
    out["posted_twice"] = str(sum(1 for c in counts.values() if c[0] > 1))
    out["executed_twice"] = str(sum(1 for c in counts.values() if c[1] > 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000", help="job counts, comma-separated")
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--window-s", type=float, default=60.0, help="seconds measured per size")
    ap.add_argument("--warm-s", type=float, default=5.0, help="left out after the first prompt")
    ap.add_argument("--cache", default=os.environ.get("BENCH_MILLION_CACHE", "/tmp/bench-million"))
    ap.add_argument(
        "--kill-after", type=int, default=0, help="SIGKILL run after N prompts, run it again"
    )
    ap.add_argument(
        "--restart-after-s",
        type=float,
        default=0.0,
        help="with --kill-after: seconds between the kill and the restart",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"load_1m_start={os.getloadavg()[0]:.2f}")
    if args.kill_after:
        for jobs in sizes:
            for name, value in kill_and_restart(jobs, args).items():
                print(f"jobs{jobs}_{name}={value}", flush=True)
        print(f"load_1m_end={os.getloadavg()[0]:.2f}")
        return
    results = {}
    for jobs in sizes:
        results[jobs] = one_size(jobs, args)
        for name, value in results[jobs].items():
            print(f"jobs{jobs}_{name}={value}", flush=True)
    print(f"load_1m_end={os.getloadavg()[0]:.2f}")
    if len(sizes) > 1:
        small, large = results[sizes[0]], results[sizes[-1]]
        ratio = float(large["jobs_per_s"]) / float(small["jobs_per_s"])
        print(f"jobs_per_s_ratio={ratio:.2f}")
        print(f"meets_ratio_target={'yes' if ratio >= TARGET_RATIO else 'no'}")
    largest = results[sizes[-1]]
    first_ok = float(largest["first_prompt_s"]) <= TARGET_FIRST_PROMPT_S
    print(f"meets_first_prompt_target={'yes' if first_ok else 'no'}")
    rss_ok = float(largest["peak_rss_mb"]) <= TARGET_RSS_MB
    print(f"meets_rss_target={'yes' if rss_ok else 'no'}")


if __name__ == "__main__":
    main()
