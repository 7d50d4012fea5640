"""Shared by the benchmarks: fake servers as separate processes, and their records."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from comfy_assets.comfy.servers import ServerSpec

WORKFLOW = Path(__file__).resolve().parent.parent / "data" / "workflows" / "image.json"


def write_jobs(folder: Path, count: int, name: str = "bench.jsonl") -> Path:
    """``count`` image jobs beside a copy of image.json, each its own colour (so its own
    prompt_id) and a fresh id (so a PostgreSQL store can be reused)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "image.json").write_text(WORKFLOW.read_text())
    path = folder / name
    with path.open("w") as f:
        for i in range(count):
            job = {"id": str(uuid.uuid4()), "workflow": "image.json", "set": {"1.color": i}}
            f.write(json.dumps(job) + "\n")
    return path


FAKE_PIDS: dict[str, int] = {}  # server name -> pid of the fakes now running


def fakes_cpu_s() -> float:
    """CPU seconds (user + system) the running fakes have used so far (from /proc)."""
    ticks = 0
    for pid in FAKE_PIDS.values():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def scratch_dir() -> Path:
    """Where fakes write their outputs: memory (/dev/shm) when there is some, since real
    servers write to their own disks, not to ours; else a temporary folder."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="bench-fakes-", dir=shm if shm.is_dir() else None))


@contextmanager
def fake_processes(
    count: int, prompt_seconds: float, out: Path, extra: Sequence[Sequence[str]] = ()
) -> Iterator[list[ServerSpec]]:
    """Start ``count`` fake ComfyUI servers, each its own process (as real servers are);
    ``extra[i]``: more options of server ``i`` (``--models a.safetensors``, ...)."""
    procs = []
    try:
        specs = []
        for i in range(count):
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fake_comfy",
                    "--port",
                    "0",
                    "--prompt-seconds",
                    str(prompt_seconds),
                    "--output-dir",
                    str(out / f"fake{i}"),
                    *(extra[i] if i < len(extra) else ()),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
            line = p.stdout.readline()
            specs.append(ServerSpec(f"gpu{i}", line.strip().rsplit(" ", 1)[-1]))
            FAKE_PIDS[f"gpu{i}"] = p.pid
        yield specs
    finally:
        FAKE_PIDS.clear()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def fake_runs(specs: list[ServerSpec]) -> dict[str, list[dict]]:
    """Each server's runs, from its own ``/fake/stats``."""
    runs = {}
    for s in specs:
        with urllib.request.urlopen(f"{s.url}/fake/stats") as r:
            runs[s.name] = json.load(r)["runs"]
    return runs


def fake_requests(specs: list[ServerSpec]) -> dict[str, int]:
    """HTTP requests the servers received, by "METHOD /route", summed over servers (from
    each ``/fake/stats``; the ``/fake/stats`` requests themselves left out)."""
    total: dict[str, int] = {}
    for s in specs:
        with urllib.request.urlopen(f"{s.url}/fake/stats") as r:
            for route, n in json.load(r)["requests"].items():
                if route != "GET /fake/stats":
                    total[route] = total.get(route, 0) + n
    return total


def utilization_and_gaps(runs: dict[str, list[dict]]) -> dict[str, float]:
    """Pool utilization (busy time / (servers x makespan)) and the gap between one
    prompt's end and the next one's start on a server, in ms."""
    done = {
        n: sorted((r for r in rs if r.get("end")), key=lambda r: r["start"])
        for n, rs in runs.items()
    }
    starts = [r["start"] for rs in done.values() for r in rs]
    ends = [r["end"] for rs in done.values() for r in rs]
    makespan = max(ends) - min(starts)
    busy = sum(r["end"] - r["start"] for rs in done.values() for r in rs)
    gaps = [
        (b["start"] - a["end"]) * 1000
        for rs in done.values()
        for a, b in zip(rs, rs[1:], strict=False)
    ]
    gaps.sort()
    # Where a gap goes: our POST arriving after the previous end, then the fake starting.
    post_gaps = sorted(
        (b["posted"] - a["end"]) * 1000
        for rs in done.values()
        for a, b in zip(rs, rs[1:], strict=False)
    )
    start_lags = sorted((r["start"] - r["posted"]) * 1000 for rs in done.values() for r in rs)
    return {
        "utilization": busy / (len(runs) * makespan),
        "makespan_s": makespan,
        "gap_ms_median": statistics.median(gaps) if gaps else 0.0,
        "gap_ms_p95": gaps[int(0.95 * (len(gaps) - 1))] if gaps else 0.0,
        "first_start_spread_ms": (max(rs[0]["start"] for rs in done.values()) - min(starts)) * 1000,
        "last_end_spread_ms": (max(ends) - min(rs[-1]["end"] for rs in done.values())) * 1000,
        "post_after_end_ms_median": statistics.median(post_gaps) if post_gaps else 0.0,
        "start_after_post_ms_median": statistics.median(start_lags) if start_lags else 0.0,
    }
