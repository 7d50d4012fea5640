"""What ``comfy-assets status`` reads does not grow with the jobs done: each statement of
``Store.status_snapshot`` is a range of an index, or a count over an index alone, never a
scan of the jobs' table (on a 1,000,000-job partition such a scan was most of the time:
``docs/performance.md``, "Its status without a full scan")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa

from comfy_assets.store import Store
from tests.store.test_store import make_jobs


def test_no_statement_of_the_status_snapshot_scans_the_jobs_table(
    store: Store, workflow_dir: Path
) -> None:
    jobs = make_jobs(workflow_dir, 6)
    store.register_jobs("a", jobs[:3])
    store.register_jobs("b", jobs[3:])
    for job in (jobs[0], jobs[3]):  # a dead letter in each partition
        assert store.claim(job.id, "w1") == "claimed"
        store.dead_letter(job.id, "w1", "no server has model x.safetensors")
    assert store.claim(jobs[1].id, "w1") == "claimed"
    said: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        said.append((statement, params))

    sa.event.listen(store.engine, "before_cursor_execute", record)
    try:
        snap = store.status_snapshot("a")
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", record)

    assert snap.counts["b"]["failed_fatal"] == 1
    on_jobs = [(s, p) for s, p in said if "FROM comfy_jobs" in s]
    assert on_jobs
    with store.engine.connect() as conn:
        for statement, params in on_jobs:
            plan = [
                row[3] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)
            ]
            # "SCAN comfy_jobs USING COVERING INDEX ...": the counts, from the index alone.
            assert "SCAN comfy_jobs" not in plan, (statement, plan)
