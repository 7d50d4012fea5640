"""Prometheus metrics of ``run --metrics-port`` and ``worker --metrics-port``: scraped over
HTTP and read with prometheus-client's own parser."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.metrics import Metrics
from comfy_assets.render import run as run_module
from comfy_assets.render import steering
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.ports import free_port
from tests.support import ROOT, batch_over_fakes, write_jobs

pytestmark = pytest.mark.timeout(90)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def served_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fakes: list[FakeComfy], jobs: int
) -> int:
    """Serve metrics on a free port, run ``jobs`` jobs on ``fakes`` (all done); the port."""
    metrics = Metrics()
    monkeypatch.setattr(run_module, "pool_watchers", [])
    monkeypatch.setattr(steering, "watchers", [])
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    store = Store(tmp_path / "s")
    metrics.track_store(store, "p")
    summary = await batch_over_fakes(
        load_job_file(write_jobs(tmp_path / "jobs", jobs)), store, *fakes
    )
    assert summary.done == jobs
    return port


async def test_a_batch_shows_its_jobs_attempts_prompt_seconds_and_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = [FakeComfy(script=["500", "ok"], prompt_seconds=0.01), FakeComfy(prompt_seconds=0.01)]
    port = await served_batch(tmp_path, monkeypatch, fakes, 4)
    samples = scrape(port)
    assert all(name.startswith("comfy_assets_") for name, _ in samples if "python" not in name)
    assert samples[("comfy_assets_jobs", (("state", "succeeded"),))] == 4
    attempts = {
        labels: v for (name, labels), v in samples.items() if name == "comfy_assets_attempts_total"
    }
    assert sum(attempts.values()) == 5  # one POST answered 500, retried
    assert attempts[(("outcome", "transient"), ("server", "gpu0"))] == 1
    counted = sum(
        v for (name, _), v in samples.items() if name == "comfy_assets_prompt_seconds_count"
    )
    assert counted == 4
    for gpu in ("gpu0", "gpu1"):
        assert samples[("comfy_assets_server_up", (("server", gpu),))] == 1
        assert samples[("comfy_assets_server_quarantined", (("server", gpu),))] == 0


UP = ("comfy_assets_server_up", (("server", "gpu0"),))


def scraped_while_running(
    tmp_path: Path,
    command: str,
    enough: Callable[[dict], bool],
    *extra: str,
    meanwhile: Callable[[int], None] = lambda port: None,
) -> tuple[int, str, dict]:
    """``comfy-assets COMMAND`` over 4 jobs on one fake (0.3 s a node) with ``--metrics-port``
    (and ``extra``) as a process of its own, scraped every 0.1 s until ``enough(samples)`` or
    its end (60 s at most); ``meanwhile(port)`` runs then, while it may still serve. Returns
    its exit code, its stderr and the last samples."""
    fake = FakeComfy(prompt_seconds=0.3)
    jobs = write_jobs(tmp_path / "jobs", 4)
    port = free_port()
    with fake.serve_in_thread(port=0) as url:
        cmd = [sys.executable, "-m", "comfy_assets.cli", command, "--jobs", str(jobs)]
        cmd += ["--server", f"gpu0={url}", "--store", str(tmp_path / "s")]
        cmd += ["--metrics-port", str(port), *extra, "--poll-s", "0.05"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        samples: dict = {}
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    samples = scrape(port)
                except OSError:
                    samples = {}
                if enough(samples):
                    break
                time.sleep(0.1)  # polling a server another process runs: no event to wait on
            meanwhile(port)
        finally:
            _, err = proc.communicate(timeout=60)
    return proc.returncode, err.decode(), samples


def test_run_metrics_port_serves_while_the_batch_runs(tmp_path: Path) -> None:
    def refused_elsewhere(port: int) -> None:
        # Listening on 127.0.0.1 alone: another loopback address of this host refuses.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()

    code, err, samples = scraped_while_running(
        tmp_path,
        "run",
        lambda s: any(k[0] == "comfy_assets_jobs_waiting" for k in s) and bool(s.get(UP)),
        "--metrics-host",
        "127.0.0.1",
        meanwhile=refused_elsewhere,
    )
    assert code == 0, err
    assert samples[("comfy_assets_server_up", (("server", "gpu0"),))] == 1
    assert any(k[0] == "comfy_assets_jobs_waiting" for k in samples)
    assert sum(v for k, v in samples.items() if k[0] == "comfy_assets_jobs") == 4


@pytest.mark.parametrize("command", ["run", "worker"])
def test_a_refused_metrics_option_is_said_and_leaves_no_store(tmp_path: Path, command: str) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    cmd = [sys.executable, "-m", "comfy_assets.cli", command, "--jobs", str(jobs)]
    cmd += ["--server", "gpu0=http://127.0.0.1:9", "--store", str(tmp_path / "s")]
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [*cmd, "--metrics-port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert f"error: --metrics-port {port}:" in proc.stderr
    alone = subprocess.run([*cmd, "--metrics-host", "127.0.0.1"], cwd=ROOT, capture_output=True)
    assert alone.returncode == 2
    assert b"error: --metrics-host needs --metrics-port" in alone.stderr
    # Refused before the store opens: no store folder, no empty store.db.
    assert not (tmp_path / "s").exists()


def test_worker_metrics_port_serves_its_pool_and_the_stores_jobs(tmp_path: Path) -> None:
    def one_done_and_up(samples: dict) -> bool:
        done = samples.get(("comfy_assets_jobs", (("state", "succeeded"),)), 0)
        return done >= 1 and bool(samples.get(UP))

    code, err, samples = scraped_while_running(tmp_path, "worker", one_done_and_up)
    assert code == 0, err
    assert samples[("comfy_assets_server_up", (("server", "gpu0"),))] == 1
    assert samples[("comfy_assets_server_quarantined", (("server", "gpu0"),))] == 0
    assert samples[("comfy_assets_jobs", (("state", "succeeded"),))] >= 1
    assert any(k[0] == "comfy_assets_prompt_seconds_count" for k in samples)


def prometheus_query(web: str, query: str) -> list[dict]:
    """The result vector of an instant ``query`` at a Prometheus listening on ``web``."""
    url = f"http://{web}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["data"]["result"]


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="no prometheus binary (Debian's package, which .ci/run installs where apt works)",
)
async def test_a_real_prometheus_scrapes_the_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = [FakeComfy(prompt_seconds=0.01), FakeComfy(prompt_seconds=0.01)]
    port = await served_batch(tmp_path, monkeypatch, fakes, 3)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: comfy_assets, static_configs: [{{targets: ['127.0.0.1:{port}']}}]}}\n"
    )
    web = f"127.0.0.1:{free_port()}"
    cmd = ["prometheus", f"--config.file={config}", f"--web.listen-address={web}"]
    cmd += [f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            found: list[dict] = []
            deadline = time.monotonic() + 60
            while not found and time.monotonic() < deadline:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
                try:
                    found = prometheus_query(web, 'comfy_assets_jobs{state="succeeded"}')
                except OSError:
                    found = []
                if not found:
                    time.sleep(0.2)  # polling another process's scrapes: no event to wait on
            up = prometheus_query(web, 'up{job="comfy_assets"}')
            servers_up = prometheus_query(web, "comfy_assets_server_up")
            quarantined = prometheus_query(web, "comfy_assets_server_quarantined")
        finally:
            proc.terminate()
            proc.wait(30)
    assert [float(r["value"][1]) for r in found] == [3.0]
    assert [float(r["value"][1]) for r in up] == [1.0]
    assert {r["metric"]["server"]: float(r["value"][1]) for r in servers_up} == {
        "gpu0": 1.0,
        "gpu1": 1.0,
    }
    assert {r["metric"]["server"] for r in quarantined} == {"gpu0", "gpu1"}


def test_a_first_scrape_answers_the_jobs_while_a_slow_read_of_the_attempts_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A million-job partition's attempts take seconds to count: the process's first
    # scrape answers without them, the next one after that read ended with them.
    store = Store(tmp_path / "s")
    store.register_jobs("p", load_job_file(write_jobs(tmp_path / "jobs", 3)).jobs)
    release = threading.Event()

    def slow_read(partitions: object) -> dict[tuple[str, str], int]:
        release.wait(30)
        return {("gpu0", "success"): 2}

    monkeypatch.setattr(store, "attempt_outcome_counts", slow_read)
    metrics = Metrics()
    metrics.track_store(store, "p")

    first = {
        f.name: f
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
    }
    assert [(s.labels, s.value) for s in first["comfy_assets_jobs"].samples] == [
        ({"state": "pending"}, 3.0)
    ]
    assert first["comfy_assets_attempts"].samples == []
    assert (
        "none until the process's first read of them ends"
        in first["comfy_assets_attempts"].documentation
    )

    (lagging,) = metrics._tries.values()
    reading = lagging._thread
    assert reading is not None
    release.set()
    reading.join()

    later = {
        f.name: f
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
    }
    assert [(s.labels, s.value) for s in later["comfy_assets_attempts"].samples] == [
        ({"server": "gpu0", "outcome": "success"}, 2.0)
    ]
    store.close()
