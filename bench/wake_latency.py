"""How long a request to a fake takes after the fake has been idle: the wake-up cost that
sits twice in every gap between two prompts (bench/pool.py).

Run: `python bench/wake_latency.py`. Starts one fake process and prints
``get_queue_ms_after_idle_<ms>`` (median of 15 ``GET /queue`` through ``ComfyClient``,
each after that many milliseconds of idleness; 0 = back to back).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes
from comfy_assets.comfy.client import ComfyClient

IDLE_MS = (0, 1, 5, 20, 100, 400)


async def measure(url: str) -> None:
    async with ComfyClient(url, name="gpu0") as client:
        await client.queue()  # the connection is open before anything is timed
        for idle_ms in IDLE_MS:
            seconds = []
            for _ in range(15):
                if idle_ms:
                    await asyncio.sleep(idle_ms / 1000)
                t0 = time.perf_counter()
                await client.queue()
                seconds.append(time.perf_counter() - t0)
            print(f"get_queue_ms_after_idle_{idle_ms}={statistics.median(seconds) * 1000:.2f}")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    with tempfile.TemporaryDirectory() as tmp, fake_processes(1, 0.0, Path(tmp)) as specs:
        asyncio.run(measure(specs[0].url))


if __name__ == "__main__":
    main()
