"""Serving an async server (the fake, the fault proxy) from synchronous code: its event
loop in a daemon thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

THREAD_START_TIMEOUT_S = 30.0


@contextlib.contextmanager
def serve_in_thread(
    serve: Callable[[int, str], AbstractAsyncContextManager[str]],
    name: str,
    port: int = 0,
    host: str = "127.0.0.1",
) -> Iterator[str]:
    """``serve(port, host)`` (an async context manager yielding the URL) on its own event
    loop in a daemon thread called ``name``. Yields the URL once it listens; on exit stops
    it and joins the thread. Raises what ``serve`` raised, in the caller's thread, and
    TimeoutError if it does not listen within THREAD_START_TIMEOUT_S seconds."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        async with serve(port, host) as url:
            box["url"], box["loop"], box["stop"] = url, asyncio.get_running_loop(), stop
            ready.set()
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    if not ready.wait(THREAD_START_TIMEOUT_S):
        raise TimeoutError(f"{name} did not start within {THREAD_START_TIMEOUT_S} s")
    if "error" in box:
        raise box["error"]
    try:
        yield box["url"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join()
        if "error" in box:
            raise box["error"]
