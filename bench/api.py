"""The HTTP API under load: submissions per second and latency from concurrent clients,
then the same with the API SIGKILLed and restarted mid-run.

Real parts: ``comfy-assets api`` and ``comfy-assets worker`` as processes, a scratch
PostgreSQL database, the machine's RabbitMQ (a fresh queue), fake ComfyUI servers as
processes (``bench/common.py``). Each of ``--clients`` clients (its own token) submits
``--jobs-per-client`` jobs one after another with httpx; a request that gets no answer
(the API was killed under it) or a 503 is sent again, the same body, until it is
answered 202 or 200 (a retry of a job the API took answers 200: never a second render).
Latency is per answered request, retries included in the one that finally answered.

Once every accepted job is done, the fakes' own records (``/fake/stats``) say how many
times each job's prompt executed: ``rendered_once`` must equal ``accepted``, and
``rendered_twice`` and ``missing`` be 0.

    .venv/bin/python bench/api.py                        # 50 clients x 10 jobs, twice
    .venv/bin/python bench/api.py --clients 50 --jobs-per-client 20 --servers 4
    .venv/bin/python bench/api.py --measure streams,webhooks   # bench/api_isolation.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes, scratch_dir
from bench.throughput import scratch_database

ROOT = Path(__file__).resolve().parent.parent
AMQP = os.environ.get("COMFY_ASSETS_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
PG = os.environ.get("COMFY_ASSETS_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
WORKFLOW = json.loads((ROOT / "data/workflows/image.json").read_text())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "comfy_assets.cli", *(str(a) for a in args)]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], share: float) -> float:
    """The value below which ``share`` of ``values`` lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


class Run:
    """One measured run: the processes and what the clients saw."""

    def __init__(self, folder: Path, db_url: str, queue: str, port: int, specs: list[Any]) -> None:
        self.folder = folder
        self.db_url = db_url
        self.queue = queue
        self.port = port
        self.specs = specs
        self.api: subprocess.Popen[bytes] | None = None
        self.accepted: dict[str, int] = {}  # job id -> its colour (its own prompt)
        self.latencies: list[float] = []
        self.retries = 0
        self.kills = 0
        self.api_cpu_s = 0.0  # of the API processes killed or stopped so far

    def start_api(self, tokens: Path) -> None:
        log = (self.folder / "api.log").open("ab")
        self.api = subprocess.Popen(
            cli(
                "api", "--store", self.folder / "store", "--db-url", self.db_url,
                "--rabbitmq", AMQP, "--queue", self.queue,
                "--listen", f"127.0.0.1:{self.port}", "--tokens", tokens,
                "--rate-per-s", 100000, "--burst", 100000,
            ),
            cwd=ROOT, stdout=log, stderr=log,
        )  # fmt: skip

    def api_cpu(self) -> float:
        """CPU seconds (user + system) the running API has used."""
        assert self.api is not None
        return cpu_s(self.api.pid)

    def kill_api(self) -> None:
        assert self.api is not None
        self.api_cpu_s += self.api_cpu()
        self.api.send_signal(signal.SIGKILL)
        self.api.wait()
        self.kills += 1


async def wait_ready(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            try:
                if (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the API on port {port} was not ready within {timeout_s} s")


async def client(run: Run, token: str, jobs: int, colour0: int) -> None:
    """Submit ``jobs`` jobs one after another, each until it is answered 202 or 200."""
    headers = {"Authorization": f"Bearer {token}"}
    url = f"http://127.0.0.1:{run.port}/v1/jobs"
    async with httpx.AsyncClient(timeout=30) as http:
        for i in range(jobs):
            colour = colour0 + i
            body = {"id": str(uuid.uuid4()), "workflow": WORKFLOW, "set": {"1.color": colour}}
            started = time.monotonic()
            while True:
                try:
                    answer = await http.post(url, json=body, headers=headers)
                except httpx.TransportError:
                    answer = None
                if answer is not None and answer.status_code in (200, 202):
                    break
                if answer is not None and answer.status_code not in (503,):
                    raise RuntimeError(f"{answer.status_code}: {answer.text}")
                run.retries += 1
                await asyncio.sleep(0.05)
            run.latencies.append(time.monotonic() - started)
            run.accepted[body["id"]] = colour


async def killer(run: Run, tokens: Path, after: int) -> None:
    """SIGKILL the API once ``after`` jobs were accepted, then start it again."""
    while len(run.accepted) < after:
        await asyncio.sleep(0.01)
    run.kill_api()
    run.start_api(tokens)
    await wait_ready(run.port)


def done_count(db_url: str, job_ids: list[str]) -> int:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT count(*) FROM comfy_jobs WHERE state = 'succeeded' AND job_id = ANY(:ids)"
                ),
                {"ids": job_ids},
            )
            return int(rows.scalar_one())
    finally:
        engine.dispose()


def executions(specs: list[Any]) -> dict[str, int]:
    """prompt_id -> times executed, summed over the fakes."""
    total: dict[str, int] = {}
    for s in specs:
        with urllib.request.urlopen(f"{s.url}/fake/stats") as r:
            for prompt_id, entry in json.load(r)["prompts"].items():
                total[prompt_id] = total.get(prompt_id, 0) + entry.get("executed", 0)
    return total


def prompt_ids(db_url: str, job_ids: list[str]) -> dict[str, str]:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT job_id, prompt_id FROM comfy_jobs WHERE job_id = ANY(:ids)"),
                {"ids": job_ids},
            )
            return {r.job_id: r.prompt_id for r in rows}
    finally:
        engine.dispose()


async def one_run(args: argparse.Namespace, name: str, kill: bool) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix=f"bench-api-{name}-"))
    tokens = folder / "tokens"
    names = [f"client{i}" for i in range(args.clients)]
    tokens.write_text("".join(f"{n}:{n}-token-{uuid.uuid4().hex}\n" for n in names))
    secrets = dict(line.split(":", 1) for line in tokens.read_text().splitlines())
    queue = f"bench-api-{uuid.uuid4().hex[:8]}"
    total = args.clients * args.jobs_per_client
    with (
        scratch_database(PG) as db_url,
        fake_processes(args.servers, args.prompt_s, scratch_dir()) as specs,
    ):
        run = Run(folder, db_url, queue, free_port(), specs)
        servers = [a for s in specs for a in ("--server", f"{s.name}={s.url}")]
        worker_log = (folder / "worker.log").open("wb")
        worker = subprocess.Popen(
            cli("worker", "--rabbitmq", AMQP, "--queue", queue, *servers,
                "--store", folder / "store", "--db-url", db_url, "--poll-s", 0.05),
            cwd=ROOT, stdout=worker_log, stderr=worker_log,
        )  # fmt: skip
        run.start_api(tokens)
        try:
            await wait_ready(run.port)
            cpu_before = run.api_cpu()
            started = time.monotonic()
            tasks = [
                client(run, secrets[n], args.jobs_per_client, i * args.jobs_per_client)
                for i, n in enumerate(names)
            ]
            if kill:
                tasks.append(killer(run, tokens, total // 3))
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - started
            api_cpu_s = run.api_cpu_s + run.api_cpu() - cpu_before
            ids = list(run.accepted)
            deadline = time.monotonic() + args.render_timeout_s
            while done_count(db_url, ids) < len(ids) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            by_job = prompt_ids(db_url, ids)
            executed = executions(specs)
        finally:
            if run.api is not None:
                run.api.terminate()
                run.api.wait(30)
            worker.terminate()
            worker.wait(60)
            subprocess.run(
                [sys.executable, "-c", DELETE_QUEUES, AMQP, queue], cwd=ROOT, check=False
            )
    counts = [executed.get(by_job.get(j, ""), 0) for j in ids]
    lat = sorted(run.latencies)
    return {
        f"{name}_accepted": len(ids),
        f"{name}_submissions_per_s": round(len(ids) / elapsed, 1),
        f"{name}_p50_ms": round(statistics.median(lat) * 1000, 1),
        f"{name}_p99_ms": round(percentile(lat, 0.99) * 1000, 1),
        f"{name}_api_cpu_ms_per_submission": round(api_cpu_s * 1000 / max(1, len(ids)), 2),
        f"{name}_retries": run.retries,
        f"{name}_api_kills": run.kills,
        f"{name}_rendered_once": sum(1 for c in counts if c == 1),
        f"{name}_rendered_twice": sum(1 for c in counts if c > 1),
        f"{name}_missing": sum(1 for c in counts if c == 0),
    }


DELETE_QUEUES = """
import asyncio, sys, aio_pika
async def main():
    async with await aio_pika.connect(sys.argv[1]) as c:
        ch = await c.channel()
        for q in (sys.argv[2], sys.argv[2] + ".dead"):
            await ch.queue_delete(q)
asyncio.run(main())
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--jobs-per-client", type=int, default=10)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--prompt-s", type=float, default=0.01)
    p.add_argument("--render-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--measure",
        default="submissions",
        help="what to measure, comma-separated: submissions (steady, then the API killed), "
        "streams (another client's GETs while one holds --streams), webhooks (a healthy "
        "receiver's delay while --hanging-receivers hang); default submissions",
    )
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--gets", type=int, default=500)
    p.add_argument("--hanging-receivers", type=int, default=100)
    p.add_argument("--healthy-jobs", type=int, default=5)
    args = p.parse_args()
    measures = set(args.measure.split(","))
    unknown = measures - {"submissions", "streams", "webhooks"}
    if unknown:
        p.error(f"--measure: unknown {', '.join(sorted(unknown))}")
    if "submissions" in measures:
        print(
            f"clients={args.clients} jobs_per_client={args.jobs_per_client} servers={args.servers}"
        )
        for name, kill in (("steady", False), ("killed", True)):
            show(asyncio.run(one_run(args, name, kill)))
    from bench.api_isolation import streams_run, webhooks_run

    if "streams" in measures:
        show(asyncio.run(streams_run(args.streams, args.gets)))
    if "webhooks" in measures:
        show(asyncio.run(webhooks_run(args.hanging_receivers, args.healthy_jobs, args.prompt_s)))


def show(figures: dict[str, float]) -> None:
    for key, value in figures.items():
        print(f"{key}={value}", flush=True)


if __name__ == "__main__":
    main()
