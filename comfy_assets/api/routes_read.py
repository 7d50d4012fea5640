"""The routes that read: a job's files and events (live with ``Accept:
text/event-stream``), the servers' health, and the API's own liveness and readiness."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from comfy_assets.api.files import file_response, redirect_response
from comfy_assets.api.headers import last_event_id
from comfy_assets.api.routes_jobs import owned
from comfy_assets.api.shared import API, CLIENT, Api, error, json_response
from comfy_assets.api.streams import STREAM_RETRY_AFTER_S
from comfy_assets.api.views import current_files, event_view, iso
from comfy_assets.jobs.states import DONE, FAILED_FATAL
from comfy_assets.service import broker
from comfy_assets.store import StoreUnavailable, off_loop
from comfy_assets.store.api_jobs import ApiLedger

EVENT_STREAM = "text/event-stream"
KEEP_ALIVE_S = 15.0
READY_TIMEOUT_S = 3.0


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/jobs/{job_id}/files/{name:.+}", get_file)
    app.router.add_get("/v1/jobs/{job_id}/events", get_events)
    app.router.add_get("/v1/servers", get_servers)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)


async def get_file(request: web.Request) -> web.StreamResponse:
    """``GET /v1/jobs/{id}/files/{name}``: one file of the job's done record. From a
    folder store its bytes (``files.file_response``: ETag, ranges); from a store that
    presigns URLs, ``307`` to the file's presigned GET URL (``files.redirect_response``:
    no bytes through the API)."""
    api = request.app[API]
    job = await owned(request)
    name = request.match_info["name"]
    record = await off_loop(api.store, api.store.get, job.job_id)
    files = await off_loop(api.store, api.store.files, job.job_id)
    found = [f for f in current_files(record, files) if f.path == name]
    if record is None or not found:
        return error(404, f"job {job.job_id} has no file {name[:200]!r}")
    file_store = api.store.file_store
    url = file_store.output_url(record.partition, job.job_id, found[0])
    if url is not None:
        return await redirect_response(request, url, found[0].path, found[0].sha256, found[0].bytes)
    path = file_store.output_path(record.partition, job.job_id, found[0])
    try:
        if path is None:
            raise FileNotFoundError(name)
        return await file_response(request, path, found[0].sha256, found[0].bytes)
    except FileNotFoundError:
        return error(404, f"file {name[:200]!r} of job {job.job_id} is gone from the store")


def _ended(state: str) -> bool:
    return state in DONE or state == FAILED_FATAL


async def get_events(request: web.Request) -> web.StreamResponse:
    """``GET /v1/jobs/{id}/events``: ``{"events": [...]}`` oldest first; with ``Accept:
    text/event-stream``, a Server-Sent Events stream of them (``event: transition``,
    ``id`` the event's), live until the job ends (then ``event: end``). A stream
    resumed with ``Last-Event-ID`` starts after that event (400 for one that is not an
    event id: ``headers.last_event_id``). A client holding ``--max-streams`` streams
    already gets 429 with ``Retry-After``. A stream reads the store only when its job has
    new events (``streams.Changes`` wakes it)."""
    api = request.app[API]
    job = await owned(request)
    last_id = last_event_id(request.headers.get("Last-Event-ID"))  # 400 on any request
    if EVENT_STREAM not in request.headers.get("Accept", ""):
        events = await off_loop(api.store, api.store.events, job.job_id)
        return json_response({"events": [event_view(e) for e in events]})
    client = request[CLIENT]
    if not api.streams.enter(client):
        return json_response(
            {
                "message": f"too many event streams: at most {api.streams.per_client} open "
                "at once per client (--max-streams)"
            },
            status=429,
            headers={"Retry-After": str(STREAM_RETRY_AFTER_S)},
        )
    try:
        return await _stream(request, api, job.job_id, last_id)
    finally:
        api.streams.leave(client)


async def _stream(request: web.Request, api: Api, job_id: str, last_id: int) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": EVENT_STREAM, "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        with api.changes.watch(job_id) as changed:
            while True:
                changed.clear()  # a change from now on wakes the wait below
                events = await off_loop(api.store, api.store.events, job_id)
                for event in [e for e in events if (e.id or 0) > last_id]:
                    last_id = event.id or last_id
                    await response.write(_sse("transition", event_view(event), last_id))
                record = await off_loop(api.store, api.store.get, job_id)
                if record is not None and _ended(record.state):
                    end = {"state": str(record.state), "reason": record.reason}
                    await response.write(_sse("end", end, None))
                    break
                while not await _woken(changed, KEEP_ALIVE_S):
                    await response.write(b": keep-alive\n\n")
    except (ConnectionResetError, StoreUnavailable):
        return response  # the client left, or the store did: the stream just ends
    await response.write_eof()
    return response


async def _woken(changed: asyncio.Event, timeout_s: float) -> bool:
    """True once ``changed`` is set, False after ``timeout_s`` seconds without."""
    try:
        await asyncio.wait_for(changed.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


def _sse(kind: str, data: Any, event_id: int | None) -> bytes:
    lines = [f"event: {kind}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append("data: " + json.dumps(data, ensure_ascii=False))
    return ("\n".join(lines) + "\n\n").encode()


async def get_servers(request: web.Request) -> web.Response:
    """``GET /v1/servers``: each server's health as ``comfy-assets health --store`` sees
    it: the probe of the API's ``--server``s, and from the store each server's lease and
    its health as the workers judged it (state, quarantined until when, strikes).

    A failure's reason quotes the job that failed (its workflow's inputs, a node's
    error), and a server is shared by every client: the asking client gets only the
    reasons of its own jobs' failures there (``failures``), never the reason a
    quarantine or a strike names (``reason``, ``line`` of ``health --store``)."""
    api = request.app[API]
    client: str = request[CLIENT]
    leases = await off_loop(api.store, api.store.server_leases)
    servers: dict[str, dict[str, Any]] = {}
    if api.servers:
        from comfy_assets.comfy.health import probe_all

        probes = await asyncio.to_thread(probe_all, list(api.servers), api.probe_timeout_s)
        for probe in probes:
            servers[probe.spec.name] = {
                "name": probe.spec.name,
                "healthy": probe.healthy,
                "health": probe.line(),
                "queue": probe.queue_length,
                "lease": None,
                "store_health": None,
            }
    blank = {"healthy": None, "health": None, "queue": None, "lease": None, "store_health": None}
    for name, lease in sorted(leases.items()):
        entry = servers.setdefault(name, {"name": name, **blank})
        entry["lease"] = {
            "held": lease.held(api.store.now()),
            "expires_at": iso(lease.expires_at),
            "last_model": lease.last_model,
        }
    judged = await off_loop(api.store, api.store.server_health)
    failed = {job_id for record in judged.values() for job_id, _, _ in record.failed_jobs}
    own = await off_loop(api.ledger, _owned_ids, api.ledger, failed, client)
    for name, record in sorted(judged.items()):
        entry = servers.setdefault(name, {"name": name, **blank})
        entry["store_health"] = {
            "state": record.state,
            "until": iso(record.until),
            "strikes": record.strikes,
            "failures": [
                {"job_id": job_id, "reason": reason}
                for job_id, _, reason in record.failed_jobs
                if job_id in own
            ],
        }
    return json_response({"servers": [servers[n] for n in sorted(servers)]})


def _owned_ids(ledger: ApiLedger, job_ids: set[str], client: str) -> set[str]:
    """Those of ``job_ids`` that ``client`` submitted."""
    return {
        job_id
        for job_id in job_ids
        if (job := ledger.get(job_id)) is not None and job.client == client
    }


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: 200 while the process serves (liveness; no token needed)."""
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """``GET /readyz``: 200 when the store answers and the broker is connected, 503
    naming what is not (readiness; no token needed)."""
    api = request.app[API]
    problems: dict[str, str] = {}
    try:
        await asyncio.wait_for(asyncio.to_thread(_ping, api.store), READY_TIMEOUT_S)
    except Exception as e:  # any failure to answer is "not ready", said in the body
        problems["store"] = f"{type(e).__name__}: {e}"[:300]
    try:
        await asyncio.wait_for(api.publisher.ensure(), READY_TIMEOUT_S)
    except (broker.BrokerError, TimeoutError, OSError) as e:
        problems["broker"] = f"{type(e).__name__}: {e}"[:300]
    if problems:
        return json_response({"status": "not ready", "problems": problems}, status=503)
    return json_response({"status": "ready"})


def _ping(store: Any) -> None:
    with store.engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")
