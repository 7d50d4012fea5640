"""Several processes opening one new SQLite store at the same moment (two `comfy-assets
run` started together): each waits for the others' lock, as any write does, and opens
it; none fails with "database is locked"."""

from __future__ import annotations

import multiprocessing
import traceback
from multiprocessing.synchronize import Barrier
from pathlib import Path

import sqlalchemy as sa

from comfy_assets.store import Store
from comfy_assets.store.schema import ADDED_INDEXES

PROCESSES = 4
ROUNDS = 40


def _open(root: str, barrier: Barrier, answers: multiprocessing.Queue) -> None:
    barrier.wait()  # every process opens at once
    try:
        Store(Path(root)).close()
    except Exception:
        answers.put(traceback.format_exc())
    else:
        answers.put("opened")


def test_processes_opening_one_new_sqlite_store_at_once_all_open_it(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    failures: list[str] = []
    for round_ in range(ROUNDS):
        root = tmp_path / f"store{round_}"
        barrier = context.Barrier(PROCESSES)
        answers = context.Queue()
        procs = [
            context.Process(target=_open, args=(str(root), barrier, answers))
            for _ in range(PROCESSES)
        ]
        for proc in procs:
            proc.start()
        said = [answers.get(timeout=90) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
        failures += [answer for answer in said if answer != "opened"]

    assert failures == [], failures[0]
    with Store(tmp_path / "store0") as store:  # a usable store
        store.ping()


def test_a_store_made_before_an_index_gets_it_when_opened_and_loses_the_one_it_replaces(
    tmp_path: Path,
) -> None:
    # The indexes that keep a million-job partition's reads short (``ADDED_INDEXES``):
    # ``create_all`` makes indexes only with the tables it creates.
    Store(tmp_path).close()
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'store.db'}")
    with engine.begin() as conn:
        for _, name in ADDED_INDEXES:
            conn.exec_driver_sql(f"DROP INDEX {name}")
        conn.exec_driver_sql("CREATE INDEX ix_comfy_events_partition ON comfy_events (partition)")
        conn.exec_driver_sql(
            "CREATE INDEX ix_comfy_jobs_partition_state ON comfy_jobs (partition, state)"
        )

    Store(tmp_path).close()

    inspector = sa.inspect(engine)
    present = {i["name"] for t in ("comfy_jobs", "comfy_events") for i in inspector.get_indexes(t)}
    assert {name for _, name in ADDED_INDEXES} <= present
    # The ones they replace are dropped.
    assert not {"ix_comfy_events_partition", "ix_comfy_jobs_partition_state"} & present
    engine.dispose()
