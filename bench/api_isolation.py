"""One client's load against another's service (``bench/api.py --measure streams`` and
``--measure webhooks``).

streams: a client ("holder") opens ``--streams`` live event streams of a job no worker
renders (so they stay open), while another client ("reader") sends ``--gets`` GETs of
its own job one after another; the reader's p50 and p99 are printed with no stream open
and with the holder's streams open, side by side, with the API's CPU while the streams
sit idle, and the answer to one stream more than ``--max-streams``.

webhooks: a client ("hostile") submits one job per ``--hanging-receivers`` receivers,
127.0.0.1 listeners that accept and never answer; once they hold its share of the
outbox, another client ("healthy") submits jobs one after another, each with a webhook
to a receiver that answers 204 at once: the delay from each job's ``finished_at`` to
its webhook's arrival is printed (median and max), with the hanging connections held.

Real parts as in ``bench/api.py``: ``comfy-assets api`` (and ``worker`` for webhooks) as
processes, a scratch PostgreSQL database, the machine's RabbitMQ, fake servers.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from bench.api import (
    AMQP,
    DELETE_QUEUES,
    PG,
    ROOT,
    WORKFLOW,
    cli,
    cpu_s,
    free_port,
    percentile,
    wait_ready,
)
from bench.common import fake_processes, scratch_dir
from bench.throughput import scratch_database


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (the API and worker started
    from here inherit it: a stream or a hanging delivery is a socket each); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@asynccontextmanager
async def api_process(
    folder: Path, db_url: str, names: list[str], *extra: object
) -> AsyncIterator[tuple[int, dict[str, str], subprocess.Popen[bytes]]]:
    """``comfy-assets api`` for clients ``names`` on a fresh queue: (port, token by name,
    the process)."""
    tokens = folder / "tokens"
    secrets = {n: f"{n}-token-{uuid.uuid4().hex}" for n in names}
    tokens.write_text("".join(f"{n}:{t}\n" for n, t in secrets.items()))
    port = free_port()
    log = (folder / "api.log").open("ab")
    proc = subprocess.Popen(
        cli(
            "api", "--store", folder / "store", "--db-url", db_url,
            "--rabbitmq", AMQP, "--queue", folder.name,
            "--listen", f"127.0.0.1:{port}", "--tokens", tokens,
            "--rate-per-s", 100000, "--burst", 100000, *extra,
        ),
        cwd=ROOT, stdout=log, stderr=log,
    )  # fmt: skip
    try:
        await wait_ready(port)
        yield port, secrets, proc
    finally:
        proc.terminate()
        proc.wait(30)
        subprocess.run(
            [sys.executable, "-c", DELETE_QUEUES, AMQP, folder.name], cwd=ROOT, check=False
        )


async def submit(http: httpx.AsyncClient, token: str, colour: int, **fields: Any) -> str:
    body = {"id": str(uuid.uuid4()), "workflow": WORKFLOW, "set": {"1.color": colour}, **fields}
    answer = await http.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"})
    if answer.status_code != 202:
        raise RuntimeError(f"POST /v1/jobs: {answer.status_code} {answer.text}")
    return str(body["id"])


async def open_stream(port: int, token: str, job_id: str) -> tuple[int, asyncio.StreamWriter]:
    """A raw stream request (one socket, no client library's cost): its status code and
    the open connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        (
            f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
        ).encode()
    )
    status = int((await reader.readline()).split()[1])
    return status, writer


async def gets(http: httpx.AsyncClient, token: str, job_id: str, count: int) -> list[float]:
    """Latencies (seconds) of ``count`` GETs of ``job_id``, one after another."""
    headers = {"Authorization": f"Bearer {token}"}
    found = []
    for _ in range(count):
        started = time.perf_counter()
        answer = await http.get(f"/v1/jobs/{job_id}", headers=headers)
        found.append(time.perf_counter() - started)
        if answer.status_code != 200:
            raise RuntimeError(f"GET: {answer.status_code} {answer.text}")
    return found


async def streams_run(streams: int, count: int) -> dict[str, float]:
    """The streams measurement (see the module docstring)."""
    limit = raise_fd_limit()
    if limit < streams * 2 + 200:
        raise SystemExit(f"open files limited to {limit}: too few for {streams} streams")
    folder = Path(tempfile.mkdtemp(prefix="bench-api-streams-"))
    with scratch_database(PG) as db_url:
        names = ["holder", "reader"]
        async with api_process(folder, db_url, names, "--max-streams", streams) as (
            port,
            tokens,
            proc,
        ):
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                held = await submit(http, tokens["holder"], 1)
                mine = await submit(http, tokens["reader"], 2)
                await gets(http, tokens["reader"], mine, 50)  # warm
                quiet = await gets(http, tokens["reader"], mine, count)
                opening = asyncio.Semaphore(50)  # within the listen backlog

                async def one() -> tuple[int, asyncio.StreamWriter]:
                    async with opening:
                        return await open_stream(port, tokens["holder"], held)

                opened = await asyncio.gather(*(one() for _ in range(streams)))
                ok = sum(1 for status, _ in opened if status == 200)
                extra, extra_writer = await open_stream(port, tokens["holder"], held)
                extra_writer.close()
                before = cpu_s(proc.pid)
                await asyncio.sleep(5.0)  # the streams sit idle: what do they cost?
                idle_cpu = (cpu_s(proc.pid) - before) / 5.0
                loaded = await gets(http, tokens["reader"], mine, count)
                for _, writer in opened:
                    writer.close()
    ms = 1000.0
    return {
        "streams_open": ok,
        "stream_past_cap_status": extra,
        "api_cpu_percent_streams_idle": round(idle_cpu * 100, 1),
        "get_p50_ms_no_streams": round(statistics.median(quiet) * ms, 2),
        "get_p50_ms_with_streams": round(statistics.median(loaded) * ms, 2),
        "get_p99_ms_no_streams": round(percentile(quiet, 0.99) * ms, 2),
        "get_p99_ms_with_streams": round(percentile(loaded, 0.99) * ms, 2),
    }


async def webhooks_run(hanging: int, healthy_jobs: int, prompt_s: float) -> dict[str, float]:
    """The webhooks measurement (see the module docstring)."""
    raise_fd_limit()
    connections = [0]
    held = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        await held.wait()
        writer.close()

    hangers = [await asyncio.start_server(hang, "127.0.0.1", 0) for _ in range(hanging)]
    arrived: asyncio.Queue[tuple[float, dict[str, Any]]] = asyncio.Queue()

    async def receive(request: web.Request) -> web.Response:
        await arrived.put((time.time(), json.loads(await request.read())))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    hook_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", hook_port).start()
    folder = Path(tempfile.mkdtemp(prefix="bench-api-webhooks-"))
    secret = folder / "secret"
    secret.write_text("a webhook secret for the bench, long enough\n")
    delays: list[float] = []
    try:
        with (
            scratch_database(PG) as db_url,
            fake_processes(2, prompt_s, scratch_dir()) as specs,
        ):
            servers = [a for s in specs for a in ("--server", f"{s.name}={s.url}")]
            worker_log = (folder / "worker.log").open("wb")
            worker = subprocess.Popen(
                cli("worker", "--rabbitmq", AMQP, "--queue", folder.name, *servers,
                    "--store", folder / "store", "--db-url", db_url, "--poll-s", 0.05),
                cwd=ROOT, stdout=worker_log, stderr=worker_log,
            )  # fmt: skip
            extra = ["--webhook-secret-file", secret, "--allow-private-webhooks"]
            try:
                async with (
                    api_process(folder, db_url, ["hostile", "healthy"], *extra) as (
                        port,
                        tokens,
                        _,
                    ),
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http,
                ):
                    for i, server in enumerate(hangers):
                        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
                        await submit(http, tokens["hostile"], 1000 + i, webhook=url)
                    deadline = time.monotonic() + 300
                    while connections[0] < min(hanging, 4) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)  # until the hostile client's share hangs
                    for i in range(healthy_jobs):
                        url = f"http://127.0.0.1:{hook_port}/hook"
                        await submit(http, tokens["healthy"], 5000 + i, webhook=url)
                        at, payload = await asyncio.wait_for(arrived.get(), 600)
                        finished = datetime.fromisoformat(payload["data"]["finished_at"])
                        delays.append(at - finished.timestamp())
            finally:
                worker.terminate()
                worker.wait(60)
    finally:
        held.set()
        for server in hangers:
            server.close()
        await runner.cleanup()
    return {
        "hanging_receivers": hanging,
        "hanging_connections_opened": connections[0],
        "healthy_webhooks": len(delays),
        "healthy_webhook_delay_p50_ms": round(statistics.median(delays) * 1000, 1),
        "healthy_webhook_delay_max_ms": round(max(delays) * 1000, 1),
    }
