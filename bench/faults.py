"""The fault campaign at scale: ``bench/faults.py --schedules N [--seed S] [--keep]
[--mode M]``.

Plays schedules ``S .. S+N-1`` (tests/campaign: fakes, fault proxies, ``comfy-assets run``
subprocesses or the worker) and checks the campaign's invariants after each. Prints one
``seed=... mode=... jobs=... violations=...`` line per schedule (with the faults that
fired and how the prompts ended on the fakes), each violation under it with the
schedule, then ``schedules=``, ``jobs=``, ``violations=``, the totals of what fired and
``wall_s=``. Exit 0
when no invariant broke, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.campaign.invariants import violations
from tests.campaign.play import play
from tests.campaign.schedule import MODES, make_schedule


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schedules", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="the first schedule's seed")
    parser.add_argument("--keep", action="store_true", help="keep each schedule's folder")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="play only the schedules of this mode (worker: those with an object store), "
        "the first N from the seed on",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    jobs = broken = 0
    totals: dict[str, int] = {}
    for seed in _seeds(args.seed, args.schedules, args.mode):
        schedule = make_schedule(seed)
        folder = Path(tempfile.mkdtemp(prefix=f"faults-{seed}-"))
        begun = time.monotonic()
        try:
            played = play(schedule, folder)
            found = violations(played)
            fired = played.tally()
        finally:
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
        jobs += schedule.jobs
        broken += len(found)
        for name, n in fired.items():
            totals[name] = totals.get(name, 0) + n
        print(
            f"seed={seed} mode={schedule.mode} jobs={schedule.jobs} violations={len(found)} "
            f"wall_s={time.monotonic() - begun:.1f} "
            + " ".join(f"{k}={v}" for k, v in sorted(fired.items())),
            flush=True,
        )
        if found:
            print(schedule.describe())
            for line in found:
                print(f"  violation: {line}")
            if args.keep:
                print(f"  folder: {folder}")
    print(f"schedules={args.schedules}")
    print(f"jobs={jobs}")
    print(f"violations={broken}")
    print("fired: " + " ".join(f"{k}={v}" for k, v in sorted(totals.items())))
    print(f"wall_s={time.monotonic() - started:.1f}")
    return 1 if broken else 0


def _seeds(first: int, count: int, mode: str | None) -> list[int]:
    """``count`` seeds from ``first`` on, of schedules of ``mode`` only when given (the
    mode is the seed modulo ``len(MODES)``)."""
    if mode is None:
        return list(range(first, first + count))
    start = first + (MODES.index(mode) - first) % len(MODES)
    return list(range(start, start + count * len(MODES), len(MODES)))


if __name__ == "__main__":
    sys.exit(main())
