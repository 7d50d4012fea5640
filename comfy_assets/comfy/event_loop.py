"""The event loop our asyncio code runs on: uvloop's where it is installed (Linux and
macOS; a dependency there), else asyncio's own (Windows).

Each job is a handful of HTTP requests, a stream of websocket messages and a few file
writes, so the loop's own cost per callback and per socket read is a large part of what
a job costs to orchestrate; uvloop's (libuv, in C) is the smaller. Both run the same
code, which keeps to what both promise: uvloop's ``call_later`` answers a delay that
rounds to 0 ms with a plain ``Handle`` (no ``when()``), so a timer's due time is kept
by whoever needs it (``render/queue.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it can be imported, else asyncio's default."""
    try:
        import uvloop
    except ImportError:  # Windows, where uvloop does not build
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a loop of ``new_event_loop``: returns what ``main``
    returns and raises what it raises (KeyboardInterrupt as ``asyncio.run`` does)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
