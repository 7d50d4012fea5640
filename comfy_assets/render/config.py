"""The knobs of a batch (``BatchConfig``): retries, deadlines, leases, limits, policy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from comfy_assets.comfy.download import MAX_OUTPUT_BYTES
from comfy_assets.pool.probing import NEVER_ANSWERED_S
from comfy_assets.pool.settings import PoolSettings, knob
from comfy_assets.render.backoff import RetryPolicy


@dataclass
class BatchConfig(PoolSettings):
    """Knobs of a batch (seconds everywhere): the pool's (``PoolSettings``, which the pool
    reads from this object as it is) and the retries, claims, limits and policy below.
    Each field's ``metadata["doc"]`` says what it does (:func:`knob_doc`): the CLI's
    ``--help`` and Dagster's resource show it, with the field's default."""

    attempts: int = knob(4, "Attempts per job before it is a dead letter.")
    base_delay_s: float = knob(2.0, "Seconds before the first retry; doubled after each failure.")
    max_delay_s: float = knob(60.0, "The longest wait between retries, seconds.")
    jitter: bool = knob(True, "Randomize retry waits so failed jobs do not come back together.")
    timeout_s: float = knob(600.0, "Seconds one attempt may take at most.")
    stall_factor: float | None = knob(
        10.0,
        "A running prompt nothing is heard of for this many times the longest run of its "
        "kind in the batch (at least 10 s, once 3 have run; 120 s before) is interrupted and tried on "
        "another server; 0 turns it off (only timeout_s ends a prompt).",
    )
    wedge_s: float = knob(
        10.0,
        "Seconds a prompt may stay running after its interrupt and delete before its "
        "server is taken as wedged: quarantined, the job tried elsewhere at once.",
    )
    lease_s: float = knob(
        3600.0,
        "Seconds a job's claim stands without renewal. It decides only for a holder with no "
        "owner row in the store (an older version): a run or worker whose heartbeat stops "
        "loses its claims and servers within seconds, whatever this is.",
    )
    catch_up_s: float = knob(
        60.0,
        "Seconds to keep asking a job's previous server (where its prompt may still run) "
        "before posting it elsewhere, which may render it twice.",
    )
    unreachable_timeout_s: float | None = knob(
        600.0,
        "Seconds with no server reachable after which the batch stops, its unrun jobs left "
        f"pending for a retry ({NEVER_ANSWERED_S:g} s at most while no server has answered "
        "since it started); "
        "none waits for ever (as the worker service does).",
    )
    files_wait_s: float = knob(
        300.0,
        "Seconds the store's files (a folder, an object store) may keep failing to store "
        "outputs before the batch stops, its jobs left pending; meanwhile a job whose "
        "outputs were not stored waits (with backoff) and takes them from its server's "
        "/history, never posted again.",
    )
    policy: str | None = knob(
        None,
        '"delivery" stops submitting a storyboard\'s shots at its first fatal failure; '
        '"draft" turns permanent failures (and failed optional shots) into degraded; '
        "none follows the job file's header.",
    )
    max_output_bytes: int = knob(
        MAX_OUTPUT_BYTES,
        "Bytes one output file may have at most; a larger one fails its job for good (the "
        "same prompt writes the same file again).",
    )

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(
            attempts=self.attempts,
            base_delay_s=self.base_delay_s,
            max_delay_s=self.max_delay_s,
            jitter=self.jitter,
            timeout_s=self.timeout_s,
        )


KNOBS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(BatchConfig)}


def knob_doc(name: str) -> str:
    """What BatchConfig's field ``name`` does, one or two sentences. Raises KeyError for a
    name that is not a field."""
    return KNOBS[name].metadata["doc"]
