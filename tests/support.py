"""Helpers shared by the runner, pool and batch tests: job files and fake servers."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp import web

import fake_comfy.fake
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.model import Job, JobFile
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.stream import JobScan
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.run import run_batch
from comfy_assets.render.summary import BatchSummary
from comfy_assets.store import Store, Via
from fake_comfy import FakeComfy
from tests.ports import free_port  # noqa: F401 (for the tests that import it here)

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "data" / "workflows"


def job_id(i: int, salt: str = "") -> str:
    """A stable lowercase UUID for job ``i`` of a test."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"comfy-assets-test:{salt}:{i}"))


def write_jobs(
    folder: Path,
    count: int,
    *,
    name: str = "jobs.jsonl",
    workflow: str = "image.json",
    salt: str = "",
    extra: Sequence[dict] | None = None,
) -> Path:
    """A job file of ``count`` image jobs (each its own colour) beside a copy of the
    workflow; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORKFLOWS / workflow, folder / workflow)
    lines = []
    for i in range(count):
        job = {"id": job_id(i, salt or name), "workflow": workflow, "set": {"1.color": 1000 + i}}
        if extra:
            job.update(extra[i])
        lines.append(json.dumps(job))
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


# Tiny delays and polls, so tests run fast without sleeping (a BatchConfig's and a
# ComfyPoolResource's fields alike).
FAST_TIMES: dict[str, object] = dict(
    base_delay_s=0.01,
    max_delay_s=0.05,
    jitter=False,
    timeout_s=30.0,
    poll_s=0.05,
    unhealthy_wait_s=0.05,
    probe_timeout_s=2.0,
)


def fast_config(**overrides: object) -> BatchConfig:
    """A BatchConfig with tiny delays and polls (``FAST_TIMES``), so tests run fast without
    sleeping; ``overrides`` replace any field."""
    values: dict = dict(attempts=4, lease_s=60.0, server_lease_s=30.0, **FAST_TIMES)
    values.update(overrides)
    return BatchConfig(**values)


@asynccontextmanager
async def fake_servers(*fakes: FakeComfy) -> AsyncIterator[list[ServerSpec]]:
    """Serve every fake in process; yields their specs gpu0, gpu1, ..."""
    async with AsyncExitStack() as stack:
        specs = []
        for i, fake in enumerate(fakes):
            url = await stack.enter_async_context(fake.serve(port=0))
            specs.append(ServerSpec(f"gpu{i}", url))
        yield specs


async def fast_batch(
    job_file: JobFile | JobScan,
    servers: Sequence[ServerSpec],
    store: Store,
    *,
    partition: str = "p",
    config: BatchConfig | None = None,
    **options: Any,
) -> BatchSummary:
    """``run_batch`` of ``job_file`` as ``partition`` over ``servers`` with ``config``
    (default ``fast_config()``); ``options``: run_batch's others (``on_line``, ``owner``, ...).
    Returns the summary."""
    return await run_batch(
        job_file,
        partition=partition,
        servers=servers,
        store=store,
        config=config or fast_config(),
        **options,
    )


async def batch_over_fakes(
    job_file: JobFile | JobScan,
    store: Store,
    *fakes: FakeComfy,
    partition: str = "p",
    config: BatchConfig | None = None,
    **options: Any,
) -> BatchSummary:
    """The fake-farm batch: serve ``fakes`` (gpu0, gpu1, ...) and run ``job_file`` over them
    with ``config`` (default ``fast_config()``: ``fast_batch``); returns the summary once the
    fakes are down."""
    async with fake_servers(*fakes) as servers:
        return await fast_batch(
            job_file, servers, store, partition=partition, config=config, **options
        )


@asynccontextmanager
async def fake_or_real_url(which: str, fake: FakeComfy) -> AsyncIterator[str]:
    """The base URL a contract test talks to: ``which`` "real", the ComfyUI at ``COMFYUI_URL``
    (the test skipped when it is unset); else ``fake``, served in process for the block."""
    if which == "real":
        url = os.environ.get("COMFYUI_URL")
        if not url:
            pytest.skip("COMFYUI_URL is not set")
        yield url
        return
    async with fake.serve(port=0) as url:
        yield url


def one_job(tmp_path: Path) -> tuple[JobFile, Job, Store]:
    """One image job written to ``tmp_path/jobs`` and a store at ``tmp_path/store``; returns
    the job file, its job and the store."""
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    return jf, jf.jobs[0], Store(tmp_path / "store")


def left_submitted_by_a_gone_run(tmp_path: Path) -> tuple[JobFile, Job, Store]:
    """What a killed run leaves: one job of ``tmp_path/jobs`` registered as "p" in
    ``tmp_path/store``, submitted to gpu0 as attempt 1 by an owner that is gone
    ("host:1:gone"), its claim released. Returns the job file, its job and the store."""
    jf, job, store = one_job(tmp_path)
    store.register_jobs("p", jf.jobs)
    store.claim_job(job.id, "host:1:gone", 60.0)
    store.transition(
        job.id, "submitted", via=Via(server="gpu0", attempt=1), prompt_id=job.prompt_id
    )
    store.release_claim(job.id, "host:1:gone")
    return jf, job, store


def assert_stored_as_served(
    store: Store, partition: str, job_id: str, on_server: dict[str, str]
) -> None:
    """Assert the job's two outputs are in the store, each with its sha256, and each the
    bytes the server holds under its name (``on_server``: file name to sha256)."""
    files = store.files(job_id)
    assert len(files) == 2, files
    for f in files:
        data = (store.job_dir(partition, job_id) / f.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256 == on_server[Path(f.path).name], f


def run_argv(jobs: Path, store: Path, servers: Sequence[str], *options: str) -> list[str]:
    """The arguments of ``comfy-assets run`` (``main``'s, or after ``-m comfy_assets.cli``):
    ``jobs`` over ``servers`` (``name=url`` each), recording in ``store``, then ``options``."""
    argv = ["run", "--jobs", str(jobs)]
    for server in servers:
        argv += ["--server", server]
    return [*argv, "--store", str(store), *options]


def start_fake_process(port: int, *args: str) -> subprocess.Popen[str]:
    """``python -m fake_comfy --port PORT ARGS`` as a process of its own (a server that
    can be killed as a host's is), returned once it says it listens."""
    argv = [sys.executable, "-m", "fake_comfy", "--port", str(port), *args]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and "listening" in proc.stdout.readline()
    return proc


def posted(fake: FakeComfy, prompt_id: str) -> int:
    return fake.stats["prompts"].get(prompt_id, {}).get("posted", 0)


def executed(fake: FakeComfy, prompt_id: str) -> int:
    return fake.stats["prompts"].get(prompt_id, {}).get("executed", 0)


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for ``condition`` to hold, looking every 10 ms; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


def running(fake: FakeComfy, prompt_id: str) -> bool:
    """The fake is executing ``prompt_id`` right now (a run without an outcome yet)."""
    return any(r["prompt_id"] == prompt_id and r["outcome"] is None for r in fake.stats["runs"])


def outcomes(fake: FakeComfy, prompt_id: str) -> list[str | None]:
    return [r["outcome"] for r in fake.stats["runs"] if r["prompt_id"] == prompt_id]


class BasicAuthGate:
    """An authenticating proxy in front of fakes (ComfyUI itself has no authentication):
    every request, /ws handshakes included, must carry ``Authorization: Basic``
    with the given user and password, else it is answered 401. ``allowed`` and
    ``refused`` count the requests."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.expected: dict[int, str] = {}  # id(fake) -> the header value it wants
        self.allowed = 0
        self.refused = 0
        build_app = fake_comfy.fake.build_app

        def gated(fake: FakeComfy) -> web.Application:
            app = build_app(fake)
            wanted = self.expected.get(id(fake))
            if wanted is not None:
                app.middlewares.append(self._middleware(wanted))
            return app

        monkeypatch.setattr(fake_comfy.fake, "build_app", gated)

    def protect(self, fake: FakeComfy, user: str, password: str) -> FakeComfy:
        """Require ``user``/``password`` on ``fake`` from its next ``serve()``."""
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.expected[id(fake)] = f"Basic {token}"
        return fake

    def _middleware(
        self, wanted: str
    ) -> Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable]:
        @web.middleware
        async def check(request: web.Request, handler):  # type: ignore[no-untyped-def]
            if request.headers.get("Authorization") != wanted:
                self.refused += 1
                return web.Response(
                    status=401, text="401 Unauthorized", headers={"WWW-Authenticate": "Basic"}
                )
            self.allowed += 1
            return await handler(request)

        return check


_WATCHERS: list[list[str]] = []
_AUDIT_HOOK_ADDED = False


def _on_audit(event: str, args: tuple) -> None:
    # Every open() and os.open() of the process raises the "open" audit event (PEP 578)
    # with the path before the file is touched.
    if event == "open" and _WATCHERS and isinstance(args[0], str | bytes | os.PathLike):
        path = os.path.realpath(os.fsdecode(args[0]))
        for seen in _WATCHERS:
            seen.append(path)


@contextmanager
def opened_files() -> Iterator[list[str]]:
    """Yields a list that fills with the real path of every file this process opens
    (any thread) until the block ends: proof that a file was, or was not, read."""
    global _AUDIT_HOOK_ADDED
    if not _AUDIT_HOOK_ADDED:
        sys.addaudithook(_on_audit)  # cannot be removed: it does nothing when unwatched
        _AUDIT_HOOK_ADDED = True
    seen: list[str] = []
    _WATCHERS.append(seen)
    try:
        yield seen
    finally:
        _WATCHERS.remove(seen)


def gone_owner(
    store: Store,
    owner: str = "gone-host:2:deadbeef",
    silent_s: float = 60.0,
    run_id: str | None = None,
) -> str:
    """An owner registered in ``store`` (rendering for the Dagster run ``run_id``) whose
    heartbeat stopped ``silent_s`` seconds ago, as a process killed with its host leaves it."""
    store.register_owner(owner, run_id=run_id, host=owner.split(":", 1)[0], pid=2)
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE comfy_owners SET beat_at = beat_at - :s WHERE owner = :o"),
            {"s": silent_s, "o": owner},
        )
    return owner
