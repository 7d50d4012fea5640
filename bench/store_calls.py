"""CPU per store call of ``comfy-assets run`` on a SQLite store: the three a job makes.

    python bench/store_calls.py                # 400 jobs, 3 rounds
    python bench/store_calls.py --jobs 1200 --rounds 5

Runs ``comfy-assets run`` in this process on one in-thread fake (zero-length prompts),
``--rounds`` times on a fresh store each (after 20 jobs to warm up), timing with
``time.thread_time`` (the calling thread's CPU, user + system: the fake's threads are not
counted) every ``Store.claim_job``, ``Store.transition`` and ``Store.mark_done``: a job's
claim, its move to submitted and its done record. Prints
``cpu_us_per_call_<method>=<median over rounds>`` and ``cpu_us_per_job_store=`` (their
sum per job): a figure for a change to the store that a whole run's CPU, which moves by
a tenth from one run to the next on a shared machine, cannot show.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.overhead import run_in_process
from comfy_assets.store import Store
from fake_comfy import FakeComfy

METHODS = ("claim_job", "transition", "mark_done")
cpu_s: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            cpu_s[name] += time.thread_time() - started
            calls[name] += 1

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=400, help="jobs of each round (400)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    args = parser.parse_args()
    if args.jobs < 1 or args.rounds < 1:
        parser.error("--jobs and --rounds must be at least 1")
    for name in METHODS:
        setattr(Store, name, timed(name, getattr(Store, name)))
    per_call: dict[str, list[float]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="bench-store-calls-") as tmp:
        work = Path(tmp)
        with FakeComfy(prompt_seconds=0).serve_in_thread(port=0) as url:
            run_in_process(url, work, "warm", 20, 0)
            for i in range(args.rounds):
                cpu_s.clear()
                calls.clear()
                run_in_process(url, work, f"round{i}", args.jobs, 1000 + i * args.jobs)
                for name in METHODS:
                    per_call[name].append(cpu_s[name] / max(calls[name], 1) * 1e6)
    medians = {name: statistics.median(values) for name, values in per_call.items()}
    for name, value in medians.items():
        print(f"cpu_us_per_call_{name}={value:.0f}")
    print(f"cpu_us_per_job_store={sum(medians.values()):.0f}")


if __name__ == "__main__":
    main()
