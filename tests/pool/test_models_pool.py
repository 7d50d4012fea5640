"""A pool that knows its models: jobs go only where their node classes and model files
are (each server's /object_info), a job no server can run is a dead letter with nothing
posted, a server restarted with another model file is used for it at once, and jobs of
one model stay on the servers holding it (counted from the fakes' own model loads)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.model import Job, JobFile
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.pool.pool import Pool
from comfy_assets.render.run import run_one
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.ports import free_port
from tests.support import (
    batch_over_fakes,
    fake_servers,
    fast_batch,
    fast_config,
    posted,
    wait_until,
    write_jobs,
)


def model_jobs(folder: Path, checkpoints: list[str], salt: str = "") -> JobFile:
    """One text-to-image job per checkpoint name (data/workflows/text_to_image.json),
    each its own seed."""
    extra = [
        {"set": {"4.ckpt_name": name, "3.seed": i, "5.width": 64, "5.height": 64}}
        for i, name in enumerate(checkpoints)
    ]
    path = write_jobs(
        folder, len(checkpoints), workflow="text_to_image.json", extra=extra, salt=salt
    )
    return load_job_file(path)


def ids_of(jf: JobFile, checkpoint: str) -> set[str]:
    return {j.prompt_id for j in jf.jobs if checkpoint in j.models}


def loads(fake: FakeComfy) -> int:
    return sum(len(times) for times in fake.stats["model_loads"].values())


async def test_a_job_whose_checkpoint_only_gpu1_lists_is_posted_only_to_gpu1(tmp_path):
    gpu0 = FakeComfy(models=["a.safetensors"], prompt_seconds=0.001)
    gpu1 = FakeComfy(models=["a.safetensors", "b.safetensors"], prompt_seconds=0.001)
    jf = model_jobs(tmp_path / "jobs", ["b.safetensors", "a.safetensors"] * 4)
    summary = await batch_over_fakes(jf, Store(tmp_path / "s"), gpu0, gpu1)
    assert summary.done == 8
    only_b = ids_of(jf, "b.safetensors")
    assert [posted(gpu0, p) for p in only_b] == [0] * 4
    assert [posted(gpu1, p) for p in only_b] == [1] * 4


async def test_a_job_whose_checkpoint_no_server_lists_is_a_dead_letter_with_nothing_posted(
    tmp_path,
):
    gpu0 = FakeComfy(models=["a.safetensors"], prompt_seconds=0.001)
    gpu1 = FakeComfy(models=["a.safetensors"], prompt_seconds=0.001)
    jf = model_jobs(tmp_path / "jobs", ["a.safetensors", "sdxl_base.safetensors", "a.safetensors"])
    lines: list[str] = []
    store = Store(tmp_path / "s")
    summary = await batch_over_fakes(jf, store, gpu0, gpu1, on_line=lines.append)
    (missing,) = [j for j in jf.jobs if "sdxl_base.safetensors" in j.models]
    reason = "no server has checkpoint 'sdxl_base.safetensors' (gpu0, gpu1 checked)"
    assert (summary.done, summary.dead_letters) == (2, [(missing.id, reason)])
    assert (posted(gpu0, missing.prompt_id), posted(gpu1, missing.prompt_id)) == (0, 0)
    assert f"job {missing.id}: dead-lettered, {reason}" in lines
    assert store.get(missing.id).server is None


async def test_a_job_waits_for_a_server_that_comes_up_with_its_model(tmp_path):
    gpu0 = FakeComfy(models=["a.safetensors"], prompt_seconds=0.001)
    gpu1 = FakeComfy(models=["c.safetensors"], prompt_seconds=0.001)
    port = free_port()
    jf = model_jobs(tmp_path / "jobs", ["c.safetensors", "a.safetensors", "a.safetensors"])
    store = Store(tmp_path / "s")
    async with fake_servers(gpu0) as (up,):
        servers = [up, ServerSpec("gpu1", f"http://127.0.0.1:{port}")]
        task = asyncio.create_task(fast_batch(jf, servers, store))
        # gpu1 is down and gpu0 lacks c: the a jobs run, the c job waits, unposted.
        await wait_until(lambda: store.counts("p").get("succeeded", 0) == 2, 30, "the a jobs")
        assert not task.done()
        async with gpu1.serve(port=port):
            summary = await asyncio.wait_for(task, 30)
    assert summary.done == 3
    (c_job,) = ids_of(jf, "c.safetensors")
    assert (posted(gpu0, c_job), posted(gpu1, c_job)) == (0, 1)


async def test_a_server_restarted_with_a_new_model_file_is_used_for_it_in_the_same_pool(
    tmp_path,
):
    gpu0 = FakeComfy(models=["a.safetensors"], prompt_seconds=0.001)
    gpu1 = FakeComfy(models=["a.safetensors"], prompt_seconds=0.001)
    port = free_port()
    jf = model_jobs(tmp_path / "jobs", ["a.safetensors", "a.safetensors", "new.safetensors"])
    store = Store(tmp_path / "s")
    config = fast_config()
    states = []
    async with gpu0.serve(port=0) as url0:
        servers = [ServerSpec("gpu0", url0), ServerSpec("gpu1", f"http://127.0.0.1:{port}")]
        async with Pool(servers, store, owner="me", settings=config) as pool:

            async def run(job: Job) -> None:
                ran = await run_one(
                    job, partition="p", pool=pool, store=store, config=config, owner="me"
                )
                states.append(ran.state)

            async with gpu1.serve(port=port):
                for job in jf.jobs[:2]:
                    await run(job)
            gpu1.models.set_files(["a.safetensors", "new.safetensors"])
            async with gpu1.serve(port=port):  # started again, with the new file
                await run(jf.jobs[2])
    assert states == ["succeeded"] * 3
    new = jf.jobs[2].prompt_id
    assert (posted(gpu0, new), posted(gpu1, new)) == (0, 1)


async def test_jobs_of_one_model_stay_on_the_server_holding_it(tmp_path):
    # Two servers, two checkpoints in alternation: each server loads one and keeps it.
    fakes = [
        FakeComfy(models=["a.safetensors", "b.safetensors"], prompt_seconds=0.002, model_load_s=0.2)
        for _ in range(2)
    ]
    names = ["a.safetensors", "b.safetensors"] * 10
    jf = model_jobs(tmp_path / "jobs", names)
    summary = await batch_over_fakes(jf, Store(tmp_path / "s"), *fakes)
    assert summary.done == 20
    assert [loads(f) for f in fakes] == [1, 1]
