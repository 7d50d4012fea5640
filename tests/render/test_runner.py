"""Exactly-once and failure classification, seen from the fake server's own records."""

from __future__ import annotations

import asyncio
import hashlib
import socket
from pathlib import Path

import httpx
import pytest

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import UnexpectedAnswer
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render import removal
from comfy_assets.render.blame import graph_sha256
from comfy_assets.render.outcome import Failure
from comfy_assets.store import Store
from fake_comfy import FakeComfy, recorded
from tests.support import (
    assert_stored_as_served,
    batch_over_fakes,
    executed,
    fake_servers,
    fast_batch,
    fast_config,
    gone_owner,
    job_id,
    left_submitted_by_a_gone_run,
    one_job,
    posted,
    running,
    wait_until,
    write_jobs,
)


async def render(tmp_path: Path, script: list[str], count: int = 1, **config: object):
    """Run ``count`` jobs on one fake following ``script``; returns (fake, job file, store, summary)."""
    fake = FakeComfy(script=script, prompt_seconds=0.005)
    job_file = load_job_file(write_jobs(tmp_path / "jobs", count))
    store = Store(tmp_path / "store")
    summary = await batch_over_fakes(job_file, store, fake, config=fast_config(**config))
    return fake, job_file, store, summary


async def test_ok_renders_files_with_their_sha256(tmp_path):
    fake, jf, store, summary = await render(tmp_path, ["ok"])
    job = jf.jobs[0]
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    assert summary.done == 1 and summary.dead_lettered == 0
    files = store.files(job.id)
    assert sorted(Path(f.path).name for f in files) == ["inverted_00001_.png", "solid_00001_.png"]
    for f in files:
        data = (store.job_dir("p", job.id) / f.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256 and len(data) == f.bytes


async def test_duplicate_delivery_of_a_done_job_posts_nothing(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 3))
    store = Store(tmp_path / "store")
    lines: list[str] = []
    async with fake_servers(fake) as servers:
        for _ in range(2):
            await fast_batch(jf, servers, store, on_line=lines.append)
    assert [posted(fake, j.prompt_id) for j in jf.jobs] == [1, 1, 1]
    assert sum("already done, nothing posted" in line for line in lines) == 3


async def test_500_then_ok_posts_twice_and_executes_once(tmp_path):
    fake, jf, store, summary = await render(tmp_path, ["500", "ok"])
    pid = jf.jobs[0].prompt_id
    assert (posted(fake, pid), executed(fake, pid)) == (2, 1)
    assert summary.done == 1
    attempts = store.attempts(jf.jobs[0].id)
    assert [a.outcome for a in attempts] == ["transient", "success"]
    assert "POST /prompt 500" in attempts[0].reason


async def test_dropped_socket_is_followed_without_a_second_post(tmp_path):
    fake, jf, store, summary = await render(tmp_path, ["drop"])
    pid = jf.jobs[0].prompt_id
    assert (posted(fake, pid), executed(fake, pid)) == (1, 1)
    assert summary.done == 1


@pytest.mark.parametrize(
    ("word", "expected"),
    [("invalid", "POST /prompt 400, prompt_outputs_failed_validation"), ("error", "IndexError")],
)
async def test_validation_and_execution_errors_are_dead_lettered_at_once(tmp_path, word, expected):
    fake, jf, store, summary = await render(tmp_path, [word])
    pid = jf.jobs[0].prompt_id
    assert posted(fake, pid) == 1
    assert summary.dead_lettered == 1
    ((job_id, reason),) = summary.dead_letters
    assert expected in reason
    assert len(store.attempts(job_id)) == 1
    assert store.get(job_id).state == "failed_fatal"


async def test_oom_is_retried_and_index_error_is_not(tmp_path):
    fake, jf, store, summary = await render(tmp_path, ["oom", "ok"])
    pid = jf.jobs[0].prompt_id
    assert (posted(fake, pid), executed(fake, pid)) == (2, 2)
    assert summary.done == 1
    first = store.attempts(jf.jobs[0].id)[0]
    assert first.outcome == "transient" and "OutOfMemoryError" in first.reason
    assert "POST /free sent" in first.reason


async def test_a_hang_is_interrupted_removed_retried_then_dead_lettered(tmp_path):
    fake, jf, store, summary = await render(tmp_path, ["hang", "hang"], attempts=2, timeout_s=0.5)
    pid = jf.jobs[0].prompt_id
    assert (posted(fake, pid), executed(fake, pid)) == (2, 2)
    assert [r["outcome"] for r in fake.stats["runs"]] == ["interrupted", "interrupted"]
    ((job_id, reason),) = summary.dead_letters
    assert reason.startswith("gave up after 2 attempts, last: deadline of 0.5 s exceeded")


@pytest.mark.parametrize("word", ["late", "silent"])
async def test_late_and_silent_end_in_success_without_a_second_post(tmp_path, word):
    fake, jf, store, summary = await render(tmp_path, [word])
    pid = jf.jobs[0].prompt_id
    assert (posted(fake, pid), executed(fake, pid)) == (1, 1)
    assert summary.done == 1
    assert len(store.files(jf.jobs[0].id)) == 2


async def test_a_restart_loses_the_prompt_and_the_retry_renders_it(tmp_path):
    fake, jf, store, summary = await render(tmp_path, ["restart", "ok"])
    pid = jf.jobs[0].prompt_id
    assert posted(fake, pid) == 2
    assert [r["outcome"] for r in fake.stats["runs"] if r["prompt_id"] == pid] == [
        "lost",
        "success",
    ]
    assert summary.done == 1
    assert "lost" in store.attempts(jf.jobs[0].id)[0].reason


async def test_partial_outputs_are_a_permanent_failure(tmp_path):
    fake, jf, store, summary = await render(tmp_path, ["partial"])
    assert summary.dead_lettered == 1
    assert "node_errors" in summary.dead_letters[0][1]
    assert posted(fake, jf.jobs[0].prompt_id) == 1


async def render_edit_render(tmp_path, count: int, old: str, new: str):
    """Render ``count`` jobs, replace ``old`` by ``new`` in the job file, render again;
    returns (fake, first job file, second job file, store)."""
    fake = FakeComfy(prompt_seconds=0.005)
    folder = tmp_path / "jobs"
    store = Store(tmp_path / "store")
    async with fake_servers(fake) as servers:
        first = load_job_file(write_jobs(folder, count))
        await fast_batch(first, servers, store)
        text = (folder / "jobs.jsonl").read_text().replace(old, new)
        (folder / "jobs.jsonl").write_text(text)
        second = load_job_file(folder / "jobs.jsonl")
        await fast_batch(second, servers, store)
    return fake, first, second, store


async def test_a_changed_input_renders_again_and_the_same_input_does_not(tmp_path):
    fake, first, second, _ = await render_edit_render(
        tmp_path, 2, '"1.color": 1001', '"1.color": 7'
    )
    assert second.jobs[0].prompt_id == first.jobs[0].prompt_id
    assert second.jobs[1].prompt_id != first.jobs[1].prompt_id
    assert [len(fake.stats["prompts"])] == [3]
    assert executed(fake, second.jobs[1].prompt_id) == 1


async def test_a_deleted_output_is_fetched_again_without_rendering_again(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, store = one_job(tmp_path)
    lines: list[str] = []
    async with fake_servers(fake) as servers:
        await fast_batch(jf, servers, store)
        (first,) = [f for f in store.files(job.id) if "solid" in f.path]
        (store.job_dir("p", job.id) / first.path).unlink()
        summary = await fast_batch(jf, servers, store, on_line=lines.append)
    assert summary.done == 1
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    data = (store.job_dir("p", job.id) / first.path).read_bytes()
    assert hashlib.sha256(data).hexdigest() == first.sha256
    assert any(f"outputs missing: {first.path}" in line for line in lines)
    assert any("caught up, nothing posted" in line for line in lines)


async def test_an_edited_job_keeps_only_its_new_outputs(tmp_path):
    _, first, second, store = await render_edit_render(
        tmp_path, 1, '"1.color": 1000', '"1.color": 5'
    )
    assert first.jobs[0].prompt_id != second.jobs[0].prompt_id
    job_dir = store.job_dir("p", second.jobs[0].id)
    on_disk = sorted(p.relative_to(job_dir).as_posix() for p in job_dir.rglob("*") if p.is_file())
    assert on_disk == sorted(f.path for f in store.files(second.jobs[0].id))
    assert len(on_disk) == 2


async def test_the_claim_of_an_owner_whose_heartbeat_stopped_is_taken_over_at_once(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, store = one_job(tmp_path)
    store.register_jobs("p", jf.jobs)
    owner = gone_owner(store)
    assert store.claim(job.id, owner, lease_s=3600.0) == "claimed"
    lines: list[str] = []
    summary = await batch_over_fakes(jf, store, fake, on_line=lines.append)
    assert summary.done == 1
    taken = f"job {job.id}: claim taken over from {owner} (its holder is gone: no heartbeat for"
    assert any(line.startswith(taken) for line in lines), lines
    assert store.beat_owner(owner) is False  # found gone: it never comes back


async def test_delivery_posts_nothing_after_a_fatal_failure_while_another_server_renders(
    tmp_path,
):
    # A storyboard on two servers: shot 1 fails for good on gpu0 (its workflow is known
    # to fail so: a dead letter at its first failure) while gpu1 is still rendering
    # shot 2 (it hangs until the dead letter is written); the consumers already waiting
    # in line with their shots claimed must not post them once the delivery policy has
    # stopped the batch.
    failing = FakeComfy(script=["error"], prompt_seconds=0.005)
    hung = FakeComfy(script=["hang"], prompt_seconds=0.005)
    shots = [{"shot": i + 1} for i in range(8)]
    jf = load_job_file(write_jobs(tmp_path / "jobs", 8, extra=shots))
    store = Store(tmp_path / "store")
    first_line = recorded.index_error()["exception_message"].splitlines()[0]
    failure = Failure.execution_error("execution_error", "3", "IndexError", first_line, "")
    graph = graph_sha256(jf.jobs[0].workflow)
    store.job_failed_alike(job_id(99), graph, failure.signature, ["gpu8", "gpu9"], "IndexError")
    async with fake_servers(failing, hung) as servers:
        failing.pause()  # shot 1 fails only once shot 2 is rendering on gpu1
        batch = asyncio.create_task(
            fast_batch(jf, servers, store, config=fast_config(policy="delivery", attempts=1))
        )
        await wait_until(lambda: len(hung.stats["runs"]) == 1, 20.0, "the hung shot")
        failing.resume()
        await wait_until(lambda: store.dead_letters("p") != [], 20.0, "the dead letter")
        async with httpx.AsyncClient(base_url=servers[1].url) as http:
            await http.post("/interrupt", json={})  # someone ends the hung shot
        summary = await asyncio.wait_for(batch, 20.0)
    runs = failing.stats["runs"] + hung.stats["runs"]
    (fatal,) = [r for r in runs if r["outcome"] == "error"]
    # The hung shot, interrupted by someone else on its only attempt, is a dead letter too.
    assert summary.dead_lettered == 2
    assert "this workflow failed so on gpu8 and gpu9 before" in store.get(jf.jobs[0].id).reason
    assert [r for r in runs if r["start"] > fatal["end"]] == []
    assert len(runs) == 2  # the fatal shot and the hung one: nothing posted after the stop
    assert all(j.claimed_by is None for j in store.jobs("p"))


async def test_a_job_whose_inputs_change_while_it_waits_for_a_server_is_not_posted(tmp_path):
    # One slow server, three jobs: while job 1 renders, job 2 waits in line, claimed.
    # Another run re-registers the partition with job 2's inputs changed, which drops the
    # claim. This run must not post job 2's old prompt: it leaves the job to its holder.
    fake = FakeComfy(prompt_seconds=0.05)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 3))
    edited = [{}, {"set": {"1.color": 7}}, {}]
    jf2 = load_job_file(write_jobs(tmp_path / "jobs2", 3, name="jobs.jsonl", extra=edited))
    first, second = jf.jobs[0], jf.jobs[1]
    assert jf2.jobs[1].id == second.id and jf2.jobs[1].prompt_id != second.prompt_id
    store = Store(tmp_path / "store")
    lines: list[str] = []
    async with fake_servers(fake) as servers:
        batch = asyncio.create_task(fast_batch(jf, servers, store, on_line=lines.append))
        await wait_until(
            lambda: running(fake, first.prompt_id) and store.get(second.id).claimed_by,
            10.0,
            "job 1 rendering, job 2 claimed",
        )
        store.register_jobs("p", jf2.jobs)
        await batch
    assert posted(fake, second.prompt_id) == 0
    assert [executed(fake, j.prompt_id) for j in (first, jf.jobs[2])] == [1, 1]
    rec = store.get(second.id)
    assert (rec.state, rec.prompt_id, rec.claimed_by) == ("pending", jf2.jobs[1].prompt_id, None)
    assert any(f"job {second.id}: claim lost" in line for line in lines)


def server_bytes(fake: FakeComfy) -> dict[str, str]:
    """sha256 of every file in the fake's output folder, by file name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in fake.output_dir.rglob("*")
        if p.is_file()
    }


async def test_outputs_gone_from_the_server_are_rendered_anew_after_the_cache_is_freed(tmp_path):
    # The server's output folder was cleaned while /history still lists the files: the
    # catch-up's download gets 404, and the next attempt renders anew (after POST /free:
    # an identical prompt would replay the missing names, README fact 11).
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, store = one_job(tmp_path)
    lines: list[str] = []
    async with fake_servers(fake) as servers:
        await fast_batch(jf, servers, store)
        for f in store.files(job.id):
            (store.job_dir("p", job.id) / f.path).unlink()
        for p in fake.output_dir.rglob("*.png"):
            p.unlink()
        summary = await fast_batch(jf, servers, store, on_line=lines.append)
    assert summary.done == 1, lines
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (2, 2)
    assert fake.stats["requests"].get("POST /free") == 1
    on_server = server_bytes(fake)
    assert_stored_as_served(store, "p", job.id, on_server)
    details = [e.detail or "" for e in store.events(job.id)]
    assert any("outputs missing" in d for d in details)
    assert any("ComfyUI's cache freed" in d for d in details)


async def test_outputs_that_stay_missing_end_as_a_dead_letter_naming_the_404(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, store = one_job(tmp_path)
    stop = asyncio.Event()

    async def clean_output_folder() -> None:
        # Like a cron job that empties the server's output folder as files appear.
        while not stop.is_set():
            for p in fake.output_dir.rglob("*.png"):
                p.unlink(missing_ok=True)
            await asyncio.sleep(0)

    async with fake_servers(fake) as servers:
        cleaner = asyncio.create_task(clean_output_folder())
        summary = await fast_batch(jf, servers, store, config=fast_config(attempts=3))
        stop.set()
        await cleaner
    assert summary.dead_lettered == 1
    (reason,) = [r for _, r in summary.dead_letters]
    assert reason.startswith("gave up after 3 attempts, last: outputs missing:")
    assert "404" in reason
    assert executed(fake, job.prompt_id) == 3


async def test_a_catch_up_that_cannot_reach_the_previous_server_waits_before_posting_elsewhere(
    tmp_path,
):
    # The job was posted to gpu0 (the store says so), then gpu0 stops answering. Posting
    # on gpu1 at once could render it twice; the attempt asks gpu0 again for catch_up_s.
    gpu0, gpu1 = FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)
    jf, job, store = left_submitted_by_a_gone_run(tmp_path)
    lines: list[str] = []
    async with fake_servers(gpu0, gpu1) as servers:
        # gpu0 refuses connections from now on: a port nobody listens on.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        servers[0] = type(servers[0])("gpu0", dead)
        summary = await fast_batch(
            jf,
            servers,
            store,
            config=fast_config(catch_up_s=0.3, probe_timeout_s=0.2),
            on_line=lines.append,
        )
    assert summary.done == 1, lines
    assert (posted(gpu1, job.prompt_id), executed(gpu1, job.prompt_id)) == (1, 1)
    details = [e.detail or "" for e in store.events(job.id)]
    assert any("catch-up on gpu0 not possible for 0.3 s" in d for d in details)
    assert any("may render twice" in d for d in details)


async def test_a_prompt_that_cannot_be_followed_is_removed_not_left_running(tmp_path, monkeypatch):
    # The server answers, but not /history of one prompt (an HTML page, say): that run
    # is interrupted and removed, not left hanging on the GPU for nobody.
    fake = FakeComfy(script=["ok", "hang"], prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 3))
    hung = jf.jobs[1].prompt_id
    history = ComfyClient.history
    garbled: list[str] = []

    async def garbled_once(self: ComfyClient, prompt_id: str):
        if prompt_id == hung and not garbled:
            garbled.append(prompt_id)
            raise UnexpectedAnswer(f"{self.name}: GET /history/{prompt_id}: body is not JSON")
        return await history(self, prompt_id)

    monkeypatch.setattr(ComfyClient, "history", garbled_once)
    store = Store(tmp_path / "store")
    async with fake_servers(fake) as servers:
        summary = await asyncio.wait_for(
            fast_batch(jf, servers, store),
            20.0,
        )
    assert summary.done == 3
    assert [r["outcome"] for r in fake.stats["runs"] if r["prompt_id"] == hung] == [
        "interrupted",
        "success",
    ]
    (failed,) = [e for e in store.events(jf.jobs[1].id) if e.to_state == "failed_retryable"]
    assert failed.detail.endswith("; prompt interrupted and removed from gpu0")


async def test_a_removal_waiting_on_a_long_node_says_so_before_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An interrupt lands between nodes: a run cancelled (Ctrl+C) in a long node waits for
    # it to end before its prompt leaves /queue, and says so instead of going silent.
    monkeypatch.setattr(removal, "SAY_WAITING_S", 0.05)
    fake = FakeComfy(script=["slow"], prompt_seconds=0.2)  # its nodes take 2 s each
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    store = Store(tmp_path / "store")
    async with fake_servers(fake) as servers:
        task = asyncio.create_task(fast_batch(jf, servers, store))

        def rendering() -> bool:
            rec = store.get(jf.jobs[0].id)  # None until the batch registers its jobs
            return rec is not None and rec.state == "rendering"

        await wait_until(rendering, 20.0, "its prompt executing")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    [line] = [
        r.getMessage() for r in caplog.records if "after it was interrupted" in r.getMessage()
    ]
    assert f"prompt {jf.jobs[0].prompt_id} still on gpu0 " in line
    assert line.endswith("waiting up to 120 s in all for it to leave")
    assert [r["outcome"] for r in fake.stats["runs"]] == ["interrupted"]
    last = store.events(jf.jobs[0].id)[-1]
    assert last.detail == "run cancelled; prompt interrupted and removed from gpu0"


async def test_a_400_that_echoes_a_huge_value_gives_a_reason_of_a_few_lines(tmp_path):
    # ComfyUI v0.8.0 puts the value it could not convert in its 400 (twice): a reason
    # keeps its start, so a megabyte in `set` does not make a megabyte of dead letter.
    huge = "x" * 100_000
    jobs = write_jobs(tmp_path / "jobs", 1, extra=[{"set": {"1.width": huge}}])
    store = Store(tmp_path / "store")
    lines: list[str] = []
    summary = await batch_over_fakes(
        load_job_file(jobs), store, FakeComfy(), partition="jobs", on_line=lines.append
    )
    assert summary.counts["failed_fatal"] == 1
    reason = store.get(job_id(0, "jobs.jsonl")).reason
    assert "Failed to convert an input value to a INT value [width, xxx" in reason
    assert len(reason) < 2000
    assert all(len(line) < 3000 for line in lines)
