"""The move of a job to rendering, written a moment after its POST was answered: a prompt
that ends sooner has it written with the attempt's last record, one transaction instead
of two (a cached prompt, a thumbnail), while a longer one shows rendering within
``RENDERING_WRITE_S`` of its POST.

Nothing the exactly-once guarantees rest on waits for this write: the job is submitted
(prompt_id and server on record) before the POST, and a process that dies with the move
unwritten leaves what a death right after the POST leaves, which the next attempt's
catch-up finds in the server's /queue or /history.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from comfy_assets.store import RenderingStart

# Seconds between a POST's answer and the write of its rendering move: longer than most
# cached or tiny prompts take, shorter than anyone watching the job table notices.
RENDERING_WRITE_S = 0.25


@dataclass(eq=False)
class DeferredRendering:
    """Each job's rendering move, waiting for its write (at most one per job).

    ``write(job_id, move)`` writes a move once ``delay_s`` seconds have passed;
    ``failed(job_id, error)`` is told when such a write raised, and returns True when it
    has taken charge of the error (it stopped the attempt), else ``take`` raises it.
    """

    write: Callable[[str, RenderingStart], Coroutine[Any, Any, None]]
    failed: Callable[[str, BaseException], bool]
    delay_s: float = RENDERING_WRITE_S
    _waiting: dict[str, tuple[RenderingStart, asyncio.Handle]] = field(
        default_factory=dict, init=False, repr=False
    )
    _writing: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False, repr=False)

    def defer(self, job_id: str, move: RenderingStart) -> None:
        """Write ``move`` in ``delay_s`` seconds unless ``take`` comes first."""
        loop = asyncio.get_running_loop()
        self._waiting[job_id] = (move, loop.call_later(self.delay_s, self._due, job_id))

    def _due(self, job_id: str) -> None:
        move, _ = self._waiting.pop(job_id)
        task = asyncio.create_task(self.write(job_id, move), name=f"rendering-{job_id[:8]}")
        self._writing[job_id] = task
        task.add_done_callback(lambda t: self._written(job_id, t))

    def _written(self, job_id: str, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        if self.failed(job_id, task.exception()):  # type: ignore[arg-type]
            self._writing.pop(job_id, None)

    async def take(self, job_id: str) -> RenderingStart | None:
        """The move of ``job_id`` not yet written, its timer stopped, for the attempt's
        last record to write first; None when there is none or it was written (a write
        under way is waited for). Raises what that write raised, unless ``failed`` took
        charge of it."""
        waiting = self._waiting.pop(job_id, None)
        if waiting is not None:
            waiting[1].cancel()
            return waiting[0]
        task = self._writing.pop(job_id, None)
        if task is not None:
            await asyncio.shield(task)  # a cancelled caller does not cancel the write
        return None
