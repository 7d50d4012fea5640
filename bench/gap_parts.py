"""Where the gap between two prompts on a server goes: bench/pool.py, with the batch's own
steps timed after our socket delivers ``execution_success``.

Run: `python bench/gap_parts.py [bench/pool.py's options]`. Prints bench/pool.py's lines,
then ``after_success_<step>_ms`` (median and p90 over every hand-over) for the steps
``release`` (``Pool.slot_released``), ``take`` (``Pool._take`` by the consumer in line),
``post`` (``ComfyClient.post_prompt`` called, after the ``submitted`` write) and
``posted`` (its answer). The wrappers are this script's own; nothing of comfy_assets is
changed.
"""

from __future__ import annotations

import atexit
import collections
import runpy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comfy_assets.comfy import client, follow
from comfy_assets.pool import pool

STEPS = ("release", "take", "post", "posted")
marks: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)


def _wrap_on_message() -> None:
    original = follow.PromptFollower._on_message

    def on_message(self: follow.PromptFollower, raw: str | bytes) -> bool:
        if isinstance(raw, str) and '"execution_success"' in raw[:40]:
            marks[self.client.name].append(("success", time.perf_counter()))
        return original(self, raw)

    follow.PromptFollower._on_message = on_message  # type: ignore[method-assign]


def _wrap_post() -> None:
    original = client.ComfyClient.post_prompt

    async def post_prompt(self: client.ComfyClient, *args: Any, **kwargs: Any) -> Any:
        marks[self.name].append(("post", time.perf_counter()))
        answer = await original(self, *args, **kwargs)
        marks[self.name].append(("posted", time.perf_counter()))
        return answer

    client.ComfyClient.post_prompt = post_prompt  # type: ignore[method-assign]


def _wrap_pool() -> None:
    release, take = pool.Pool.slot_released, pool.Pool._take

    def slot_released(self: pool.Pool, slot: pool.Slot) -> None:
        marks[slot.name].append(("release", time.perf_counter()))
        release(self, slot)

    def _take(self: pool.Pool, spec: Any, *args: Any, **kwargs: Any) -> pool.Slot | None:
        slot = take(self, spec, *args, **kwargs)
        if slot is not None:
            marks[spec.name].append(("take", time.perf_counter()))
        return slot

    pool.Pool.slot_released = slot_released  # type: ignore[method-assign]
    pool.Pool._take = _take  # type: ignore[method-assign]


def report() -> None:
    """One hand-over = a success, then the first of each step after it on that server."""
    after: dict[str, list[float]] = collections.defaultdict(list)
    for events in marks.values():
        current: dict[str, float] = {}
        for step, t in events:
            if step == "success":
                current = {"success": t}
            elif current and step not in current:
                current[step] = t
                if step == "posted":
                    for s in STEPS:
                        if s in current:
                            after[s].append((current[s] - current["success"]) * 1000)
                    current = {}
    for step in STEPS:
        values = sorted(after[step])
        if values:
            p90 = values[int(len(values) * 0.9)]
            print(f"after_success_{step}_ms={statistics.median(values):.2f}")
            print(f"after_success_{step}_ms_p90={p90:.2f}")
    print(f"handovers={len(after['posted'])}")


if __name__ == "__main__":
    _wrap_on_message()
    _wrap_post()
    _wrap_pool()
    atexit.register(report)
    sys.argv = [str(Path(__file__).with_name("pool.py")), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
