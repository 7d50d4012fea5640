"""The routes that take and change jobs: ``POST /v1/jobs``, ``GET /v1/jobs/{id}``,
``POST /v1/jobs/{id}/cancel`` and ``POST /v1/jobs/{id}/requeue``.

``POST /v1/jobs`` answers 202 only once the job is durable: its rows in the store
(``comfy_api_jobs``, then the job itself, pending) and its message confirmed by the
broker. The same id with the same content answers 200 with the job as it is now (a
client retrying after a timeout: nothing is rendered twice); with a higher ``take`` and
nothing else changed, 202: a new take, rendered again (each take accepted once, in
order: an older take than the job's answers 409); with other content, 409 naming the
fields that differ. A job recorded whose message the broker did not confirm
(503) is published by the same request sent again, or by the API itself a few seconds
later (``publisher.republish_loop``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging

from aiohttp import web

from comfy_assets.api.interrupting import interrupt_prompt
from comfy_assets.api.publisher import publish_recorded
from comfy_assets.api.shared import API, CLIENT, Answer, Api, error, json_response
from comfy_assets.api.submission import (
    Invalid,
    Problem,
    Submission,
    differences,
    parse_submission,
)
from comfy_assets.api.tokens import partition_of
from comfy_assets.api.views import job_path, job_view
from comfy_assets.api.webhook_urls import RefusedUrl, check_url
from comfy_assets.jobs.model import is_job_id
from comfy_assets.jobs.states import FAILED_FATAL, REQUEUEABLE
from comfy_assets.jobs.strict_json import DuplicateKey, loads_bounded, no_duplicates
from comfy_assets.service import broker
from comfy_assets.store import PartitionConflict, StoreUnavailable, UnknownJob, off_loop
from comfy_assets.store.api_jobs import ApiJob

log = logging.getLogger("comfy_assets.api")

# A body larger than this is validated on a thread.
ON_A_THREAD_BYTES = 256 * 1024

NOT_CONFIRMED = (
    "recorded, but the queue did not confirm it ({why}); send the same request again "
    "(the API also publishes it again by itself)"
)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_post("/v1/jobs/{job_id}/cancel", cancel)
    app.router.add_post("/v1/jobs/{job_id}/requeue", requeue)


async def owned(request: web.Request) -> ApiJob:
    """The job of the path's ``{job_id}`` if the request's client owns it; raises a 404
    answer otherwise (another client's job is not told apart from none)."""
    api = request.app[API]
    job_id = request.match_info["job_id"]
    found = await off_loop(api.ledger, api.ledger.get, job_id) if is_job_id(job_id) else None
    if found is None or found.client != request[CLIENT]:
        raise Answer(error(404, f"no job {job_id[:80]}"))
    return found


async def current_view(api: Api, job: ApiJob) -> dict[str, object]:
    """``views.job_view`` of ``job`` as the store has it now."""
    record = await off_loop(api.store, api.store.get, job.job_id)
    files = await off_loop(api.store, api.store.files, job.job_id)
    attempts = await off_loop(api.store, api.store.attempts, job.job_id)
    return job_view(job, record, files, attempts, api.store.file_store)


def _invalid(problems: list[Problem]) -> web.Response:
    count = len(problems)
    return error(
        422,
        f"not a valid job: {count} problem{'' if count == 1 else 's'}",
        errors=[p.to_dict() for p in problems],
    )


async def submit(request: web.Request) -> web.Response:
    """``POST /v1/jobs`` (see the module docstring)."""
    api = request.app[API]
    client: str = request[CLIENT]
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
        obj = loads_bounded(functools.partial(json.loads, object_pairs_hook=no_duplicates), text)
    except DuplicateKey as e:  # as a job file's line: json.loads would keep the last
        return _invalid([Problem("", f"key {json.dumps(str(e))} repeated in an object")])
    except UnicodeDecodeError as e:
        return error(400, f"the body is not UTF-8: {e.reason}")
    except json.JSONDecodeError as e:
        return error(400, f"the body is not JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except (ValueError, RecursionError) as e:
        return error(400, f"the body is not usable JSON: {e}")
    problems: list[Problem] = []
    submission: Submission | None = None
    parse = functools.partial(
        parse_submission,
        obj,
        partition=partition_of(client),
        max_input_bytes=api.limits.max_input_bytes,
        max_message_bytes=api.limits.max_message_bytes,
    )
    try:
        # Input files in the body: decoding and hashing them is the loop's time otherwise.
        big = len(raw) > ON_A_THREAD_BYTES
        submission = await asyncio.to_thread(parse) if big else parse()
    except Invalid as e:
        problems += e.problems
    webhook = obj.get("webhook") if isinstance(obj, dict) else None
    if isinstance(webhook, str):
        problems += await _webhook_problems(api, webhook)
    if problems or submission is None:
        return _invalid(problems)
    return await _take(api, client, submission)


async def _webhook_problems(api: Api, url: str) -> list[Problem]:
    if api.webhook_key is None:
        return [
            Problem(
                "/webhook", "webhooks are off: the API was started without --webhook-secret-file"
            )
        ]
    try:
        await check_url(url, allow_private=api.allow_private_webhooks)
    except RefusedUrl as e:
        return [Problem("/webhook", f"refused: {e}")]
    return []


async def _take(api: Api, client: str, sub: Submission) -> web.Response:
    job = sub.job
    existing, known = await off_loop(api.ledger, api.ledger.lookup, job.id)
    if existing is None:
        if known:
            return error(409, f"job id {job.id} is in use by a job the API did not take")
        row = ApiJob(
            job_id=job.id,
            client=client,
            content=sub.content,
            message=sub.message,
            webhook=sub.webhook,
            created_at=api.ledger.now(),
        )
        try:
            taken, inserted = await off_loop(
                api.ledger, api.ledger.take, row, partition_of(client), job
            )
        except PartitionConflict:
            return error(409, f"job id {job.id} is in use by a job the API did not take")
        if not inserted:
            return await _again(api, client, sub, taken)  # another request was first
        try:
            await publish_recorded(api.ledger, api.publisher, job.id, sub.message, job.take)
        except broker.BrokerError as e:
            return _not_confirmed(e)
        # Just registered: pending, no attempt, no file (a worker may have started it
        # since; GET /v1/jobs/{id} says).
        view = job_view(taken, None, [], [])
        return json_response(view, status=202, headers={"Location": job_path(job.id)})
    return await _again(api, client, sub, existing)


async def _again(api: Api, client: str, sub: Submission, existing: ApiJob) -> web.Response:
    """A request for an id the API has taken already: 200, 409, or (not confirmed yet)
    published now."""
    if existing.client != client:
        return error(409, f"job id {sub.job.id} is in use")
    differ = differences(existing.content, sub.content)
    if differ == ["/take"] and sub.job.take > existing.take:
        return await _retake(api, client, sub, existing)
    if differ == ["/take"]:
        return error(
            409,
            f"job {sub.job.id} is at take {existing.take}: take {sub.job.take} is older "
            "(takes are accepted in order, each once)",
            differs=differ,
        )
    if differ:
        return error(
            409,
            f"job {sub.job.id} exists with other content: {', '.join(differ)} "
            f"differ{'s' if len(differ) == 1 else ''}",
            differs=differ,
        )
    if existing.published_at is None:
        try:
            await off_loop(
                api.store,
                api.store.register_jobs,
                partition_of(client),
                [sub.job],
                forward_only=True,  # a newer take may have been taken since
            )
            await publish_recorded(
                api.ledger, api.publisher, sub.job.id, existing.message, existing.take
            )
        except broker.BrokerError as e:
            return _not_confirmed(e)
        except PartitionConflict:
            return error(409, f"job id {sub.job.id} is in use by a job the API did not take")
    return json_response(await current_view(api, existing), status=200)


async def _retake(api: Api, client: str, sub: Submission, existing: ApiJob) -> web.Response:
    """The same job with a higher ``take``: rendered again (202), the earlier take's
    files kept (README, "Takes"). Its ending gets a webhook of its own. The take is
    compared again where it is recorded (``ApiLedger.retake``): a request that finds it
    taken meanwhile (the same take by a racing request, or a newer one) is answered as
    the row now says (200 or 409)."""
    again = dataclasses.replace(existing, content=sub.content, message=sub.message)
    if not await off_loop(api.ledger, api.ledger.retake, again, partition_of(client), sub.job):
        now = await off_loop(api.ledger, api.ledger.get, sub.job.id)
        assert now is not None  # rows of the API are never deleted
        return await _again(api, client, sub, now)
    try:
        await publish_recorded(api.ledger, api.publisher, sub.job.id, sub.message, sub.job.take)
    except broker.BrokerError as e:
        return _not_confirmed(e)
    view = await current_view(api, again)
    return json_response(view, status=202, headers={"Location": job_path(sub.job.id)})


def _not_confirmed(e: broker.BrokerError) -> web.Response:
    return json_response(
        {"message": NOT_CONFIRMED.format(why=e)}, status=503, headers={"Retry-After": "5"}
    )


async def get_job(request: web.Request) -> web.Response:
    """``GET /v1/jobs/{id}``: the job (``views.job_view``)."""
    job = await owned(request)
    return json_response(await current_view(request.app[API], job))


async def cancel(request: web.Request) -> web.Response:
    """``POST /v1/jobs/{id}/cancel``: a waiting job becomes a dead letter ``cancelled by
    <client>`` at once (200); a job whose prompt is in flight has its claim taken and its
    prompt removed and interrupted on its server (``interrupting``), then becomes that
    dead letter once its attempt has settled: 200 when that happened within
    ``CANCEL_WAIT_S``, else 202 (the API finishes it: ``cancel_loop``). 409 for a job
    that has already ended."""
    api = request.app[API]
    job = await owned(request)
    client = request[CLIENT]
    try:
        before, outcome = await off_loop(api.ledger, api.ledger.cancel, job.job_id, client)
    except UnknownJob:
        # Recorded by the API but not yet by the store: the request that took it, or the
        # API's own republishing, writes it in a moment.
        return error(409, f"job {job.job_id} is being recorded; cancel it again in a moment")
    if outcome == "ended":
        return error(409, f"job {job.job_id} has already ended ({before}); nothing cancelled")
    if outcome == "taken":
        record = await off_loop(api.store, api.store.get, job.job_id)
        if record is not None:
            done = await interrupt_prompt(api.servers, record.server, record.prompt_id)
            await off_loop(api.store, api.store.note, job.job_id, done)
        if not await _finished_cancel(api, job.job_id):
            return json_response(await current_view(api, job), status=202)
    return json_response(await current_view(api, job))


CANCEL_WAIT_S = 10.0
CANCEL_POLL_S = 0.1


async def _finished_cancel(api: Api, job_id: str) -> bool:
    """Wait up to ``CANCEL_WAIT_S`` for a taken job's attempt to settle, then make it
    the dead letter; True once it is one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CANCEL_WAIT_S
    while loop.time() < deadline:
        record = await off_loop(api.store, api.store.get, job_id)
        if record is None or record.state == FAILED_FATAL:
            return record is not None
        if await off_loop(api.ledger, api.ledger.finish_cancel, record):
            return True
        await asyncio.sleep(CANCEL_POLL_S)
    return False


async def cancel_loop(api: Api, every_s: float = 1.0) -> None:
    """Forever: finish the cancels whose attempt settled later than the request waited
    (or whose API was killed meanwhile: the taken claim is the record of the cancel)."""
    partitions = [partition_of(name) for name in api.clients.names]
    while True:
        try:
            for record in await off_loop(api.ledger, api.ledger.cancels, partitions):
                await off_loop(api.ledger, api.ledger.finish_cancel, record)
        except StoreUnavailable as e:
            log.warning("finishing cancels: %s; trying again", e)
        await asyncio.sleep(every_s)


async def requeue(request: web.Request) -> web.Response:
    """``POST /v1/jobs/{id}/requeue``: a dead letter, or a job degraded under the draft
    policy, goes back to pending and its message to the queue (202); 409 for a job in
    another state."""
    api = request.app[API]
    job = await owned(request)
    record = await off_loop(api.store, api.store.get, job.job_id)
    if record is None or record.state not in REQUEUEABLE:
        state = record.state if record is not None else "pending"
        return error(
            409,
            f"job {job.job_id} is neither a dead letter nor degraded ({state}); nothing requeued",
        )
    # Unmarked first: an API killed before the publish below publishes it on restart.
    await off_loop(api.ledger, api.ledger.mark_published, job.job_id, False)
    if not await off_loop(api.store, api.store.requeue, job.job_id):
        await off_loop(api.ledger, api.ledger.mark_published, job.job_id, True, job.take)
        return error(
            409,
            f"job {job.job_id} is neither a dead letter nor degraded any more; nothing requeued",
        )
    try:
        await publish_recorded(api.ledger, api.publisher, job.job_id, job.message, job.take)
    except broker.BrokerError as e:
        return _not_confirmed(e)
    return json_response(await current_view(api, job), status=202)
