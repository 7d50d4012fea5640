"""Claim and lease owners: ``host:pid:random`` ids, and the heartbeat that tells every
other process, on any host, that this one is alive (``store/owners.py``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from comfy_assets.store import OWNER_BEAT_S, OWNER_DEAD_S, Store, StoreDiskFull, StoreUnavailable

log = logging.getLogger("comfy_assets.render.owners")


def new_owner() -> str:
    """A claim/lease owner id: ``host:pid:random``. The random part makes it unique
    across hosts, containers and PID namespaces; nothing judges liveness by the rest."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def stop_process(reason: str) -> None:
    """What a process found gone does by default: exit 1 at once. Another process may
    hold its jobs now and follow their prompts: it must neither post, nor record, nor
    remove a prompt again (a supervisor or Dagster's run retry starts a new one)."""
    sys.stderr.write(f"comfy-assets: stopping at once: {reason}\n")
    sys.stderr.flush()
    logging.shutdown()
    os._exit(1)


@dataclass(eq=False)
class OwnerHeartbeat:
    """The heartbeat of ``owner`` in ``store``, from a thread of its own (a busy event
    loop does not silence it): registered by ``start``, beaten every ``OWNER_BEAT_S``
    seconds (every half second while the store fails), released by ``stop``.

    ``stale()`` says why this process must not post a prompt now: its beats have not
    reached the store for ``OWNER_DEAD_S - OWNER_BEAT_S`` seconds (others may find it
    gone soon and take its jobs), or it was found gone. When a beat answers that another
    process found it gone, ``on_gone(reason)`` is called on the heartbeat's thread
    (default ``stop_process``). ``run_id``: the Dagster run this owner renders for.
    """

    store: Store
    owner: str
    _: KW_ONLY
    run_id: str | None = None
    on_gone: Callable[[str], None] = stop_process
    beat_s: float = OWNER_BEAT_S
    dead_s: float = OWNER_DEAD_S
    gone: str | None = field(init=False, default=None)
    _last_ok: float = field(init=False, default_factory=time.monotonic)
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    _thread: threading.Thread | None = field(init=False, default=None)

    def start(self) -> None:
        """Register the owner and start beating. Raises StoreUnavailable, StoreDiskFull."""
        self.store.register_owner(self.owner, run_id=self.run_id)
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(
            target=self._beat_forever, name=f"owner-heartbeat-{self.owner}", daemon=True
        )
        self._thread.start()

    def silent_s(self) -> float:
        """Seconds since a beat last reached the store."""
        return time.monotonic() - self._last_ok

    def stale(self) -> str | None:
        """Why nothing may be posted now, or None (see the class docstring)."""
        if self.gone is not None:
            return self.gone
        silent = self.silent_s()
        if silent >= self.dead_s - self.beat_s:
            return f"this process's heartbeat has not reached the store for {silent:.0f} s"
        return None

    def _beat_forever(self) -> None:
        failing = False
        while not self._stop.wait(min(0.5, self.beat_s) if failing else self.beat_s):
            try:
                alive = self.store.beat_owner(self.owner)
            except (StoreUnavailable, StoreDiskFull) as e:
                if not failing:
                    log.warning(
                        "owner %s: heartbeat not recorded (%s); trying again", self.owner, e
                    )
                failing = True
                continue
            if failing:
                log.warning(
                    "owner %s: heartbeat recorded again after %.1f s", self.owner, self.silent_s()
                )
            failing = False
            if not alive:
                self.gone = (
                    f"this process (owner {self.owner}) was found gone by another after "
                    f"{self.silent_s():.0f} s without a heartbeat in the store; its jobs are "
                    "another's now"
                )
                self.on_gone(self.gone)
                return
            self._last_ok = time.monotonic()

    async def unsure(self, budget_s: float, stopped: Callable[[], str | None]) -> str | None:
        """Wait while this heartbeat is not reaching the store (``stale``), up to
        ``budget_s`` seconds (or until ``stopped`` says why the batch stopped): then, or
        once found gone, why nothing may be posted; None once it beats again."""
        waited = 0.0
        step = self.beat_s / 4
        while (why := self.stale()) is not None:
            if self.gone is not None or stopped() or waited >= budget_s:
                return why
            # Its thread beats again as soon as the store answers.
            await asyncio.sleep(step)
            waited += step
        return None

    def stop(self) -> None:
        """Stop beating and release the owner (its claims are free to take), unless it
        was found gone. With the store away, others find it gone ``OWNER_DEAD_S``
        seconds after its last beat, which the log says."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.gone is not None:
            return
        try:
            self.store.release_owner(self.owner)
        except (StoreUnavailable, StoreDiskFull) as e:
            log.warning(
                "owner %s: not released (%s); found gone %.0f s after its last heartbeat",
                self.owner,
                e,
                self.dead_s,
            )
