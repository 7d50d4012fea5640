"""Prometheus metrics of a ``run`` or a ``worker`` (``--metrics-port P``), with the
prometheus-client library: every name starts with ``comfy_assets_``.

- ``comfy_assets_jobs{state}``: jobs by state, of the partitions this process renders
  (every partition of the store for a worker), read from the store at each scrape;
- ``comfy_assets_attempts{server, outcome}`` (a counter: ``_total``): attempts by
  outcome (``success``, ``transient``, ``permanent``), from the store (where that read
  takes over ``SLOW_READ_S``, a million-job partition's, the last one read, at most
  ``READ_DUTY`` times that read's seconds old: a scrape answers at once; before the
  process's first such read ends, no sample: ``_Lagging``);
- ``comfy_assets_prompt_seconds{server}``: histogram of our prompts' seconds, from the
  POST's answer to the prompt's end, of prompts that loaded no model;
- ``comfy_assets_model_load_seconds{server}``: histogram of what a model load added to
  its prompt (its seconds less the median prompt without a load: ``pool/plan.py``);
- ``comfy_assets_server_up{server}``: 1 when the server answered its last probe and its
  socket is not lost (``Pool.unreachable``), else 0;
- ``comfy_assets_server_quarantined{server}``: 1 while it is quarantined
  (``Store.server_quarantined``);
- ``comfy_assets_jobs_waiting{reason}``: the jobs left of the running batches by what
  they wait for (``render/steering.py``'s vocabulary).

``Metrics.serve(port)`` starts prometheus-client's HTTP server (a thread of its own);
what the store says is read at each scrape, on that thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from comfy_assets.render import run, steering
from comfy_assets.store import Store, StoreUnavailable

if TYPE_CHECKING:
    from comfy_assets.pool.pool import Pool
    from comfy_assets.pool.slot import Slot
    from comfy_assets.render.progress import Progress
    from comfy_assets.render.steering import Steering

log = logging.getLogger("comfy_assets.metrics")

# A read of the store's attempts that took longer than SLOW_READ_S (a million-job
# partition's) answers scrapes from its last result, read again in a thread of its own
# once READ_DUTY times its duration has passed; a quicker one is read at each scrape.
# A process's first read is in that thread too: a scrape waits SLOW_READ_S for it.
SLOW_READ_S = 0.1
READ_DUTY = 20.0

PROMPT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class Metrics(Collector):
    """The metrics of one process: ``track_pool`` for each pool (its prompts and its
    servers' state), ``track_store`` for the store to read jobs and attempts from (with
    the partitions it renders, None: all), ``waiting`` for each batch's reasons."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.prompt_seconds = self._server_histogram(
            "comfy_assets_prompt_seconds",
            "Seconds of a prompt of ours without a model load, POST answered to its end",
            PROMPT_BUCKETS,
        )
        self.model_load_seconds = self._server_histogram(
            "comfy_assets_model_load_seconds",
            "Seconds a model load added to its prompt",
            LOAD_BUCKETS,
        )
        self._lock = threading.Lock()
        self._pools: list[Pool] = []
        self._store: Store | None = None
        self._partitions: set[str] | None = None
        self._waiting: dict[int, tuple[tuple[str, int], ...]] = {}
        # Per (store, partitions read): the attempts' counts, read as ``_Lagging`` says.
        self._tries: dict[tuple[int, tuple[str, ...] | None], _Lagging] = {}
        self.registry.register(self)

    def _server_histogram(
        self, name: str, documentation: str, buckets: tuple[float, ...]
    ) -> Histogram:
        """A histogram of seconds labelled by ``server``, in this process's registry."""
        return Histogram(name, documentation, ["server"], buckets=buckets, registry=self.registry)

    # -- what is measured -------------------------------------------------------------

    def track_pool(self, pool: Pool) -> None:
        """Measure ``pool``'s prompts and report its servers (until ``forget_pool``)."""
        with self._lock:
            self._pools.append(pool)
        pool.prompt_listeners.append(self._prompt_ended)

    def forget_pool(self, pool: Pool) -> None:
        with self._lock:
            if pool in self._pools:
                self._pools.remove(pool)
        if self._prompt_ended in pool.prompt_listeners:
            pool.prompt_listeners.remove(self._prompt_ended)

    def track_store(self, store: Store, partition: str | None = None) -> None:
        """Read jobs and attempts from ``store``: of ``partition`` (and the others given
        so far), or of every partition when None."""
        with self._lock:
            self._store = store
            if partition is None:
                self._partitions = None
            else:
                self._partitions = (self._partitions or set()) | {partition}

    def waiting(self, batch_key: int, progress: Progress | None) -> None:
        """The jobs left of batch ``batch_key`` by reason (None: the batch ended)."""
        with self._lock:
            if progress is None:
                self._waiting.pop(batch_key, None)
            else:
                self._waiting[batch_key] = progress.waiting

    def _prompt_ended(self, slot: Slot, seconds: float) -> None:
        if slot.load_expected:
            plain = slot.pool.plan.estimates.prompt_s
            self.model_load_seconds.labels(slot.name).observe(max(seconds - plain, 0.0))
        else:
            self.prompt_seconds.labels(slot.name).observe(seconds)

    # -- the scrape ---------------------------------------------------------------------

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """What prometheus-client asks at each scrape (on its HTTP thread)."""
        with self._lock:
            pools = list(self._pools)
            store, partitions = self._store, self._partitions
            waiting = list(self._waiting.values())
        up = GaugeMetricFamily("comfy_assets_server_up", "1: the server answers", labels=["server"])
        quarantined = GaugeMetricFamily(
            "comfy_assets_server_quarantined", "1: the server is quarantined", labels=["server"]
        )
        for pool in pools:
            down = _unreachable(pool)
            for spec in pool.servers:
                up.add_metric([spec.name], 0.0 if spec.name in down else 1.0)
                q = store.server_quarantined(spec.name) if store is not None else False
                quarantined.add_metric([spec.name], 1.0 if q else 0.0)
        yield up
        yield quarantined
        by_reason: dict[str, int] = {}
        for reasons in waiting:
            for why, n in reasons:
                by_reason[why] = by_reason.get(why, 0) + n
        w = GaugeMetricFamily(
            "comfy_assets_jobs_waiting", "Jobs left by what they wait for", labels=["reason"]
        )
        for why, n in sorted(by_reason.items()):
            w.add_metric([why], float(n))
        yield w
        if store is None:
            return
        chosen = None if partitions is None else sorted(partitions)
        try:
            states = store.job_state_counts(chosen)
            key = (id(store), None if chosen is None else tuple(chosen))
            with self._lock:
                lagging = self._tries.get(key)
                if lagging is None:
                    lagging = _Lagging(lambda: store.attempt_outcome_counts(chosen))
                    self._tries[key] = lagging
            tries = lagging.get()
        except StoreUnavailable as e:
            log.warning("metrics: the store did not answer: %s", e)
            return
        jobs = GaugeMetricFamily("comfy_assets_jobs", "Jobs by state", labels=["state"])
        for state, n in sorted(states.items()):
            jobs.add_metric([state], float(n))
        yield jobs
        attempts = CounterMetricFamily(
            "comfy_assets_attempts",
            "Attempts by server and outcome (none until the process's first read of them"
            f" ends, if that takes over {SLOW_READ_S} s)",
            labels=["server", "outcome"],
        )
        for (server, outcome), n in sorted((tries or {}).items()):
            attempts.add_metric([server, outcome], float(n))
        yield attempts

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``port`` (a daemon thread) and watch every pool and batch
        made from now on. Raises OSError when the port can't be bound."""
        start_http_server(port, addr=addr, registry=self.registry)
        if self._watch_pool not in run.pool_watchers:
            run.pool_watchers.append(self._watch_pool)
            steering.watchers.append(self._watch_batch)

    def _watch_pool(self, pool: Pool, store: Store) -> None:
        self.track_pool(pool)
        with self._lock:
            if self._store is None:
                self._store = store

    def _watch_batch(self, batch: Steering, progress: Progress | None) -> None:
        if progress is None:
            self.waiting(id(batch), None)
            return
        with self._lock:
            known = id(batch) in self._waiting
        if not known:
            self.track_store(batch.batch.store, batch.batch.partition)
        self.waiting(id(batch), progress)


class _Lagging:
    """The answer of ``read()`` (a count over the store), read at each ``get`` while a
    read takes under ``SLOW_READ_S``; past that, ``get`` answers the last result at once
    and, once ``READ_DUTY`` times the last read's seconds have passed, reads again in a
    thread of its own (a failure there is logged, the last result kept).

    Before any result, ``get`` starts the read in that thread and waits ``SLOW_READ_S``
    for it: a quick read answers (or raises what ``read`` raised), a slow one (a
    million-job partition's) answers None, as does each ``get`` while it reads, and the
    next ``get`` after it ends answers its result (a read that failed meanwhile is
    logged and started again)."""

    def __init__(self, read: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._value: dict[tuple[str, str], int] | None = None
        self._read_at = 0.0  # time.monotonic() when the last read began
        self._took = 0.0  # its seconds
        self._thread: threading.Thread | None = None  # the read aside, while it reads
        self._failed: Exception | None = None  # what the first read aside raised

    def get(self) -> dict[tuple[str, str], int] | None:
        with self._lock:
            value, took, reading = self._value, self._took, self._thread is not None
            due = time.monotonic() - self._read_at >= READ_DUTY * took
            started = (value is None or (took >= SLOW_READ_S and due)) and not reading
            if started:
                self._failed = None
                self._thread = threading.Thread(
                    target=self._read_aside, name="metrics-read", daemon=True
                )
                self._thread.start()
            thread = self._thread
        if value is None:
            if thread is not None and started:
                thread.join(SLOW_READ_S)
            with self._lock:
                value, failed = self._value, self._failed
            if value is None and failed is not None and not (thread and thread.is_alive()):
                raise failed
            return value
        if took < SLOW_READ_S:
            return self._read_now()
        return value

    def _read_now(self) -> dict[tuple[str, str], int]:
        started = time.monotonic()
        value = self._read()
        with self._lock:
            self._value, self._read_at, self._took = value, started, time.monotonic() - started
        return value

    def _read_aside(self) -> None:
        try:
            self._read_now()
        except Exception as e:  # the store, whatever its driver: the last result stands
            log.warning("metrics: the store's attempts were not read: %s", e)
            with self._lock:
                self._failed = e
        finally:
            with self._lock:
                self._thread = None


def _unreachable(pool: Pool) -> dict[str, str]:
    """The pool's unreachable servers, read from another thread than the pool's loop."""
    for _ in range(3):
        try:
            return dict(pool.unreachable())
        except RuntimeError:  # the loop changed it while we read: read again
            continue
    return {}


# The process's metrics: ``run`` and ``worker`` serve it, batches and pools report to it.
METRICS = Metrics()
