"""SQL statements and transactions per job of ``comfy-assets run`` on a SQLite store.

    python bench/statements.py                # 100 jobs on one fake
    python bench/statements.py --jobs 400

Runs ``comfy-assets run`` in this process on one in-thread fake (zero-length prompts),
once with 20 jobs to warm up, then with ``--jobs`` jobs on a fresh store, counting every
statement SQLAlchemy sends (``before_cursor_execute``) and every commit. Prints one
``per_job=<count> <statement start>`` line per statement shape, most frequent first: the
store's round trips per job, the measure of what a change to the store saves.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import event
from sqlalchemy.engine import Engine

from bench.overhead import run_in_process
from fake_comfy import FakeComfy

counts: collections.Counter[str] = collections.Counter()


@event.listens_for(Engine, "before_cursor_execute")
def _statement(conn, cursor, statement, parameters, context, executemany) -> None:
    counts[" ".join(statement.split())[:100]] += 1


@event.listens_for(Engine, "commit")
def _commit(conn) -> None:
    counts["COMMIT"] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100, help="jobs of the counted run (100)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-statements-") as tmp:
        work = Path(tmp)
        with FakeComfy(prompt_seconds=0).serve_in_thread(port=0) as url:
            run_in_process(url, work, "warm", 20, 0)
            counts.clear()
            run_in_process(url, work, "counted", args.jobs, 1000)
    for statement, n in counts.most_common():
        if n / args.jobs >= 0.05:  # schema creation and other once-per-run statements
            print(f"per_job={n / args.jobs:.2f} {statement}")


if __name__ == "__main__":
    main()
