"""End-to-end demo: fake ComfyUI servers, the Dagster daemon, the sensor, the CSVs.

``python -m comfy_assets.cli.demo [--keep] [--no-ui]`` (``make demo``, ``make demo KEEP=1``):

1. creates ``.demo/`` afresh (an old one is deleted, so the sensor sees every file anew)
   with ``dagster_home/`` (a copy of the template ``dagster_home/dagster.yaml``);
2. starts two fake ComfyUI servers (``python -m fake_comfy --port 0``), the Dagster
   daemon and, unless ``--no-ui``, the web UI, all with the project's settings in the
   environment (``COMFY_ASSETS_*``, ``DAGSTER_HOME``); logs go to ``.demo/logs/``;
3. waits (bounded) until every job file of ``data/jobs`` has a successful run of its
   current version, launched by ``job_file_sensor`` through the daemon's queue;
4. prints each partition's counts, checks and results CSV, verifies the CSV has one row
   per job line, every job done, and exits 0 only then; otherwise prints why (run status,
   step errors from the event log, the daemon's log) and exits 1.

Without ``--keep`` everything it started is stopped on exit, Ctrl+C included. With
``--keep`` the servers stay up (the UI URL is printed); ``--stop`` ends them later.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import pandas as pd
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    RunsFilter,
)

from comfy_assets.assets import results_csv_path
from comfy_assets.jobs.model import JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.partitions import iter_job_files, partition_key_for
from comfy_assets.sensors import JOB_FILE_SHA_TAG

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TEMPLATE = ROOT / "dagster_home" / "dagster.yaml"
JOBS_DIR = ROOT / "data" / "jobs"
LISTENING = re.compile(r"fake_comfy listening on (http://\S+)")
PIDS_FILE = "pids.json"
FAKES = 2
DONE_STATES = ("succeeded", "degraded")
# Asset whose materializations are films; printed once such an asset exists (films.py).
FILMS_ASSET = "films"


class DemoFailed(Exception):
    """The demo could not show a complete, correct render; the message says why."""


def say(text: str) -> None:
    """One progress line, flushed at once (the demo is watched live)."""
    print(f"[demo] {text}", flush=True)


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, indented, for failure reports."""
    if not path.exists():
        return "    (no log)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in text)


@dataclass
class Child:
    """A process the demo started (in its own session, so its whole group can be ended)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None


class Children:
    """Every process the demo started; stops them in reverse order."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.items: list[Child] = []

    def start(self, name: str, args: Sequence[str], env: dict[str, str]) -> Child:
        """Start ``args`` with stdout and stderr in ``logs/<name>.log``."""
        log = self.logs / f"{name}.log"
        with log.open("w") as handle:
            proc = subprocess.Popen(
                list(args),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        child = Child(name, proc, log)
        self.items.append(child)
        return child

    def stop(self) -> None:
        """SIGTERM each process group, then SIGKILL what is still there after 20 s."""
        for child in reversed(self.items):
            if child.alive():
                say(f"stopping {child.name} (pid {child.proc.pid})")
                _signal_group(child.proc.pid, signal.SIGTERM)
        for child in reversed(self.items):
            try:
                child.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                say(f"{child.name} did not stop in 20 s; killing it")
                _signal_group(child.proc.pid, signal.SIGKILL)
                child.proc.wait(timeout=10)
        self.items.clear()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    # Each child leads its own session: its group id is its pid. Gone already is fine.
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return


def wait_for_listening(child: Child, timeout_s: float = 60.0) -> str:
    """The URL a fake server prints when it is ready (read from its log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = LISTENING.search(child.log.read_text(errors="replace"))
        if match:
            return match.group(1)
        if not child.alive():
            raise DemoFailed(
                f"{child.name} exited with {child.proc.returncode}:\n{tail(child.log)}"
            )
        time.sleep(0.05)
    raise DemoFailed(
        f"{child.name} did not say it was listening in {timeout_s:.0f} s:\n{tail(child.log)}"
    )


def port_free(port: int) -> bool:
    """True if nothing listens on 127.0.0.1:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for_ui(url: str, child: Child, timeout_s: float = 90.0) -> None:
    """Wait until the web UI answers (so the printed URL works)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise DemoFailed(f"the web UI exited with {child.proc.returncode}:\n{tail(child.log)}")
        try:
            with urllib.request.urlopen(f"{url}/server_info", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise DemoFailed(f"the web UI did not answer at {url} in {timeout_s:.0f} s:\n{tail(child.log)}")


# --- what the demo expects -------------------------------------------------------------


@dataclass
class Expected:
    """A job file the demo waits for: its partition and current version."""

    key: str
    path: Path
    sha256: str
    job_ids: list[str]


def expected_files(jobs_dir: Path) -> list[Expected]:
    """Every job file of ``jobs_dir``, validated now so a bad one fails fast."""
    found: list[Expected] = []
    problems: list[str] = []
    for entry in sorted(iter_job_files([jobs_dir]), key=lambda e: e.name):
        path = Path(entry.path)
        try:
            job_file = load_job_file(path)
        except JobFileError as exc:
            problems.append(str(exc))
            continue
        found.append(
            Expected(partition_key_for(path), path, job_file.sha256, [j.id for j in job_file.jobs])
        )
    if problems:
        raise DemoFailed("invalid job files:\n" + "\n".join(problems))
    if not found:
        raise DemoFailed(f"no job files (*.jsonl) in {jobs_dir}")
    return found


# --- following the runs ----------------------------------------------------------------


@dataclass
class PartitionState:
    """Where one job file stands: ``waiting``, ``running``, ``success`` or ``failed``."""

    state: str
    detail: str
    run_id: str | None = None


def partition_state(instance: DagsterInstance, item: Expected) -> PartitionState:
    """The state of the runs for this file version (retries keep the parent's tags)."""
    runs = instance.get_runs(
        filters=RunsFilter(tags={"dagster/partition": item.key, JOB_FILE_SHA_TAG: item.sha256})
    )
    if not runs:
        return PartitionState("waiting", "no run yet (the sensor ticks every 2 s)")
    for run in runs:
        if run.status == DagsterRunStatus.SUCCESS:
            return PartitionState("success", "SUCCESS", run.run_id)
    newest = runs[0]  # get_runs lists the newest first
    status = newest.status.value
    if not newest.is_finished:
        return PartitionState("running", f"run {newest.run_id[:8]} {status}", newest.run_id)
    if (
        newest.status == DagsterRunStatus.FAILURE
        and newest.tags.get("dagster/will_retry") == "true"
    ):
        return PartitionState(
            "running", f"run {newest.run_id[:8]} failed, retry coming", newest.run_id
        )
    return PartitionState("failed", f"run {newest.run_id[:8]} {status}", newest.run_id)


def run_errors(instance: DagsterInstance, run_id: str) -> str:
    """The step and run failures of a run, from its event log."""
    lines: list[str] = []
    kinds = {DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE}
    for record in instance.all_logs(run_id, of_type=kinds):
        event = record.dagster_event
        if event is None:
            continue
        lines.append(f"  {event.event_type_value} {event.step_key or ''}: {event.message or ''}")
        error = getattr(event.event_specific_data, "error", None)
        if error is not None:
            lines.append("    " + error.to_string().strip().replace("\n", "\n    "))
    return "\n".join(lines) or "  (no step errors in the event log)"


def wait_for_runs(
    instance: DagsterInstance, expected: list[Expected], watched: list[Child], timeout_s: float
) -> dict[str, PartitionState]:
    """Poll the instance until every file version has a successful run, or fail."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    last_print = 0.0
    while True:
        for child in watched:
            if not child.alive():
                raise DemoFailed(
                    f"{child.name} exited with {child.proc.returncode}:\n{tail(child.log)}"
                )
        states = {item.key: partition_state(instance, item) for item in expected}
        failed = {key: s for key, s in states.items() if s.state == "failed"}
        if failed:
            report = [
                f"partition {key}: {s.detail}\n{run_errors(instance, s.run_id or '')}"
                for key, s in failed.items()
            ]
            raise DemoFailed("runs failed:\n" + "\n".join(report))
        now = time.monotonic()
        snapshot = {key: s.detail for key, s in states.items()}
        parts = ", ".join(f"{key}: {s.detail}" for key, s in states.items())
        if snapshot != last or now - last_print > 15:
            done = sum(1 for s in states.values() if s.state == "success")
            say(f"{done}/{len(expected)} job files rendered ({parts})")
            last, last_print = snapshot, now
        if all(s.state == "success" for s in states.values()):
            return states
        if now > deadline:
            daemon = next((c for c in watched if c.name == "daemon"), None)
            log = f"\ndaemon log:\n{tail(daemon.log)}" if daemon else ""
            raise DemoFailed(f"timed out after {timeout_s:.0f} s waiting for runs ({parts}){log}")
        time.sleep(1.0)


# --- the report ------------------------------------------------------------------------


def _meta_value(metadata: dict, key: str) -> object:
    entry = metadata.get(key)
    return getattr(entry, "value", entry)


def report_partition(
    instance: DagsterInstance, item: Expected, run_id: str, store_root: Path
) -> list[str]:
    """Print a partition's summary and results CSV; return what is wrong with it."""
    problems: list[str] = []
    counts: object = None
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION):
        materialization = record.asset_materialization
        if materialization and materialization.asset_key == AssetKey("renders"):
            counts = _meta_value(dict(materialization.metadata), "counts")
    checks = []
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION):
        event = record.dagster_event
        evaluation = event.event_specific_data if event else None
        if evaluation is not None:
            checks.append(f"{evaluation.check_name} {'passed' if evaluation.passed else 'FAILED'}")
            if not evaluation.passed:
                problems.append(f"{item.key}: check {evaluation.check_name} failed")
    say(f"partition {item.key} ({item.path.name}, {len(item.job_ids)} jobs): counts {counts}")
    say(f"  checks: {', '.join(checks) or 'none recorded'}")

    csv_path = results_csv_path(store_root, item.key)
    if not csv_path.exists():
        return [*problems, f"{item.key}: no results CSV at {csv_path}"]
    frame = pd.read_csv(csv_path, dtype=str, keep_default_na=False)
    say(f"  results: {csv_path} ({len(frame)} rows)")
    rows = frame["job_id"].tolist()
    if rows != item.job_ids:
        missing = sorted(set(item.job_ids) - set(rows))
        extra = sorted(set(rows) - set(item.job_ids))
        problems.append(
            f"{item.key}: CSV rows do not match the job lines "
            f"({len(rows)} rows, {len(item.job_ids)} lines; missing {missing}, extra {extra})"
        )
    not_done = frame[~frame["state"].isin(DONE_STATES)]
    for _, row in not_done.iterrows():
        problems.append(f"{item.key}: job {row['job_id']} is {row['state']}: {row['reason']}")

    # Hook for films (films.py): printed as soon as a `films` asset is materialized.
    films = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(FILMS_ASSET), asset_partitions=[item.key]),
        limit=1,
        ascending=False,
    )
    for film in films.records:
        materialization = film.asset_materialization
        if materialization is not None:
            metadata = dict(materialization.metadata)
            path = _meta_value(metadata, "path")
            # A job file without shots materializes with only a status ("no shots").
            say(f"  film: {path}" if path else f"  film: none ({_meta_value(metadata, 'status')})")
    return problems


# --- keep / stop -----------------------------------------------------------------------


def save_pids(demo_dir: Path, children: Children) -> None:
    """Remember the kept processes so ``--stop`` can end them."""
    pids = {child.name: child.proc.pid for child in children.items}
    (demo_dir / PIDS_FILE).write_text(json.dumps(pids, indent=2) + "\n")


def stop_kept(demo_dir: Path) -> int:
    """End the process groups a ``--keep`` demo left running."""
    pids_file = demo_dir / PIDS_FILE
    if not pids_file.exists():
        say(f"nothing to stop ({pids_file} does not exist)")
        return 0
    for name, pid in json.loads(pids_file.read_text()).items():
        say(f"stopping {name} (process group {pid})")
        _signal_group(int(pid), signal.SIGTERM)
    pids_file.unlink()
    return 0


# --- main ------------------------------------------------------------------------------


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Ends the demo through its finally blocks, like Ctrl+C, so children are stopped.
    raise SystemExit(128 + signum)


def run_demo(
    demo_dir: Path, *, keep: bool, ui: bool, port: int, timeout_s: float, jobs_dir: Path
) -> int:
    """Run the demo; returns the exit status (0 only for a complete, correct render)."""
    if (demo_dir / PIDS_FILE).exists():
        raise DemoFailed(
            f"a kept demo may still be running ({demo_dir / PIDS_FILE}); "
            "stop it first: python -m comfy_assets.cli.demo --stop"
        )
    if ui and not port_free(port):
        raise DemoFailed(f"port {port} is taken; pass --port N or --no-ui")
    expected = expected_files(jobs_dir)

    if demo_dir.exists():
        shutil.rmtree(demo_dir)
    home = demo_dir / "dagster_home"
    logs = demo_dir / "logs"
    store = demo_dir / "store"
    for folder in (home, logs, store):
        folder.mkdir(parents=True)
    shutil.copy(TEMPLATE, home / "dagster.yaml")

    env = dict(os.environ)
    env.pop("COMFY_ASSETS_DB_URL", None)  # the demo's store is SQLite in .demo/store
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "COMFY_ASSETS_STORE": str(store),
            "COMFY_ASSETS_JOB_DIRS": str(jobs_dir),
            "COMFY_ASSETS_SENSOR_INTERVAL_S": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    children = Children(logs)
    kept = False
    try:
        urls = []
        for i in range(FAKES):
            child = children.start(
                f"fake{i}",
                [
                    sys.executable,
                    "-m",
                    "fake_comfy",
                    "--port",
                    "0",
                    "--output-dir",
                    str(demo_dir / f"fake{i}"),
                ],
                env,
            )
            urls.append(wait_for_listening(child))
        servers = ",".join(f"gpu{i}={url}" for i, url in enumerate(urls))
        env["COMFY_ASSETS_SERVERS"] = servers
        say(f"fake ComfyUI servers: {servers}")

        # Create the instance's SQLite storage here, once: the daemon and the UI starting
        # on an empty DAGSTER_HOME at the same time race to create it.
        os.environ["DAGSTER_HOME"] = str(home)
        with DagsterInstance.get() as instance:
            workspace = str(ROOT / "workspace.yaml")
            watched = list(children.items)
            daemon = [str(BIN / "dagster-daemon"), "run", "-w", workspace]
            watched.append(children.start("daemon", daemon, env))
            ui_url = f"http://127.0.0.1:{port}"
            if ui:
                webserver = [str(BIN / "dagster-webserver"), "-w", workspace]
                webserver += ["-h", "127.0.0.1", "-p", str(port)]
                watched.append(children.start("webserver", webserver, env))
                say(f"web UI starting at {ui_url}")
            say(f"Dagster home {home}; logs in {logs}")

            states = wait_for_runs(instance, expected, watched, timeout_s)
            problems: list[str] = []
            for item in expected:
                run_id = states[item.key].run_id or ""
                problems += report_partition(instance, item, run_id, store)
        if problems:
            raise DemoFailed("the results are not complete:\n  " + "\n  ".join(problems))
        say(f"all {len(expected)} job files rendered; every job line has its row")

        if keep:
            if ui:
                wait_for_ui(ui_url, watched[-1])
            save_pids(demo_dir, children)
            kept = True
            say(f"kept running: {', '.join(f'{c.name} pid {c.proc.pid}' for c in children.items)}")
            if ui:
                say(f"open the UI at {ui_url}")
            say("stop them with: python -m comfy_assets.cli.demo --stop")
        return 0
    finally:
        if not kept:
            children.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m comfy_assets.cli.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the servers, daemon and UI running"
    )
    parser.add_argument("--no-ui", action="store_true", help="do not start the web UI")
    parser.add_argument("--stop", action="store_true", help="stop what a --keep demo left running")
    parser.add_argument("--port", type=int, default=3000, help="web UI port (default 3000)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the runs")
    parser.add_argument(
        "--dir", type=Path, default=ROOT / ".demo", help="demo folder (default .demo)"
    )
    parser.add_argument(
        "--jobs", type=Path, default=JOBS_DIR, help="job files folder (default data/jobs)"
    )
    args = parser.parse_args(argv)
    demo_dir = args.dir.resolve()
    if args.stop:
        return stop_kept(demo_dir)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        return run_demo(
            demo_dir,
            keep=args.keep,
            ui=not args.no_ui,
            port=args.port,
            timeout_s=args.timeout,
            jobs_dir=args.jobs.resolve(),
        )
    except DemoFailed as exc:
        say(f"FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; stopped everything the demo started")
        return 130


if __name__ == "__main__":
    sys.exit(main())
