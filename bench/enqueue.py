"""A big job file through ``comfy-assets enqueue``: peak memory, time to the first message
in the queue, total time and messages per second.

Run (RabbitMQ on 127.0.0.1:5672, guest/guest by default):
    python bench/enqueue.py                                # 100,000 then 1,000,000 jobs
    python bench/enqueue.py --sizes 100000 --repo ../old   # another checkout's enqueue
    python bench/enqueue.py --sizes 1000000 --window-s 120 # stop 120 s after the first message

Each size: the job file of ``bench/million.py`` (one small workflow, each job its own colour;
written once under ``--cache``), published by ``python -m comfy_assets.cli enqueue`` as a
subprocess started in ``--repo`` (default: this checkout, so its code is the one run) to a
queue of the bench's own (``bench-enqueue-<pid>-<size>``), deleted with its ``.dead``
afterwards. Figures:

- ``first_message_s``: from the start of ``enqueue`` to the first message the queue holds
  (its depth, read every 0.2 s through a passive declare);
- ``peak_rss_mb``: the process's peak resident memory (``ru_maxrss`` of ``wait4``; with
  ``--window-s S``, its VmHWM when it is stopped with SIGKILL ``S`` seconds after its first
  message, ``0``: at it, for runs too long to wait for at about 1,000 messages a second);
- ``total_s``, ``msgs_per_s``: until it exits, and the jobs it said it enqueued per second
  of that (with ``--window-s``: the messages queued per second since the first);
  ``queued`` the queue's depth at the end (the jobs it published).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aio_pika

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.million import job_file, status_kb

ROOT = Path(__file__).resolve().parent.parent
URL = "amqp://guest:guest@127.0.0.1:5672/"


async def depth(channel: aio_pika.abc.AbstractChannel, queue: str) -> int | None:
    """How many messages ``queue`` holds, or None while it does not exist (the channel
    a failed passive declare closes is opened again by the caller)."""
    try:
        declared = await channel.declare_queue(queue, passive=True)
    except aio_pika.exceptions.ChannelClosed:
        return None
    return declared.declaration_result.message_count or 0


async def one_size(jobs: int, args: argparse.Namespace) -> dict[str, str]:
    path = job_file(Path(args.cache), jobs)
    queue = f"bench-enqueue-{os.getpid()}-{jobs}"
    out = {"jobs": str(jobs), "file_mb": f"{path.stat().st_size / 1e6:.1f}"}
    env = {**os.environ, "COMFY_ASSETS_RABBITMQ_URL": args.rabbitmq}
    cmd = [sys.executable, "-m", "comfy_assets.cli", "enqueue", "--queue", queue]
    connection = await aio_pika.connect(args.rabbitmq)
    try:
        start = time.time()
        proc = subprocess.Popen(
            [*cmd, "--jobs", str(path)],
            cwd=args.repo,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        channel = await connection.channel()
        first: float | None = None
        status: int | None = None
        peak_kb = 0
        killed = False
        while status is None:
            await asyncio.sleep(0.2)
            pid, raw, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, peak_kb = os.waitstatus_to_exitcode(raw), usage.ru_maxrss
                break
            if first is None:
                if channel.is_closed:
                    channel = await connection.channel()
                if await depth(channel, queue):
                    first = time.time()
            windowed = args.window_s is not None and first is not None
            if windowed and time.time() >= first + args.window_s:
                peak_kb = status_kb(proc.pid, "VmHWM")
                os.kill(proc.pid, signal.SIGKILL)
                killed = True
                _, raw, _ = os.wait4(proc.pid, 0)
                status = os.waitstatus_to_exitcode(raw)
        end = time.time()
        proc.returncode = status  # reaped here: Popen must not wait for it again
        stdout = proc.stdout.read() if proc.stdout else ""
        stderr = proc.stderr.read() if proc.stderr else ""
        if channel.is_closed:
            channel = await connection.channel()
        queued = await depth(channel, queue)
        for name in (queue, f"{queue}.dead"):
            await channel.queue_delete(name)
    finally:
        await connection.close()
    if first is None and queued:
        first = end  # it published and exited between two looks at the queue
    out["first_message_s"] = f"{first - start:.2f}" if first is not None else "nan"
    out["peak_rss_mb"] = f"{peak_kb / 1024:.1f}"
    out["queued"] = str(queued)
    if killed:
        out["stopped_after_s"] = f"{end - start:.1f}"
        if first is not None and end > first and queued:
            out["msgs_per_s"] = f"{queued / (end - first):.0f}"
        return out
    if status != 0:
        sys.stderr.write(stderr[-3000:])
        raise SystemExit(f"jobs={jobs}: enqueue exited {status}")
    count = int(stdout.split()[1])  # "enqueued N jobs to QUEUE"
    out["total_s"] = f"{end - start:.1f}"
    out["msgs_per_s"] = f"{count / (end - start):.0f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,1000000", help="job counts, comma-separated")
    ap.add_argument("--rabbitmq", default=URL, help=f"the broker ({URL})")
    ap.add_argument("--repo", default=str(ROOT), help="the checkout whose enqueue runs")
    ap.add_argument("--window-s", type=float, default=None, help="stop S s after the first message")
    ap.add_argument("--cache", default=os.environ.get("BENCH_MILLION_CACHE", "/tmp/bench-million"))
    args = ap.parse_args()
    print(f"load_1m_start={os.getloadavg()[0]:.2f}", flush=True)
    for jobs in (int(s) for s in args.sizes.split(",")):
        for name, value in asyncio.run(one_size(jobs, args)).items():
            print(f"jobs{jobs}_{name}={value}", flush=True)
    print(f"load_1m_end={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
