"""What each command loads: ``health`` as a readiness probe starts without an event loop,
aiohttp, pandas, SQLAlchemy, PIL, PyAV, aio-pika or Dagster, and ``run``, ``events`` and ``requeue``
without the libraries they have no use for (pandas included). Each command runs in a fresh interpreter
(``sys.modules`` of this test process already holds everything), which prints its exit
code and the packages it imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.comfy.test_client import free_port
from tests.support import ROOT, job_id, write_jobs

PACKAGES = [
    "asyncio",
    "pandas",
    "sqlalchemy",
    "PIL",
    "av",
    "aio_pika",
    "dagster",
    "httpx",
    "aiohttp",
    "websockets",
]

# Runs the command as `comfy-assets ARGV...` would, then names the PACKAGES it imported.
PROBE = f"""
import json, sys
from comfy_assets.cli.main import main
code = main(sys.argv[1:])
print(json.dumps({{"code": code, "loaded": [p for p in {PACKAGES!r} if p in sys.modules]}}))
"""


def command(*argv: str) -> tuple[int, list[str], list[str]]:
    """(exit code, packages loaded, the lines the command printed before the report)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    *lines, report = done.stdout.splitlines()
    answer = json.loads(report)
    return answer["code"], answer["loaded"], lines


def test_health_of_a_live_and_a_dead_server_loads_none_of_them():
    dead = f"http://127.0.0.1:{free_port()}"
    with FakeComfy().serve_in_thread(port=0) as url:
        code, loaded, lines = command(
            "health", "--server", f"gpu0={url}", "--server", f"gpu1={dead}"
        )
    assert code == 0
    assert lines[0].startswith("gpu0 healthy device=cpu")
    assert lines[1] == f"gpu1 unreachable: connection refused ({dead})"
    assert loaded == []


def test_events_and_requeue_load_the_store_and_nothing_of_rendering(tmp_path: Path):
    Store(tmp_path / "store").close()
    unknown = job_id(0, "imports")

    code, loaded, _ = command("events", "--store", str(tmp_path / "store"), "--job", unknown)
    assert code == 1  # no events for a job the store never saw
    assert loaded == ["asyncio", "sqlalchemy"]  # SQLAlchemy imports asyncio

    code, loaded, _ = command("requeue", unknown, "--store", str(tmp_path / "store"))
    assert code == 1  # not a dead letter
    assert loaded == ["asyncio", "sqlalchemy"]  # SQLAlchemy imports asyncio


def test_run_loads_neither_films_nor_the_broker_nor_dagster(tmp_path: Path):
    jobs = write_jobs(tmp_path / "jobs", 2)
    with FakeComfy(prompt_seconds=0.005).serve_in_thread(port=0) as url:
        code, loaded, lines = command(
            "run", "--jobs", str(jobs), "--server", f"gpu0={url}", "--store", str(tmp_path / "s")
        )
    assert code == 0
    assert "summary: 2 done, 0 dead-lettered" in lines
    # results.csv is written by the csv module: pandas is the Dagster assets' (metadata)
    assert loaded == ["asyncio", "sqlalchemy", "aiohttp", "websockets"]
