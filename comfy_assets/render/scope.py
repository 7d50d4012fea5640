"""What the parts of one batch that claim and settle its jobs share, as one object:
``BatchScope``, given by ``Batch`` to ``Admission`` and ``Settler``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from comfy_assets.render.claim_keeping import Claims
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.progress import Ended
from comfy_assets.render.queue import JobQueue
from comfy_assets.render.store_threads import StoreThreads
from comfy_assets.store import Store


@dataclass(frozen=True, eq=False)
class BatchScope:
    """One batch's common ground: ``store`` and the batch's ``config`` for ``partition``,
    the claims it holds (``claims``), the jobs ready to run (``queue``), where its store
    calls run (``threads``), a line for people (``report``) and a job's end in this
    batch (``resolve``: how it ended, its job id)."""

    store: Store
    config: BatchConfig
    partition: str
    claims: Claims
    queue: JobQueue
    threads: StoreThreads
    report: Callable[[str], None]
    resolve: Callable[[Ended, str], None]
