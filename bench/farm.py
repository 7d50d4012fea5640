"""A render farm on one machine: GPU hosts of fakes, worker hosts, PostgreSQL, RabbitMQ.

    python bench/farm.py        # 4 GPU hosts x 8 fakes (1 s prompts), 4 worker hosts, 1280 jobs
    python bench/farm.py --gpu-hosts 1 --fakes 2 --worker-hosts 1 --jobs 8 --prompt-s 0.05
    python bench/farm.py --s3   # the store's files in an object store: no folder shared

Each host is a network namespace on a bridge with its own PID and UTS namespaces
(``tests/farm``; root needed), so every request crosses a veth pair and the bridge:
worker host i drives the fakes of GPU host i over the bridge, reaches PostgreSQL (a
server of the bench's own, ``bench/farm_db.py``) on the database host's address and
RabbitMQ through the farm's forwarder. The workers start first and wait on an empty
queue; a client host then enqueues the job file (``comfy-assets enqueue``), as a batch
arriving at a standing farm. Once every message is acked the workers idle ``--idle-s``
seconds, then stop (SIGTERM).

With ``--s3`` the workers' store is ``s3://studio/renders``: a SeaweedFS of the bench's own
(``weed mini``, signatures checked) reached over the bridge through a TCP forwarder, so
the GPU hosts and the worker hosts share no folder at all, only PostgreSQL, RabbitMQ and
the object store. It adds ``s3_objects`` (the bucket's outputs, one per distinct output)
and ``weed_cpu_ms_per_job`` (the SeaweedFS process's CPU over the whole batch).

Prints ``name=value`` lines (each described in bench/README.md). From the fakes' own
records (``/fake/stats``): ``utilization`` (busy prompt seconds / (servers x makespan))
and the gap between one prompt's end and the next one's start on a server
(``gap_ms_median``). From PostgreSQL: ``db_statements_*`` (``pg_stat_statements``: every
statement a client sent and the server ran for the store's database, BEGIN and COMMIT
included), ``db_xacts_*`` (``pg_stat_database``: commits + rollbacks), ``db_wal_*``
(``pg_stat_wal``), ``db_connections_*`` (``pg_stat_activity`` sampled every 0.25 s),
``db_server_cpu_ms_per_job`` (the server's processes, from /proc), and
``worker_cpu_ms_per_job`` (the worker processes'). ``steady`` figures are between the
10th and the 90th percentile of acks; ``_all`` ones cover the workers' whole lives
(start-up, idle time and shutdown included). RabbitMQ: messages published
(``enqueue``'s own count) and acked or requeued (the workers' ``message acked`` /
``message requeued`` lines); no rate is read from the broker.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import obstore
from obstore.store import S3Store

from bench.common import scratch_dir, utilization_and_gaps, write_jobs
from bench.farm_db import Counters, Snapshot, private_postgres, server_cpu_s
from comfy_assets.store import Store
from tests import s3_server
from tests.farm import Farm, Proc, unavailable
from tests.tcp_proxy import TcpProxy

NODES_EXECUTED = 4  # the fake sleeps its --prompt-seconds per executed node of image.json
SAMPLE_S = 0.25
READY = "taking jobs of"  # the worker's line once it consumes
ACKED = re.compile(r"; message acked")
S3_KEY = "farm-key"
S3_BUCKET = "studio"
REQUEUED = re.compile(r"; message requeued")


def cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Worker:
    """A worker process of the farm and the acks its output shows so far."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self._seen = 0
        self.acked = 0
        self.requeued = 0

    def read(self) -> None:
        """Count the lines it wrote since the last call."""
        with self.proc.log.open("rb") as f:
            f.seek(self._seen)
            text = f.read()
        cut = text.rfind(b"\n") + 1  # a line still being written waits for the next call
        self._seen += cut
        chunk = text[:cut].decode(errors="replace")
        self.acked += len(ACKED.findall(chunk))
        self.requeued += len(REQUEUED.findall(chunk))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-hosts", type=int, default=4)
    ap.add_argument("--fakes", type=int, default=8, help="fake servers per GPU host (8)")
    ap.add_argument("--worker-hosts", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1280)
    ap.add_argument("--prompt-s", type=float, default=1.0, help="seconds per prompt (1)")
    ap.add_argument("--idle-s", type=float, default=6.0, help="idle time measured after (6 s)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--keep", action="store_true", help="keep the hosts' logs and outputs")
    ap.add_argument("--s3", action="store_true", help="the store's files in a SeaweedFS")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"bench/farm.py: {why}")
    load_start = os.getloadavg()
    folder = scratch_dir()
    try:
        with (
            Farm(folder) as farm,
            private_postgres(farm.db_address) as db_url,
            object_store(args.s3, farm, folder) as s3,
        ):
            Store(folder / "schema", db_url).close()  # the schema, before workers race for it
            counters = Counters(db_url)
            try:
                figures, shapes = measure(args, farm, db_url, counters, s3)
            finally:
                counters.close()
    finally:
        if args.keep:
            print(f"kept: {folder}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    load_end = os.getloadavg()
    print("hosts=namespaces")
    print(f"store={'s3://studio/renders (SeaweedFS)' if args.s3 else 'a folder per worker host'}")
    print(f"gpu_hosts={args.gpu_hosts}")
    print(f"fakes_per_host={args.fakes}")
    print(f"servers={args.gpu_hosts * args.fakes}")
    print(f"worker_hosts={args.worker_hosts}")
    print(f"jobs={args.jobs}")
    print(f"prompt_s={args.prompt_s:g}")
    print(f"load_1m_start={load_start[0]:.2f}")
    print(f"load_1m_end={load_end[0]:.2f}")
    for name, value in figures.items():
        print(f"{name}={value}")
    for calls, rows, ms, query in shapes:
        print(f"steady_per_job={calls:.2f} rows={rows:.2f} ms={ms:.3f} {query[:110]}")


def wait_for_acks(
    args: argparse.Namespace, counters: Counters, workers: list[Worker], db_url: str
) -> tuple[dict[str, Snapshot], dict[str, int], dict[str, tuple[float, float]]]:
    """Sample until every job is acked: the counters, acks and CPU (database server,
    workers) at 10 % and 90 % of the acks. Exits when a worker dies or time runs out."""
    marks: dict[str, Snapshot] = {}
    acked_at: dict[str, int] = {}
    cpu: dict[str, tuple[float, float]] = {}  # mark -> (database server, workers) CPU s
    deadline = time.monotonic() + args.timeout_s
    while True:
        counters.sample_connections()
        for w in workers:
            w.read()
        acked = sum(w.acked for w in workers)
        for name, share in (("p10", 0.1), ("p90", 0.9)):
            if name not in marks and acked >= share * args.jobs:
                marks[name], acked_at[name] = counters.snapshot(), acked
                cpu[name] = (server_cpu_s(db_url), sum(cpu_s(w.proc.pid) for w in workers))
        if acked >= args.jobs:
            break
        for w in workers:
            if w.proc.returncode is not None:
                raise SystemExit(
                    f"{w.proc.name} exited {w.proc.returncode}:\n{w.proc.text()[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise SystemExit(f"{acked} of {args.jobs} jobs acked after {args.timeout_s} s")
        time.sleep(SAMPLE_S)
    return marks, acked_at, cpu


class ObjectStore:
    """The bench's SeaweedFS: ``server`` as the bench reaches it (127.0.0.1), ``env``
    the AWS variables with which hosts reach it over the bridge, ``pid`` its process."""

    def __init__(self, server: s3_server.S3Server, env: dict[str, str], pid: int | None):
        self.server, self.env, self.pid = server, env, pid

    def objects(self, prefix: str) -> int:
        """How many objects the bucket holds under ``prefix`` (every page of the list)."""
        bucket = S3Store(
            S3_BUCKET,
            config={
                "endpoint": self.server.endpoint,
                "access_key_id": self.server.access_key,
                "secret_access_key": self.server.secret_key,
                "region": "us-east-1",
            },
            client_options={"allow_http": True},
        )
        return sum(len(page) for page in obstore.list(bucket, prefix))


@contextlib.contextmanager
def object_store(wanted: bool, farm: Farm, folder: Path) -> Iterator[ObjectStore | None]:
    """With ``wanted``: a SeaweedFS on 127.0.0.1 with a bucket ``farm``, forwarded to on
    the farm's RabbitMQ address (a port of its own), so hosts reach it over the bridge."""
    if not wanted:
        yield None
        return
    secret = uuid.uuid4().hex
    with s3_server.seaweedfs(folder / "seaweedfs", S3_KEY, secret) as server:
        server.create_bucket(S3_BUCKET)
        port = int(server.endpoint.rsplit(":", 1)[1])
        with TcpProxy("127.0.0.1", port, listen_host=farm.amqp_address).running() as proxy:
            env = {
                "AWS_ENDPOINT_URL": f"http://{farm.amqp_address}:{proxy.port}",
                "AWS_ACCESS_KEY_ID": S3_KEY,
                "AWS_SECRET_ACCESS_KEY": secret,
            }
            yield ObjectStore(server, env, weed_pid(port))


def measure(
    args: argparse.Namespace,
    farm: Farm,
    db_url: str,
    counters: Counters,
    s3: ObjectStore | None = None,
) -> tuple[dict[str, object], list[tuple[float, float, float, str]]]:
    per_node = args.prompt_s / NODES_EXECUTED
    gpus = [
        farm.add_gpu_host(f"gpu{i + 1}", fakes=args.fakes, prompt_seconds=per_node)
        for i in range(args.gpu_hosts)
    ]
    client = farm.add_host("client")
    jobs_path = write_jobs(client.folder / "jobs", args.jobs)
    queue = farm.queue("render")
    env = {"COMFY_ASSETS_RABBITMQ_URL": farm.amqp_url, "COMFY_ASSETS_DB_URL": db_url}
    if s3 is not None:
        env.update(s3.env)
    weed_start = cpu_s(s3.pid) if s3 else 0.0
    s0 = counters.snapshot()
    workers = []
    for i in range(args.worker_hosts):
        host = farm.add_host(f"worker{i + 1}")
        servers = [a for spec in gpus[i % len(gpus)].specs for a in ("--server", spec)]
        store = f"s3://{S3_BUCKET}/renders" if s3 else str(host.folder / "store")
        cmd = farm.python(
            "comfy_assets.cli",
            *("worker", "--queue", queue, *servers, "--store", store),
            *("--lease-s", "120", "--server-lease-s", "30", "--grace-s", "10"),
        )
        workers.append(Worker(host.start(cmd, env, name="worker")))
    for w in workers:
        w.proc.wait_for(READY, 120)
    t_enqueue = time.monotonic()
    enqueue = client.start(
        farm.python("comfy_assets.cli", "enqueue", "--queue", queue, "--jobs", str(jobs_path)),
        env,
        name="enqueue",
    )
    if enqueue.wait(300) != 0:
        raise SystemExit(f"enqueue failed:\n{enqueue.text()[-3000:]}")
    enqueue_s = time.monotonic() - t_enqueue
    published = int(re.search(r"enqueued (\d+) jobs", enqueue.text()).group(1))

    marks, acked_at, cpu = wait_for_acks(args, counters, workers, db_url)
    wall_s = time.monotonic() - t_enqueue
    weed_cpu = cpu_s(s3.pid) - weed_start if s3 else 0.0
    done = counters.snapshot()
    idle_end = time.monotonic() + args.idle_s
    while time.monotonic() < idle_end:
        counters.sample_connections()
        time.sleep(SAMPLE_S)
    idle = counters.snapshot()
    for w in workers:
        w.proc.signal(signal.SIGTERM)
    codes = [w.proc.wait(120) for w in workers]
    for w in workers:
        w.read()
    farm.wait("the workers' sessions to end", lambda: counters.sample_connections()[0] == 0, 30)
    end = counters.snapshot()
    pool = utilization_and_gaps({f.name: f.stats()["runs"] for f in farm.fakes})

    steady = marks["p90"].minus(marks["p10"])
    steady_jobs = acked_at["p90"] - acked_at["p10"]
    db_cpu, workers_cpu = (b - a for a, b in zip(cpu["p10"], cpu["p90"], strict=True))
    window = "p10-p90 of acks"
    if steady_jobs == 0:
        # A run this small acks in bursts: both percentiles fell in one sample. Its
        # per-job figures are over the whole batch, and its CPU is not measured.
        steady, steady_jobs, window = done.minus(s0), args.jobs, "whole batch"
        db_cpu = workers_cpu = float("nan")
    whole = end.minus(s0)
    idle_d = idle.minus(done)
    shapes = sorted(
        (
            (
                n / steady_jobs,
                steady.rows.get(q, 0) / steady_jobs,
                steady.exec_ms.get(q, 0.0) / n,
                q,
            )
            for q, n in steady.statements.items()
            if n / steady_jobs >= 0.05  # not the once-per-worker statements
        ),
        reverse=True,
    )
    figures: dict[str, object] = {
        "done": sum(w.acked for w in workers),
        "worker_exit_codes": ",".join(map(str, codes)),
        "wall_s": f"{wall_s:.2f}",
        "utilization": f"{pool['utilization']:.4f}",
        **{k: f"{v:.2f}" for k, v in pool.items() if k != "utilization"},
        "jobs_per_s": f"{args.jobs / pool['makespan_s']:.2f}",
        "enqueue_s": f"{enqueue_s:.2f}",
        "enqueue_msgs_per_s": f"{published / enqueue_s:.1f}",
        "steady_window": window,
        "steady_window_s": f"{steady.at:.2f}",
        "steady_jobs": steady_jobs,
        "steady_jobs_per_s": f"{steady_jobs / steady.at:.2f}",
        "db_statements_per_job": f"{steady.calls / steady_jobs:.2f}",
        "db_statements_per_s": f"{steady.calls / steady.at:.1f}",
        "db_xacts_per_job": f"{(steady.commits + steady.rollbacks) / steady_jobs:.2f}",
        "db_xacts_per_s": f"{(steady.commits + steady.rollbacks) / steady.at:.1f}",
        "db_rows_per_job": f"{sum(steady.rows.values()) / steady_jobs:.2f}",
        "db_exec_ms_per_job": f"{sum(steady.exec_ms.values()) / steady_jobs:.2f}",
        "db_wal_kb_per_job": f"{steady.wal_bytes / steady_jobs / 1024:.2f}",
        "db_wal_syncs_per_s": f"{steady.wal_syncs / steady.at:.1f}",
        "db_statements_per_job_all": f"{whole.calls / args.jobs:.2f}",
        "db_xacts_per_job_all": f"{(whole.commits + whole.rollbacks) / args.jobs:.2f}",
        "db_rollbacks_all": whole.rollbacks,
        "db_idle_statements_per_s_per_worker": (
            f"{idle_d.calls / idle_d.at / args.worker_hosts:.2f}"
        ),
        "db_idle_rows_per_s_per_worker": (
            f"{sum(idle_d.rows.values()) / idle_d.at / args.worker_hosts:.2f}"
        ),
        "db_server_cpu_ms_per_job": f"{db_cpu / steady_jobs * 1000:.2f}",
        "db_server_cores_steady": f"{db_cpu / steady.at:.3f}",
        "worker_cpu_ms_per_job": f"{workers_cpu / steady_jobs * 1000:.2f}",
        "db_connections_peak": counters.peak_connections,
        "db_connections_active_peak": counters.peak_active,
        "rabbitmq_published": published,
        "rabbitmq_acked": sum(w.acked for w in workers),
        "rabbitmq_requeued": sum(w.requeued for w in workers),
        "rabbitmq_acks_per_s_steady": f"{steady_jobs / steady.at:.2f}",
        "prompts_per_server_median": statistics.median(
            len([r for r in f.stats()["runs"] if r.get("end")]) for f in farm.fakes
        ),
    }
    if s3 is not None:
        figures["s3_objects"] = s3.objects("renders/")
        figures["weed_cpu_ms_per_job"] = f"{weed_cpu / args.jobs * 1000:.2f}"
    return figures, shapes


def weed_pid(port: int) -> int | None:
    """The pid of the ``weed`` process whose S3 gateway listens on ``port``, or None."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"weed") and f"-s3.port={port}".encode() in argv:
            return int(entry.name)
    return None


if __name__ == "__main__":
    main()
