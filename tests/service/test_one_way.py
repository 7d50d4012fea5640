"""One way to run a batch: ``comfy-assets run``, the Dagster job and the worker write the
same results.csv for the same job file, and the worker honours the file's policy."""

from __future__ import annotations

import asyncio
import csv
import json
import shutil
from pathlib import Path

from dagster import instance_for_test, materialize

from comfy_assets.assets import render_results, renders
from comfy_assets.cli.main import main
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.resources import ComfyPoolResource, ResultStoreResource, ServerConfig
from comfy_assets.service.messages import file_messages
from comfy_assets.service.sources import MemorySource
from comfy_assets.service.worker import Worker
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import WORKFLOWS, fake_servers, fast_config, job_id, posted, run_argv

SAME = ["job_id", "1.color", "1.width", "state", "attempts", "files", "reason"]


def job_file(folder: Path, name: str, lines: list[dict], header: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORKFLOWS / "image.json", folder / "image.json")
    rows = [{"header": header}] if header else []
    rows += [{"workflow": "image.json", **line} for line in lines]
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def table(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return [{k: row.get(k, "") for k in SAME} for row in csv.DictReader(handle)]


async def by_worker(jobs: Path, url: str, store: Store) -> Worker:
    source = MemorySource("queue-name")
    for _, body in file_messages(load_job_file(jobs)):
        source.put(body.decode())
    source.end()
    worker = Worker(
        source,
        servers=[ServerSpec("gpu0", url)],
        store=store,
        config=fast_config(attempts=1),
        workflows_dir=jobs.parent / "elsewhere",
        # One message at a time, as run and Dagster post them: the fakes' scripts answer
        # by the order of POSTs, which two messages in hand per server may swap.
        jobs_per_server=1,
    )
    await asyncio.wait_for(worker.run(), 60)
    return worker


def test_run_dagster_and_the_worker_write_the_same_results_csv(tmp_path, monkeypatch):
    lines = [
        {"id": job_id(i, "same"), "set": {"1.color": 100 + i, "1.width": 32 + 8 * i}}
        for i in range(4)
    ]
    jobs = job_file(tmp_path / "jobs", "same", lines)
    monkeypatch.setenv("COMFY_ASSETS_JOB_DIRS", str(jobs.parent))
    # Each way on a fake of its own, the third job refused by validation every time.
    fakes = [FakeComfy(script=["ok", "ok", "invalid"], prompt_seconds=0.005) for _ in range(3)]
    with fakes[0].serve_in_thread(port=0) as url:
        fast = ["--attempts", "1", "--poll-s", "0.05"]
        code = main(run_argv(jobs, tmp_path / "a", [f"gpu0={url}"], *fast))
        assert code == 1  # one dead letter
    with fakes[1].serve_in_thread(port=0) as url, instance_for_test() as instance:
        instance.add_dynamic_partitions("job_files", ["same"])
        comfy = ComfyPoolResource(
            servers=[ServerConfig(name="gpu0", url=url)], attempts=1, poll_s=0.05
        )
        result = materialize(
            [renders, render_results],
            partition_key="same",
            instance=instance,
            resources={
                "comfy": comfy,
                "result_store": ResultStoreResource(folder=str(tmp_path / "b")),
            },
            raise_on_error=False,
        )
        assert result.success

    async def worker() -> None:
        async with fake_servers(fakes[2]) as servers:
            await by_worker(jobs, servers[0].url, Store(tmp_path / "c"))

    asyncio.run(worker())
    tables = [table(tmp_path / store / "same" / "results.csv") for store in ("a", "b", "c")]
    assert tables[0] == tables[1] == tables[2]
    assert [row["state"] for row in tables[0]] == [
        "succeeded",
        "succeeded",
        "failed_fatal",
        "succeeded",
    ]
    assert [row["job_id"] for row in tables[0]] == [line["id"] for line in lines]


async def test_the_worker_stops_a_storyboard_at_its_first_fatal_shot_under_delivery(tmp_path):
    lines = [
        {"id": job_id(i, "board"), "set": {"1.color": 10 + i}, "shot": i + 1} for i in range(3)
    ]
    jobs = job_file(tmp_path / "jobs", "board", lines, header={"policy": "delivery"})
    fake = FakeComfy(script=["error"], prompt_seconds=0.005)
    store = Store(tmp_path / "store")
    source = MemorySource("render")
    for _, body in file_messages(load_job_file(jobs)):
        source.put(body.decode())
    source.end()
    async with fake_servers(fake) as servers:
        worker = Worker(source, servers=servers, store=store, config=fast_config(attempts=1))
        await asyncio.wait_for(worker.run(), 60)
    shots = load_job_file(jobs).jobs
    assert posted(fake, shots[0].prompt_id) == 1
    assert [posted(fake, shot.prompt_id) for shot in shots[1:]] == [0, 0]
    reasons = [reason for _, reason in source.dead]
    assert len(reasons) == 3
    assert all(
        r.startswith("delivery policy: storyboard board stopped after the fatal failure of shot 1")
        for r in reasons[1:]
    )
    assert [row["state"] for row in table(tmp_path / "store" / "board" / "results.csv")] == [
        "failed_fatal",
        "pending",
        "pending",
    ]
    assert worker.counts["stopped"] == 2
