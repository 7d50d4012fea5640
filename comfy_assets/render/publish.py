"""What a running batch writes to the store every few seconds for ``comfy-assets status``
(``store/live.py``): its partition's counts, estimate and the jobs it holds back with
their reasons, and each server of its pool: what it renders now (job, partition, since
when, how far) or why it is not used (unreachable, quarantined, another client's queue).
Everything is looked at in one moment (no await), the moment of the ``Progress`` given.

The detail of a partition row::

    {"total", "done", "dead_lettered", "remaining", "estimate_s",
     "held": {job_id: {"reason", "until", "upstream", "server"}},
     "groups": [{"servers": [...can run...], "holding": [...], "jobs": [ids] or None}],
     "let_go": {job_id: "degraded" | "dead_lettered" | "not_run"}}

``held`` names the jobs in backoff (``until``: epoch seconds), those waiting for their
upstream jobs (``upstream``: ids) and those whose catch-up waits for the server of their
last POST to answer (``catch-up``: ``server``, and ``until`` when they are posted anew);
``let_go`` the jobs it resolved other than done (up to ``MAX_IDS``), which it does not
take up again: one requeued while the batch runs waits for the next run; ``groups`` the
servers that can run each group of waiting jobs (lacking none of its
nodes and models, as far as known) and those holding its models (none for a group that
loads no model), with the jobs' ids up to ``MAX_IDS`` in all. A server row: ``{"state": "rendering" | "free" | "unreachable" | "quarantined" |
"trial" | "busy", "job", "partition", "since", "progress", "reason", "foreign_queue"}``:
"rendering" while a prompt of ours is on it (posted, or being posted), so a job whose
prompt ended and whose outputs are downloading is not named; "trial" for a server on
trial whose one job failed there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from comfy_assets.comfy.capabilities import Needs
from comfy_assets.pool.plan import models_of
from comfy_assets.store import StoreUnavailable
from comfy_assets.store.retry import off_loop

if TYPE_CHECKING:
    from comfy_assets.pool.pool import Pool
    from comfy_assets.render.attempt import Attempt
    from comfy_assets.render.batch import Batch
    from comfy_assets.render.progress import Progress
    from comfy_assets.store import Store

MAX_IDS = 2000  # job ids a partition row names at most (rows stay small)
POSTED_SILENT = "posted, nothing heard of it since"
V = TypeVar("V")

log = logging.getLogger(__name__)


def rows(batch: Batch, progress: Progress) -> dict[tuple[str, str], dict[str, Any]]:
    """The rows ``batch`` publishes now (``Store.publish_live``)."""
    pool = batch.pool
    loop_now = asyncio.get_running_loop().time()
    wall_now = time.time()
    held: dict[str, dict[str, Any]] = {}
    for item, when in batch.queue.later():
        if item.job.id in batch.admission.told_held:
            continue  # another process's claim: the store says whose
        held[item.job.id] = {
            "reason": "in backoff",
            "until": wall_now + max(when - loop_now, 0.0),
            "server": item.prev_server,
        }
    for job_id, item in list(batch.chain.parked.items()):
        held[job_id] = {"reason": "upstream", "upstream": list(item.job.depends_on)}
    for attempt in list(batch.attempts.values()):
        if attempt.catching_up is not None:
            name, give_up_at = attempt.catching_up
            left = max(give_up_at - time.monotonic(), 0.0)
            held[attempt.job.id] = {"reason": "catch-up", "server": name, "until": wall_now + left}
    groups: dict[Needs, list[str]] = {}
    named = 0
    for item in batch.queue.ready:
        ids = groups.setdefault(batch.queue.needs(item), [])
        if named < MAX_IDS:
            ids.append(item.job.id)
            named += 1
    group_rows = []
    for needs, ids in groups.items():
        # Every server "holds" the empty set of models: a group that loads none waits for
        # a server, not for one holding its model.
        holding = [s.name for s in pool.servers if pool.plan.fits(s.name, needs)]
        group_rows.append(
            {
                # Those lacking nothing by their /object_info, or not read yet (a batch's
                # first rows come before its servers are read); unreachable ones too: their
                # own rows say so.
                "servers": [s.name for s in pool.servers if pool.lacks(s.name, needs) is None],
                "holding": holding if models_of(needs) else [],
                "jobs": ids,
            }
        )
    out: dict[tuple[str, str], dict[str, Any]] = {
        ("partition", batch.partition): {
            "total": progress.total,
            "done": progress.done,
            "dead_lettered": progress.dead_lettered,
            "remaining": progress.remaining,
            "estimate_s": progress.estimate_s,
            "held": _bounded(held),
            "groups": group_rows,
            "let_go": _bounded(batch.let_go),
        }
    }
    out.update(server_rows(batch.pool, rendering_rows(batch)))
    return out


async def publish_servers(
    store: Store, owner: str, pool: Pool, batches: Collection[Batch], every_s: float
) -> None:
    """A worker's rows for ``comfy-assets status``: every ``every_s`` seconds until
    cancelled, the row of each server of ``pool`` (``server_rows``), with the prompts of
    ``batches`` (its messages' batches, one job each: they write no rows of their own),
    as ``owner``'s rows. A database away only skips a write (logged): the jobs' own
    store calls meet the outage and decide. The caller clears the rows at its end."""
    while True:
        rendering: dict[str, dict[str, Any]] = {}
        for batch in list(batches):
            rendering.update(rendering_rows(batch))
        rows = server_rows(pool, rendering)  # one moment: no await before this
        try:
            await off_loop(store, store.publish_live, owner, rows)
        except StoreUnavailable as e:
            log.warning("status rows of worker %s not written: %s", owner, e)
        await asyncio.sleep(every_s)


def rendering_rows(batch: Batch) -> dict[str, dict[str, Any]]:
    """The row of each server of ``batch``'s pool where a prompt of ``batch`` is now
    (posted, or being posted): ``{server: {"state": "rendering", "job", "partition",
    "since" (epoch seconds, None before the POST), "progress"}}``."""
    loop_now = asyncio.get_running_loop().time()
    wall_now = time.time()
    running: dict[str, dict[str, Any]] = {}
    for name, attempt in batch.prompts().items():
        slot = attempt.slot
        assert slot is not None  # held: ``Batch.prompts``
        running[name] = {
            "state": "rendering",
            "job": attempt.job.id,
            "partition": batch.partition,
            "since": None if slot.posted_at is None else wall_now - (loop_now - slot.posted_at),
            "progress": prompt_progress(batch, name, attempt),
        }
    return running


def server_rows(
    pool: Pool, rendering: Mapping[str, dict[str, Any]]
) -> dict[tuple[str, str], dict[str, Any]]:
    """A row for each server of ``pool``: its ``rendering`` row (``rendering_rows``)
    while the server's socket is open, else why it is not used, else free or busy with
    another client's queue (the module's docstring gives the shapes)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    unreachable = pool.unreachable()
    for spec in pool.servers:
        name = spec.name
        follower = pool.open_follower(name)
        row: dict[str, Any]
        # Our prompt there is rendering while its socket is open (a probe that timed out
        # meanwhile does not stop it); once the socket is lost, nobody can follow it.
        if name in rendering and (follower is None or follower.lost() is None):
            row = dict(rendering[name])
        elif (blocked := pool.blocked(name)) is not None:  # the pool's view of the health rows
            # "quarantined until ...", or a server on trial whose one job failed there.
            state = "quarantined" if blocked.startswith("quarantined") else "trial"
            row = {"state": state, "reason": blocked}
        elif name in unreachable:
            row = {
                "state": "unreachable",
                "reason": unreachable[name].removeprefix("unreachable: "),
            }
        else:
            foreign = _foreign_queue(pool, name)
            row = {"state": "busy", "foreign_queue": foreign} if foreign else {"state": "free"}
        out[("server", name)] = row
    return out


def prompt_progress(batch: Batch, name: str, attempt: Attempt) -> str:
    """How far ``attempt``'s prompt on server ``name`` is, by that server's socket
    (``node 3/7 KSampler, step 14/20``: ``comfy/progress.py``); until the server has
    said anything of it, "posting" before its POST is answered and "posted, nothing
    heard of it since" after (queued behind another client's prompt, say, or a server
    that stopped executing)."""
    follower = batch.pool.open_follower(name)
    where = follower.progress(attempt.job.prompt_id) if follower is not None else None
    if where is not None:
        return where.describe(attempt.job.workflow)
    slot = attempt.slot
    return "posting" if slot is None or slot.posted_at is None else POSTED_SILENT


def _bounded(by_id: Mapping[str, V]) -> dict[str, V]:
    if len(by_id) <= MAX_IDS:
        return dict(by_id)
    return dict(list(by_id.items())[:MAX_IDS])


def _foreign_queue(pool: Pool, name: str) -> int:
    """Prompts of other clients on ``name`` by its socket (0 when not known)."""
    follower = pool.open_follower(name)
    remaining = follower.queue_remaining() if follower is not None else None
    return remaining or 0
