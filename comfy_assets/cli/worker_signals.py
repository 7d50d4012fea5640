"""SIGTERM and SIGINT over a worker process's whole life, its start-up included.

An orchestrator stops a worker at any moment (a rolling restart, a scale-down), its first
seconds included; each time the answer is one line and exit 0, never Python's default
(killed by the signal, exit 143, no line; or a KeyboardInterrupt traceback). Three phases:

- **starting** (imports, arguments, opening the store, which may wait for its database):
  no message is held yet and nothing is under way that a stop must finish, so the
  process says so and ends at once (``os._exit(0)``: a connection the start-up opened is
  closed by the kernel, and SQLite and PostgreSQL survive a client that vanishes);
- **serving**: the event loop's handlers ask the worker to stop (``Worker.request_stop``:
  no new messages, the grace for running jobs, requeues);
- **stopping** (the loop is done, the process is on its way out): a signal changes
  nothing, and one line says so.

``comfy_assets.cli`` calls ``hold_from_start()`` when the process was started as
``comfy-assets worker``, before the command's imports (about two seconds of aio-pika,
SQLAlchemy and pandas), so that time is covered too. Standard library only, for that.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

_stopping = False


def _line(text: str) -> None:
    # os.write, not print or logging: the signal may land while the main thread is in
    # the middle of a write to stderr, and a buffered stream refuses a reentrant one.
    # The shape of the worker's log lines (cli.worker.service_logging).
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    os.write(2, f"{stamp} INFO comfy_assets.cli.worker: {text}\n".encode())


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if _stopping:
        _line(f"{name}: already stopping")
        return
    _line(f"{name}: stopping while starting up, before taking any message; exit 0")
    os._exit(0)


def hold_from_start() -> None:
    """From now until ``serve`` takes the signals over, SIGTERM or SIGINT ends the
    starting worker: one line, exit 0."""
    global _stopping
    _stopping = False
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def handlers() -> dict[signal.Signals, Handler]:
    """The Python-level handlers of SIGTERM and SIGINT now."""
    return {sig: signal.getsignal(sig) for sig in SIGNALS}


def after_serving(previous: dict[signal.Signals, Handler]) -> None:
    """The loop is done: put ``previous`` back (``handlers()`` before the loop took the
    signals). In a worker process that is ``hold_from_start``'s handler, which from now
    on only says that the worker is already stopping; in a test's process, its own."""
    global _stopping
    _stopping = True
    for sig, handler in previous.items():
        if handler is not None:  # None: set outside Python; nothing to put back
            signal.signal(sig, handler)
