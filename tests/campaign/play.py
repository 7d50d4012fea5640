"""Playing a schedule: fakes (each maybe behind a FaultProxy, maybe restarted mid-prompt),
``comfy-assets run`` as subprocesses (``python -m comfy_assets.cli run``), or the
in-process worker, and everything the invariants need afterwards.

``play(schedule, folder)`` writes the job files of the schedule's plan (and the input
pictures beside them), and returns a ``Played``: per phase its store, job files, runs
(arguments, exit status, stdout, stderr, whether it was SIGKILLed) and the sha256 of
every file on every server when the phase ended; the fakes' records (``FakeComfy.stats``)
and what each fake still had queued or running of ours once every run had ended.

A schedule with an object store (``Schedule.object_store``) gets a SeaweedFS of its own
(``weed mini``, in the schedule's folder) behind an ``S3FaultProxy`` playing its faults;
the phase's store keeps its records in its folder and its outputs in that bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from PIL import Image

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.results import results_key
from comfy_assets.service.sources import MemorySource
from comfy_assets.service.worker import Worker, job_messages
from comfy_assets.store import Store
from comfy_assets.store.files import FileStore, S3FileStore, S3Settings
from fake_comfy import FakeComfy
from fake_comfy.proxy import FaultProxy
from tests import s3_server
from tests.campaign.schedule import HUGE_CHARS, PICTURES, Schedule, ServerPlan, StorePlan
from tests.s3_fault_proxy import S3FaultProxy
from tests.support import ROOT, WORKFLOWS, job_id, write_jobs

RUN_TIMEOUT_S = 120.0  # a run that has not ended by then is a violation (and killed)
IDLE_TIMEOUT_S = 10.0
_LOOK_S = 0.005  # how often the controller threads look at the fakes' records


@dataclass
class RunOutput:
    """One ``comfy-assets run`` (or the worker: ``args == ["worker"]``)."""

    args: list[str]
    jobs: Path
    returncode: int | None
    stdout: str
    stderr: str
    killed: bool = False  # SIGKILLed on purpose
    stopped: bool = False  # SIGTERMed on purpose
    timed_out: bool = False


@dataclass
class Phase:
    """Runs sharing one store; ``server_bytes[name][path] = sha256`` when it ended."""

    store: Path
    job_files: list[Path]
    runs: list[RunOutput] = field(default_factory=list)
    # Per server, the phase's runs are stats["runs"][first_run[i]:end_run[i]], and its
    # POSTs stats["posts"][first_post[i]:end_post[i]].
    first_run: list[int] = field(default_factory=list)
    end_run: list[int] = field(default_factory=list)
    first_post: list[int] = field(default_factory=list)
    end_post: list[int] = field(default_factory=list)
    server_bytes: dict[str, dict[str, str]] = field(default_factory=dict)
    worker: dict[str, Any] | None = None
    # sigterm: per server, our prompts still queued or running once the stopped run exited
    left_after_stop: dict[str, list[str]] = field(default_factory=dict)
    # The store's files when they are an object store's (None: the store's folder), and
    # then, read from the server before it stopped: "<job id>/<path>" of every output its
    # records list -> the sha256 of the object's bytes (None: no such object).
    file_store: FileStore | None = None
    stored: dict[str, str | None] = field(default_factory=dict)
    # An object store's results.csv of each partition (its text), read before it stopped.
    results_csv: dict[str, str | None] = field(default_factory=dict)


@dataclass
class Played:
    """What happened (see the module docstring)."""

    schedule: Schedule
    phases: list[Phase]
    stats: dict[str, dict[str, Any]]  # server name -> FakeComfy.stats at the end
    busy_clients: dict[str, str]  # server name -> the client_id of its busy=N prompts
    ours_left: dict[str, list[str]]  # server name -> our prompt_ids queued or running at the end
    not_idle: dict[str, str]  # server name -> why it was not idle within IDLE_TIMEOUT_S
    proxies: dict[str, dict[str, int]]
    restarts: dict[str, int]
    errors: list[str] = field(default_factory=list)  # the harness's own failures
    # The object store's fault proxy: requests by what became of them (S3FaultProxy.counts)
    object_store: dict[str, int] = field(default_factory=dict)

    def tally(self) -> dict[str, int]:
        """What fired: proxy cuts, 404s and lost answers, restarts, SIGKILLs, SIGTERMs
        (runs stopped, or that ended before the signal), and how the
        runs' prompts ended on the fakes (``runs_<outcome>``)."""
        counts = {"cut": 0, "view_404": 0, "lost_answers": 0}
        for stats in self.proxies.values():
            for name in counts:
                counts[name] += stats[name]
        for what in ("down", "cut", "slowdown"):
            if self.object_store:
                counts[f"s3_{what}"] = self.object_store.get(what, 0)
        counts["restarts"] = sum(self.restarts.values())
        counts["sigkills"] = sum(r.killed for p in self.phases for r in p.runs)
        counts["sigterms"] = sum(r.stopped for p in self.phases for r in p.runs)
        for stats in self.stats.values():
            for run in stats["runs"]:
                key = f"runs_{run['outcome']}"
                counts[key] = counts.get(key, 0) + 1
        return counts


class Host:
    """A fake on a fixed port, maybe behind a proxy, that can be restarted."""

    def __init__(self, name: str, plan: ServerPlan, schedule: Schedule, seed: int) -> None:
        self.name = name
        self.plan = plan
        self.fake = FakeComfy(
            script=plan.script,
            prompt_seconds=schedule.prompt_seconds,
            models=plan.models,
            model_load_s=plan.model_load_s,
            resident=plan.resident,
            default_word=plan.sick or "ok",
        )
        self.fake.busy = plan.busy
        self._serving: contextlib.AbstractContextManager[str] | None = None
        self.port = 0
        self.proxy: FaultProxy | None = None
        self._proxy_cm: contextlib.AbstractContextManager[str] | None = None
        self.url = ""
        self.restarts = 0
        self._seed = seed
        self._lock = threading.Lock()

    def start(self) -> None:
        self._serve(0)
        self.port = int(self.fake.port or 0)
        self.url = f"http://127.0.0.1:{self.port}"
        if self.plan.proxied:
            self.proxy = FaultProxy(
                self.url,
                seed=self._seed,
                cuts=self.plan.cuts,
                cut_within_s=self.plan.cut_within_s,
                cut_probability=self.plan.cut_probability,
                view_404=self.plan.view_404,
                lose_answer=self.plan.lose_answer,
            )
            self._proxy_cm = self.proxy.serve_in_thread(port=0)
            self.url = self._proxy_cm.__enter__()

    def _serve(self, port: int) -> None:
        self._serving = self.fake.serve_in_thread(port=port)
        self._serving.__enter__()

    def restart(self) -> None:
        """Stop the fake (a running prompt is lost) and serve again on the same port."""
        with self._lock:
            assert self._serving is not None
            self._serving.__exit__(None, None, None)
            self.fake.busy = 0
            self._serve(self.port)
            self.restarts += 1

    def stop(self) -> None:
        with self._lock:
            if self._proxy_cm is not None:
                self._proxy_cm.__exit__(None, None, None)
            if self._serving is not None:
                self._serving.__exit__(None, None, None)
                self._serving = None

    def ours_running(self) -> bool:
        busy = self.fake.executor.busy_client_id
        return any(r["outcome"] is None and r["client_id"] != busy for r in self.fake.stats["runs"])

    def ours_left(self) -> list[str]:
        busy = self.fake.executor.busy_client_id
        session = self.fake.session
        items = [*session.queue, *([session.running] if session.running else [])]
        return [i.prompt_id for i in items if i.client_id != busy]


def _restarter(host: Host, stop: threading.Event, errors: list[str]) -> None:
    """Restart ``host`` once: ``restart_after_s`` after one of our prompts started there,
    or at its first download (``ServerPlan.restart_at``)."""
    try:
        while not stop.is_set():
            if host.plan.restart_at == "download":
                if host.fake.stats["requests"].get("GET /view", 0):
                    host.restart()
                    return
            elif host.ours_running():
                stop.wait(host.plan.restart_after_s)
                if not stop.is_set():
                    host.restart()
                return
            stop.wait(_LOOK_S)
    except Exception:
        errors.append(f"restarting {host.name}: {traceback.format_exc()}")


def _restarters(
    hosts: list[Host], stop: threading.Event, errors: list[str]
) -> list[threading.Thread]:
    """A ``_restarter`` thread started for each host whose plan restarts it."""
    threads = []
    for host in hosts:
        if host.plan.restart:
            t = threading.Thread(target=_restarter, args=(host, stop, errors), daemon=True)
            t.start()
            threads.append(t)
    return threads


def picture_png(seed: int, index: int) -> bytes:
    """The PNG of input picture ``index`` of a schedule: 16 x 12 seeded random pixels."""
    rng = random.Random(f"picture:{seed}:{index}")
    pixels = bytes(rng.randrange(256) for _ in range(16 * 12 * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (16, 12), pixels).save(out, format="PNG")
    return out.getvalue()


def write_plan(folder: Path, schedule: Schedule, *, name: str, salt: str) -> Path:
    """The job file ``folder/name`` of the schedule's plan (job ids from ``salt``), the
    workflows and input pictures beside it; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    for workflow in ("image.json", "invert_picture.json"):
        shutil.copy(WORKFLOWS / workflow, folder / workflow)
    for index, picture in enumerate(PICTURES):
        (folder / picture).parent.mkdir(parents=True, exist_ok=True)
        (folder / picture).write_bytes(picture_png(schedule.seed, index))
    lines = []
    for i, plan in enumerate(schedule.plan):
        job: dict[str, Any] = {"id": job_id(i, salt)}
        if plan.kind == "image":
            job |= {"workflow": "image.json", "set": {"1.color": 1000 + i}}
        elif plan.kind == "huge":
            prefix = "p" * HUGE_CHARS
            job |= {
                "workflow": "image.json",
                "set": {"1.color": 1000 + i, "3.filename_prefix": prefix},
            }
        elif plan.kind == "picture":
            job |= {
                "workflow": "invert_picture.json",
                "inputs": {"1.image": PICTURES[plan.picture]},
            }
        else:
            upstream = {"job": job_id(plan.upstream, salt), "node": plan.node}
            job |= {"workflow": "invert_picture.json", "inputs": {"1.image": upstream}}
        lines.append(json.dumps(job))
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


def server_bytes(fake: FakeComfy) -> dict[str, str]:
    """sha256 of every file in the fake's output folder, by path relative to it."""
    root = fake.output_dir
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


def run_args(schedule: Schedule, jobs: Path, hosts: list[Host], store: Path) -> list[str]:
    """The ``comfy-assets run`` command line of a schedule (small deadlines and leases)."""
    args = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs)]
    for host in hosts:
        args += ["--server", f"{host.name}={host.url}"]
    args += ["--store", str(store), "--events", "--attempts", str(schedule.attempts)]
    args += ["--base-delay-s", str(schedule.base_delay_s), "--max-delay-s", "0.1"]
    args += ["--poll-s", str(schedule.poll_s)]
    args += ["--timeout-s", str(schedule.timeout_s), "--lease-s", "10"]
    args += ["--server-lease-s", "3", "--probe-timeout-s", "1", "--unhealthy-wait-s", "0.1"]
    args += ["--catch-up-s", "1", "--unreachable-timeout-s", "30"]
    return args


def config(schedule: Schedule) -> BatchConfig:
    """The worker's BatchConfig, the same knobs as ``run_args``."""
    return BatchConfig(
        attempts=schedule.attempts,
        base_delay_s=schedule.base_delay_s,
        max_delay_s=0.1,
        poll_s=schedule.poll_s,
        timeout_s=schedule.timeout_s,
        lease_s=10.0,
        server_lease_s=3.0,
        probe_timeout_s=1.0,
        unhealthy_wait_s=0.1,
        catch_up_s=1.0,
    )


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen[str], args: list[str], jobs: Path, killed: bool) -> RunOutput:
    timed_out = False
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        timed_out = True
    return RunOutput(args, jobs, proc.returncode, out, err, killed=killed, timed_out=timed_out)


def _ended_runs(hosts: list[Host]) -> int:
    return sum(1 for h in hosts for r in h.fake.stats["runs"] if r["outcome"] is not None)


def _posted(hosts: list[Host]) -> int:
    return sum(p["posted"] for h in hosts for p in h.fake.stats["prompts"].values())


def _play_phase(schedule: Schedule, hosts: list[Host], phase: Phase) -> None:
    s = schedule
    store = phase.store
    if s.mode == "worker":
        phase.runs.append(_play_worker(s, hosts, phase))
        return
    if s.mode == "concurrent":
        argv = [run_args(s, jobs, hosts, store) for jobs in phase.job_files]
        if len(argv) == 1:
            argv.append(list(argv[0]))
        for a, priority in zip(argv, s.priorities, strict=False):
            a += ["--priority", str(priority)]
        Store(store).close()  # the schema exists before the race
        procs = [(_start(a), a) for a in argv]
        jobs = phase.job_files * (2 // len(phase.job_files))
        for (proc, a), j in zip(procs, jobs, strict=True):
            phase.runs.append(_finish(proc, a, j, killed=False))
        return
    args = run_args(s, phase.job_files[0], hosts, store)
    if s.mode == "sigkill":
        proc = _start(args)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if _posted(hosts) >= 1 and _ended_runs(hosts) >= s.kill_after_runs:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(_LOOK_S)
        phase.runs.append(_finish(proc, args, phase.job_files[0], killed=True))
    if s.mode == "sigterm":
        proc = _start(args)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if any(h.ours_running() for h in hosts):
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(_LOOK_S)
        run = _finish(proc, args, phase.job_files[0], killed=False)
        run.stopped = True
        phase.runs.append(run)
        phase.left_after_stop = {h.name: h.ours_left() for h in hosts}
    phase.runs.append(_finish(_start(args), args, phase.job_files[0], killed=False))


def _play_worker(schedule: Schedule, hosts: list[Host], phase: Phase) -> RunOutput:
    """Every job of the file delivered twice to the in-process worker, and the hostile
    message (``Schedule.hostile``) once, after the first deliveries."""
    jobs = phase.job_files[0]
    messages = job_messages(jobs)
    source = MemorySource(jobs.stem)
    hostile = _hostile_message(messages[0][1], schedule.hostile) if schedule.hostile else []
    hostile_bodies = {body for _, body in hostile}
    for _, body in [*messages, *hostile, *reversed(messages)]:
        source.put(body)
    source.end()
    specs = [ServerSpec(h.name, h.url) for h in hosts]
    store = Store(phase.store, file_store=phase.file_store)
    try:
        worker = Worker(
            source, servers=specs, store=store, config=config(schedule), workflows_dir=jobs.parent
        )
        err = ""
        lines = _LogLines()
        logging.getLogger("comfy_assets").addHandler(lines)
        try:
            asyncio.run(asyncio.wait_for(worker.run(), RUN_TIMEOUT_S))
        except BaseException:
            err = traceback.format_exc()
        finally:
            logging.getLogger("comfy_assets").removeHandler(lines)
        phase.worker = {
            "acked": len(source.acked),
            "dead": list(source.dead),
            "requeued": len(source.requeued),
            "messages": 2 * len(messages) + len(hostile),
            "counts": dict(worker.counts),
            "hostile": [reason for body, reason in source.dead if body in hostile_bodies],
        }
    finally:
        store.close()
    return RunOutput(["worker"], jobs, 0 if not err else 1, "".join(lines.text), err)


def _hostile_message(body: bytes, text: str) -> list[tuple[str, bytes]]:
    """A message like ``body`` under another id whose first ``set`` value holds ``text``
    (JSON-escaped, as a client's \\u escapes write it)."""
    job = json.loads(body)
    job["id"] = job_id(999, "hostile")
    key = next(iter(job["set"]), "1.color")
    job["set"][key] = f"hostile{text}"
    return [(job["id"], json.dumps(job).encode())]


class _LogLines(logging.Handler):
    """The worker's log lines an operator sees by default (warnings and errors), as text:
    the in-process worker's "stdout" for the invariants."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(self.format(record) + "\n")


def _write_jobs(schedule: Schedule, folder: Path, name: str, salt: str) -> Path:
    """The schedule's job file: its plan's lines (images, pictures, chained jobs), or
    text-to-image jobs of its checkpoints."""
    if not schedule.checkpoints:
        return write_plan(folder, schedule, name=name, salt=salt)
    extra = [
        {"set": {"4.ckpt_name": c, "3.seed": i, "5.width": 64, "5.height": 64}}
        for i, c in enumerate(schedule.checkpoints)
    ]
    return write_jobs(
        folder, schedule.jobs, name=name, salt=salt, workflow="text_to_image.json", extra=extra
    )


def stored_outputs(folder: Path, files: FileStore) -> dict[str, str | None]:
    """``Phase.stored`` of the store whose records are in ``folder``: each output its
    records list, read from ``files``."""
    found: dict[str, str | None] = {}
    store = Store(folder, file_store=files)
    try:
        for partition in store.partitions():
            for rec in store.jobs(partition):
                for f in store.files(rec.job_id):
                    try:
                        with files.open_output(partition, rec.job_id, f) as stream:
                            digest = hashlib.file_digest(stream, "sha256").hexdigest()
                    except FileNotFoundError:
                        digest = None
                    found[f"{rec.job_id}/{f.path}"] = digest
    finally:
        store.close()
    return found


def stored_results(folder: Path, files: FileStore) -> dict[str, str | None]:
    """``Phase.results_csv`` of the store whose records are in ``folder``: each
    partition's results.csv as ``files`` holds it (None where it holds none)."""
    found: dict[str, str | None] = {}
    store = Store(folder, file_store=files)
    try:
        for partition in store.partitions():
            try:
                with files.open_file(results_key(partition)) as stream:
                    found[partition] = stream.read().decode()
            except FileNotFoundError:
                found[partition] = None
    finally:
        store.close()
    return found


def _store_down(
    proxy: S3FaultProxy, plan: StorePlan, hosts: list[Host], stop: threading.Event
) -> None:
    """The object store down for ``plan.down_s`` from the first download a server
    answers."""
    while not stop.is_set():
        if any(h.fake.stats["requests"].get("GET /view", 0) for h in hosts):
            proxy.down = True
            stop.wait(plan.down_s)
            proxy.down = False
            return
        stop.wait(_LOOK_S)


@contextlib.contextmanager
def _object_store(
    plan: StorePlan, folder: Path, hosts: list[Host], stop: threading.Event
) -> Iterator[tuple[FileStore, S3FaultProxy, FileStore]]:
    """A SeaweedFS in ``folder`` behind a proxy playing ``plan``'s faults: the file store
    of a bucket of it reached through the proxy, the proxy, and the same bucket reached
    directly (for reading what was stored)."""
    secret = uuid.uuid4().hex
    with s3_server.seaweedfs(folder / "seaweedfs", "campaign", secret) as server:
        server.create_bucket("campaign")
        with S3FaultProxy(server.endpoint).running() as proxy:
            proxy.delay_s, proxy.cut_uploads = plan.delay_s, plan.cuts
            proxy.slowdown = plan.slowdowns
            settings = S3Settings(
                endpoint=proxy.endpoint, access_key_id="campaign", secret_access_key=secret
            )
            (folder / "spool").mkdir(exist_ok=True)
            files = S3FileStore("s3://campaign/farm", settings, spool_dir=folder / "spool")
            direct = S3FileStore(
                "s3://campaign/farm",
                replace(settings, endpoint=server.endpoint),
                spool_dir=folder / "spool",
            )
            down = threading.Thread(target=_store_down, args=(proxy, plan, hosts, stop))
            if plan.down_s:
                down.start()
            try:
                yield files, proxy, direct
            finally:
                stop.set()
                if plan.down_s:
                    down.join()


def play(schedule: Schedule, folder: Path) -> Played:
    """Play ``schedule`` in ``folder`` (job files, stores); see the module docstring."""
    s = schedule
    hosts = [Host(f"gpu{i}", plan, s, s.seed * 31 + i) for i, plan in enumerate(s.servers)]
    errors: list[str] = []
    phases: list[Phase] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    main_jobs = _write_jobs(s, folder / "jobs", "jobs.jsonl", f"seed{s.seed}")
    other_jobs = _write_jobs(s, folder / "jobs", "other.jsonl", f"other{s.seed}")
    files: FileStore | None = None
    proxy: S3FaultProxy | None = None
    direct: FileStore | None = None
    outer = contextlib.ExitStack()
    try:
        if s.object_store is not None:
            files, proxy, direct = outer.enter_context(
                _object_store(s.object_store, folder, hosts, threading.Event())
            )
        for host in hosts:
            host.start()
        threads = _restarters(hosts, stop, errors)
        job_files = (
            [main_jobs] if s.mode != "concurrent" or s.same_file else [main_jobs, other_jobs]
        )
        stores = [folder / "store"] + ([folder / "store2"] if s.mode == "cache_replay" else [])
        for index, store in enumerate(stores):
            if index:  # cache_replay: the server's output folder is cleaned
                for host in hosts:
                    for p in host.fake.output_dir.rglob("*"):
                        if p.is_file():
                            p.unlink()
            phase = Phase(store=store, job_files=job_files, file_store=files)
            phase.first_run = [len(h.fake.stats["runs"]) for h in hosts]
            phase.first_post = [len(h.fake.stats["posts"]) for h in hosts]
            _play_phase(s, hosts, phase)
            phase.end_run = [len(h.fake.stats["runs"]) for h in hosts]
            phase.end_post = [len(h.fake.stats["posts"]) for h in hosts]
            phase.server_bytes = {h.name: server_bytes(h.fake) for h in hosts}
            if direct is not None:
                phase.stored = stored_outputs(phase.store, direct)
                phase.results_csv = stored_results(phase.store, direct)
            phases.append(phase)
        stop.set()
        for t in threads:
            t.join()
        ours_left = {h.name: h.ours_left() for h in hosts}
        not_idle: dict[str, str] = {}
        for h in hosts:
            try:
                asyncio.run(h.fake.wait_idle(IDLE_TIMEOUT_S))
            except (TimeoutError, RuntimeError) as ex:
                not_idle[h.name] = str(ex)
    finally:
        stop.set()
        for host in hosts:
            try:
                host.stop()
            except Exception:
                errors.append(f"stopping {host.name}: {traceback.format_exc()}")
        s3_counts = dict(proxy.counts) if proxy is not None else {}
        outer.close()
    return Played(
        schedule=s,
        phases=phases,
        stats={h.name: h.fake.stats for h in hosts},
        busy_clients={h.name: h.fake.executor.busy_client_id for h in hosts},
        ours_left=ours_left,
        not_idle=not_idle,
        proxies={h.name: h.proxy.stats for h in hosts if h.proxy is not None},
        restarts={h.name: h.restarts for h in hosts},
        errors=errors,
        object_store=s3_counts,
    )
