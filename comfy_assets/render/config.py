"""The knobs of a batch (``BatchConfig``): retries, deadlines, leases, limits, policy."""

from __future__ import annotations

from dataclasses import dataclass

from comfy_assets.comfy.download import MAX_OUTPUT_BYTES
from comfy_assets.render.backoff import RetryPolicy


@dataclass
class BatchConfig:
    """Knobs of a batch (seconds everywhere). ``policy``: None follows the job file's
    header; "delivery" stops submitting a storyboard's shots at its first fatal failure;
    "draft" turns permanent failures (and failed optional shots) into ``degraded``.
    ``catch_up_s``: how long a job's previous server is asked again before the job is
    posted elsewhere (``runner.Attempt``). ``unreachable_timeout_s``: with no server
    reachable for this long the batch stops, its unrun jobs left pending (None: wait for
    ever, as the worker service does). ``max_output_bytes``: the most one output file may
    have (bytes); a larger one is a permanent failure."""

    attempts: int = 4
    base_delay_s: float = 2.0
    max_delay_s: float = 60.0
    jitter: bool = True
    timeout_s: float = 600.0
    poll_s: float = 1.0
    lease_s: float = 3600.0
    server_lease_s: float = 30.0
    max_queue: int | None = None
    probe_timeout_s: float = 3.0
    unhealthy_wait_s: float = 5.0
    catch_up_s: float = 60.0
    unreachable_timeout_s: float | None = 600.0
    policy: str | None = None
    max_output_bytes: int = MAX_OUTPUT_BYTES

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(
            attempts=self.attempts,
            base_delay_s=self.base_delay_s,
            max_delay_s=self.max_delay_s,
            jitter=self.jitter,
            timeout_s=self.timeout_s,
        )
