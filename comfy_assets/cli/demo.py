"""End-to-end demo: fake ComfyUI servers, the Dagster daemon, the sensor, the CSVs.

``python -m comfy_assets.cli.demo [--keep] [--no-ui]`` (``make demo``, ``make demo KEEP=1``):

1. creates ``.demo/`` afresh (an old one is deleted, so the sensor sees every file anew)
   with ``dagster_home/`` (a copy of the template ``dagster_home/dagster.yaml``);
2. starts two fake ComfyUI servers (``python -m fake_comfy --port 0``), the Dagster
   daemon and, unless ``--no-ui``, the web UI and a read-only web server of the store
   folder (``python -m http.server``, on loopback: ``COMFY_ASSETS_MEDIA_URL``, so the UI
   shows the pictures inline and links the film), all with the project's settings in the
   environment (``COMFY_ASSETS_*``, ``DAGSTER_HOME``); logs go to ``.demo/logs/``;
3. waits (bounded) until every job file of ``data/jobs`` has a successful run of its
   current version, launched by ``job_file_sensor`` through the daemon's queue, and
   every storyboard its film, cut by ``films_automation_sensor``;
4. prints each partition's counts, checks and results CSV, verifies the CSV has one row
   per job line, every job done, and exits 0 only then; otherwise prints why (run status,
   step errors from the event log, the daemon's log) and exits 1.

Without ``--keep`` everything it started is stopped on exit, Ctrl+C included. With
``--keep`` the servers stay up (the UI's pages are printed); ``--stop`` ends them later.
The UI listens on port 3000, or on a free port when 3000 is taken (``--port N`` insists).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from urllib.parse import quote

from dagster import (
    DagsterInstance,
)

from comfy_assets.cli.demo_processes import (
    PIDS_FILE,
    ROOT,
    Children,
    DemoFailed,
    announce,
    free_port,
    port_free,
    save_pids,
    stop_kept,
    wait_for_listening,
    wait_for_ui,
)
from comfy_assets.cli.demo_report import (
    SENSOR_INTERVAL_S,
    Expected,
    expected_files,
    report_all_results,
    report_partition,
    wait_for_films,
    wait_for_runs,
)

BIN = Path(sys.executable).parent

TEMPLATE = ROOT / "dagster_home" / "dagster.yaml"

JOBS_DIR = ROOT / "data" / "jobs"

FAKES = 2
DEFAULT_PORT = 3000
# The code location's name in UI addresses (workspace.yaml's location_name).
LOCATION = "comfy_assets"


def _python() -> str:
    """How to call this interpreter from the project folder (the venv's, when it is one)."""
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(ROOT))
    except ValueError:
        return str(exe)


def _stop_command(demo_dir: Path) -> str:
    """The command that stops a kept demo in ``demo_dir``, as it runs from the project."""
    if demo_dir != ROOT / ".demo":
        return f"{_python()} -m comfy_assets.cli.demo --stop --dir {demo_dir}"
    command = f"{_python()} -m comfy_assets.cli.demo --stop"
    return f"{command} (or make demo-stop)" if _python().startswith(".venv") else command


def pages(url: str, partitions: Sequence[str], storyboards: Sequence[str]) -> list[str]:
    """The UI pages worth opening after the demo, one line each; an asset's page opens on
    a partition (its pictures, its film), one line a partition."""

    def on(asset: str, keys: Sequence[str]) -> list[str]:
        return [f"{url}/assets/{asset}?view=partitions&partition={quote(key)}" for key in keys]

    lines = [
        f"overview:     {url}/overview/activity/assets",
        f"asset graph:  {url}/asset-groups (a group: {url}/locations/{LOCATION}/asset-groups/renders)",
    ]
    for label, links in (
        ("renders:", on("renders", partitions)),
        ("films:", on("films", storyboards)),
    ):
        lines += [f"{label if i == 0 else '':<14}{link}" for i, link in enumerate(links)]
    return lines + [
        f"job files:    {url}/assets/job_files?view=checks",
        f"all_results:  {url}/assets/all_results",
        f"runs:         {url}/runs",
        f"sensor:       {url}/locations/{LOCATION}/sensors/job_file_sensor",
    ]


# What Dagster's commands (``dagster job launch``, ``dg launch``) need to act on the kept
# demo's home, servers and store as its daemon does.
ENV_FILE = "env"
SHARED_SETTINGS = (
    "DAGSTER_HOME",
    "COMFY_ASSETS_SERVERS",
    "COMFY_ASSETS_STORE",
    "COMFY_ASSETS_JOB_DIRS",
    "COMFY_ASSETS_MEDIA_URL",
)


def write_env(demo_dir: Path, env: dict[str, str]) -> str:
    """Write ``<demo_dir>/env``, the kept demo's settings as shell ``export`` lines; return
    how to name it from the current folder (``.demo/env``) for ``. FILE``."""
    path = demo_dir / ENV_FILE
    try:
        name = str(path.relative_to(Path.cwd()))
    except ValueError:
        name = str(path)
    lines = [f"export {key}={shlex.quote(env[key])}" for key in SHARED_SETTINGS if key in env]
    header = f"# The kept demo's settings for Dagster's commands (dagster, dg): . {name}"
    path.write_text("\n".join([header, *lines]) + "\n")
    return name


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Ends the demo through its finally blocks, like Ctrl+C, so children are stopped.
    raise SystemExit(128 + signum)


def run_demo(
    demo_dir: Path, *, keep: bool, ui: bool, port: int | None, timeout_s: float, jobs_dir: Path
) -> int:
    """Run the demo; returns the exit status (0 only for a complete, correct render)."""
    if (demo_dir / PIDS_FILE).exists():
        raise DemoFailed(
            f"a kept demo may still be running ({demo_dir / PIDS_FILE}); "
            f"stop it first: {_stop_command(demo_dir)}"
        )
    port = _ui_port(port) if ui else port
    expected = expected_files(jobs_dir)
    home, logs, store = _fresh_folders(demo_dir)
    env = _demo_env(home, store, jobs_dir)
    children = Children(logs)
    kept = False
    try:
        _start_fakes(children, env, demo_dir)
        if ui:
            _start_media(children, env, store)

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
                announce(f"web UI starting at {ui_url}")
            announce(f"Dagster home {home}; logs in {logs}")

            states = wait_for_runs(instance, expected, watched, timeout_s)
            wait_for_films(instance, expected, watched, min(timeout_s, 120.0))
            problems: list[str] = []
            for item in expected:
                run_id = states[item.key].run_id or ""
                problems += report_partition(instance, item, run_id, store)
            problems += report_all_results(instance, expected, watched, min(timeout_s, 120.0))
        if problems:
            raise DemoFailed("the results are not complete:\n  " + "\n  ".join(problems))
        announce(f"all {len(expected)} job files rendered; every job line has its row")

        if keep:
            if ui:
                wait_for_ui(ui_url, watched[-1])
            save_pids(demo_dir, children)
            kept = True
            _announce_kept(demo_dir, children, env, ui_url if ui else None, expected)
        return 0
    finally:
        if not kept:
            children.stop()


def _ui_port(port: int | None) -> int:
    """The web UI's port: ``port`` if free (DemoFailed if taken), else DEFAULT_PORT or,
    when that is taken, a free one."""
    if port is None:
        port = DEFAULT_PORT if port_free(DEFAULT_PORT) else free_port()
        if port != DEFAULT_PORT:
            announce(f"port {DEFAULT_PORT} is taken; the web UI uses port {port}")
    elif not port_free(port):
        raise DemoFailed(f"port {port} is taken; pass another --port N, or none to pick one")
    return port


def _fresh_folders(demo_dir: Path) -> tuple[Path, Path, Path]:
    """Empties ``demo_dir`` and makes its (Dagster home, logs, store) folders."""
    if demo_dir.exists():
        shutil.rmtree(demo_dir)
    home = demo_dir / "dagster_home"
    logs = demo_dir / "logs"
    store = demo_dir / "store"
    for folder in (home, logs, store):
        folder.mkdir(parents=True)
    shutil.copy(TEMPLATE, home / "dagster.yaml")
    return home, logs, store


def _demo_env(home: Path, store: Path, jobs_dir: Path) -> dict[str, str]:
    """The environment of the demo's processes."""
    env = dict(os.environ)
    env.pop("COMFY_ASSETS_DB_URL", None)  # the demo's store is SQLite in .demo/store
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "COMFY_ASSETS_STORE": str(store),
            "COMFY_ASSETS_JOB_DIRS": str(jobs_dir),
            "COMFY_ASSETS_SENSOR_INTERVAL_S": str(SENSOR_INTERVAL_S),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _start_fakes(children: Children, env: dict[str, str], demo_dir: Path) -> None:
    """Starts the fake ComfyUI servers and names them in ``env``'s COMFY_ASSETS_SERVERS."""
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
    announce(f"fake ComfyUI servers: {servers}")


def _start_media(children: Children, env: dict[str, str], store: Path) -> None:
    """Starts the media server and names it in ``env``'s COMFY_ASSETS_MEDIA_URL."""
    # The UI has no way to serve a file: this server lets it show the pictures
    # and play the film (read-only, loopback only, the store folder alone).
    media_port = free_port()
    media_url = f"http://127.0.0.1:{media_port}"
    media = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]
    media += ["--directory", str(store), str(media_port)]
    wait_for_ui(media_url, children.start("media", media, env), what="the media server", path="/")
    env["COMFY_ASSETS_MEDIA_URL"] = media_url
    announce(f"pictures and films of {store} served at {media_url}")


def _announce_kept(
    demo_dir: Path,
    children: Children,
    env: dict[str, str],
    ui_url: str | None,
    expected: list[Expected],
) -> None:
    """Says what a --keep demo left running, its UI's pages, and how to stop it."""
    announce(f"kept running: {', '.join(f'{c.name} pid {c.proc.pid}' for c in children.items)}")
    if ui_url is not None:
        announce(f"open the UI at {ui_url}:")
        keys = [item.key for item in expected]
        storyboards = [item.key for item in expected if item.shots]
        for line in pages(ui_url, keys, storyboards):
            announce(f"  {line}")
    announce(f"stop them with: {_stop_command(demo_dir)}")
    settings = write_env(demo_dir, env)
    announce(f"Dagster commands on this home (dagster, dg) need its settings: . {settings}")


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
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"web UI port (default {DEFAULT_PORT}, or a free one when it is taken)",
    )
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
    if importlib.util.find_spec("aiohttp") is None:
        announce(
            "FAILED: the demo runs on the fake ComfyUI servers: pip install 'comfy-assets[fake]'"
        )
        return 1
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
        announce(f"FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        announce("interrupted; stopped everything the demo started")
        return 130


if __name__ == "__main__":
    sys.exit(main())
