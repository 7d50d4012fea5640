"""A run killed or a post left unanswered, caught up by the next run: what it takes, what it
posts again and when it says a prompt may render twice, seen from the fake server's records."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import ConnectionLost, UnexpectedAnswer
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store, Via
from fake_comfy import FakeComfy
from tests.render.test_runner import render
from tests.support import (
    batch_over_fakes,
    executed,
    fake_servers,
    fast_batch,
    fast_config,
    gone_owner,
    left_submitted_by_a_gone_run,
    one_job,
    outcomes,
    posted,
    write_jobs,
)


async def post_as_a_killed_run(store: Store, job, url: str, server: str) -> None:
    """What a run killed right after its POST leaves: the job submitted on ``server``
    under a dead owner's claim, and its prompt queued there."""
    owner = gone_owner(store)
    assert store.claim(job.id, owner, lease_s=3600.0) == "claimed"
    store.transition(
        job.id, "submitted", owner=owner, via=Via(server=server, attempt=1), prompt_id=job.prompt_id
    )
    async with httpx.AsyncClient(base_url=url) as http:
        body = {"prompt": job.workflow, "prompt_id": job.prompt_id, "client_id": "killed"}
        answer = (await http.post("/prompt", json=body)).json()
    store.transition(
        job.id, "rendering", owner=owner, via=Via(server=server, attempt=1), number=answer["number"]
    )


async def test_a_run_that_validation_cut_short_is_a_dead_letter_when_caught_up(tmp_path):
    # The killed run's POST was answered 200 with node_errors (the word `partial`: node 3
    # dropped); nobody saw the answer. The catch-up finds the run in /history: it
    # rendered one of the two outputs, which is the same permanent failure.
    fake = FakeComfy(script=["partial"], prompt_seconds=0.005)
    jf, job, store = one_job(tmp_path)
    store.register_jobs("p", jf.jobs)
    async with fake_servers(fake) as servers:
        await post_as_a_killed_run(store, job, servers[0].url, "gpu0")
        await fake.wait_idle(5.0)
        summary = await fast_batch(jf, servers, store)
    assert summary.dead_letters == [
        (
            job.id,
            "failed on gpu0, the only server that can run it: outputs dropped: node 3 not "
            "among the outputs the server runs (run 0 on gpu0)",
        )
    ]
    assert posted(fake, job.prompt_id) == 1
    assert store.files(job.id) == []


async def test_a_claim_taken_over_mid_attempt_counts_the_lost_attempt(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, store = one_job(tmp_path)
    store.register_jobs("p", jf.jobs)
    async with fake_servers(fake) as servers:
        await post_as_a_killed_run(store, job, servers[0].url, "gpu0")
        summary = await fast_batch(jf, servers, store)
    assert summary.done == 1
    assert posted(fake, job.prompt_id) == 1  # caught up, not posted again
    tries = store.attempts(job.id)
    assert [(t.attempt, t.outcome) for t in tries] == [(1, "transient"), (2, "success")]
    assert tries[0].reason == "its holder was lost mid-attempt"
    assert store.get(job.id).attempts == 2


async def test_a_prompt_the_server_forgot_is_posted_again_saying_it_may_render_twice(tmp_path):
    fake, jf, store, summary = await render(tmp_path, ["restart"])
    (job,) = jf.jobs
    assert summary.done == 1
    submitted = [e for e in store.events(job.id) if e.to_state == "submitted"]
    assert [e.detail for e in submitted] == [
        None,
        "catch-up on gpu0: run 0 in neither /history nor /queue (removed before it ran, or "
        "forgotten by a restart): posting anew, the job may render twice",
    ]


def lose_post_and_queue_answers(
    monkeypatch: pytest.MonkeyPatch,
    meanwhile: Callable[[], Awaitable[object]] | None = None,
) -> list[str]:
    """Lose the answer of the first POST /prompt (the server gets it) and of the /queue
    that looks for it (after awaiting ``meanwhile``); returns the list of what was lost."""
    post_prompt, queue = ComfyClient.post_prompt, ComfyClient.queue
    lost: list[str] = []

    async def answer_lost(self: ComfyClient, *args, **kwargs):
        answer = await post_prompt(self, *args, **kwargs)
        if not lost:
            lost.append("POST /prompt")
            raise ConnectionLost(f"{self.name}: POST /prompt: connection lost")
        return answer

    async def queue_lost_once(self: ComfyClient):
        if lost == ["POST /prompt"]:
            lost.append("GET /queue")
            if meanwhile is not None:
                await meanwhile()
            raise ConnectionLost(f"{self.name}: GET /queue: connection lost")
        return await queue(self)

    monkeypatch.setattr(ComfyClient, "post_prompt", answer_lost)
    monkeypatch.setattr(ComfyClient, "queue", queue_lost_once)
    return lost


async def test_a_run_removed_after_an_unanswered_post_does_not_end_the_next_run(
    tmp_path, monkeypatch
):
    # The POST's answer is lost and so is the /queue that looks for it: our prompt is
    # interrupted and removed, its socket events (execution_start, execution_interrupted)
    # left unread. The next attempt posts again; those events are not about its run.
    fake = FakeComfy(script=["slow", "ok"], prompt_seconds=0.01)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    job = jf.jobs[0]
    lost = lose_post_and_queue_answers(monkeypatch)
    store = Store(tmp_path / "store")
    summary = await batch_over_fakes(jf, store, fake)
    assert lost == ["POST /prompt", "GET /queue"]
    assert summary.done == 1
    assert outcomes(fake, job.prompt_id) == ["interrupted", "success"]
    details = [e.detail or "" for e in store.events(job.id)]
    assert not any("interrupted by someone else" in d for d in details), details
    assert store.get(job.id).attempts == 2  # the second attempt's own run succeeded


async def test_a_run_found_by_a_catch_up_then_forgotten_by_a_restart_says_it_may_render_twice(
    tmp_path, monkeypatch
):
    # The store knows the prompt was posted to gpu0 but not its run number (the POST's
    # answer was lost). The catch-up finds its success in /history; the server restarts
    # during the download. The next catch-up finds nothing: posting anew renders the job
    # a second time, and its event says so.
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, store = left_submitted_by_a_gone_run(tmp_path)
    iter_view = ComfyClient.iter_view
    restarted: list[str] = []

    async def restart_mid_download(self: ComfyClient, *args, **kwargs):
        if not restarted:
            restarted.append(self.name)
            fake.session.history.clear()  # forgotten, as by a restart
            raise ConnectionLost(f"{self.name}: GET /view: connection lost")
        async for chunk in iter_view(self, *args, **kwargs):
            yield chunk

    async with fake_servers(fake) as servers:
        async with ComfyClient(servers[0].url, name="gpu0") as client:
            await client.post_prompt(job.workflow, prompt_id=job.prompt_id, client_id="gone")
        await fake.wait_idle(10.0)
        monkeypatch.setattr(ComfyClient, "iter_view", restart_mid_download)
        summary = await fast_batch(jf, servers, store)
    assert restarted == ["gpu0"]
    assert summary.done == 1
    assert executed(fake, job.prompt_id) == 2
    details = [e.detail or "" for e in store.events(job.id)]
    assert any(
        "in neither /history nor /queue" in d and "may render twice" in d for d in details
    ), details


async def test_a_prompt_that_ran_while_its_unanswered_post_was_looked_for_is_taken(
    tmp_path, monkeypatch
):
    # The POST's answer is lost, and so is the /queue that looks for it; by the time the
    # prompt is removed it has run to its end: its outputs are taken, nothing is posted
    # again (a restart before a later catch-up would have rendered it twice, unsaid).
    fake = FakeComfy(prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    job = jf.jobs[0]
    # the prompt ends before the lost /queue answer is given up on
    lost = lose_post_and_queue_answers(monkeypatch, meanwhile=lambda: fake.wait_for_runs(1, 10.0))
    store = Store(tmp_path / "store")
    summary = await batch_over_fakes(jf, store, fake)
    assert lost == ["POST /prompt", "GET /queue"]
    assert summary.done == 1
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    assert store.get(job.id).attempts == 1
    assert len(store.files(job.id)) == 2


async def test_a_post_of_a_killed_run_forgotten_by_a_restart_says_it_may_render_twice(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, store = left_submitted_by_a_gone_run(tmp_path)
    async with fake_servers(fake) as servers:
        async with ComfyClient(servers[0].url, name="gpu0") as client:
            await client.post_prompt(job.workflow, prompt_id=job.prompt_id, client_id="gone")
        await fake.wait_idle(10.0)
        fake.session.history.clear()  # forgotten, as by a restart
        summary = await fast_batch(jf, servers, store)
    assert summary.done == 1
    assert executed(fake, job.prompt_id) == 2
    details = [e.detail or "" for e in store.events(job.id)]
    assert any("may render twice" in d for d in details), details


async def test_a_job_whose_catch_up_gave_up_is_posted_again_elsewhere(tmp_path, monkeypatch):
    # gpu0's /history is never readable (a proxy truncating its answers): the job's run
    # there ends unread, and the next attempt's catch-up on gpu0 gives up. Posting anew
    # on gpu0, the server that could not be asked, would render the job there again.
    history = ComfyClient.history

    async def unreadable_on_gpu0(self: ComfyClient, prompt_id: str):
        if self.name == "gpu0":
            raise UnexpectedAnswer(f"{self.name}: GET /history/{prompt_id}: body is not JSON")
        return await history(self, prompt_id)

    monkeypatch.setattr(ComfyClient, "history", unreadable_on_gpu0)
    sick, healthy = FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)
    jf, job, store = one_job(tmp_path)
    async with fake_servers(sick, healthy) as servers:
        summary = await fast_batch(jf, servers, store, config=fast_config(catch_up_s=0.2))
    assert summary.done == 1
    assert (posted(sick, job.prompt_id), posted(healthy, job.prompt_id)) == (1, 1)
    submitted = [e for e in store.events(job.id) if e.to_state == "submitted"]
    assert [e.server for e in submitted] == ["gpu0", "gpu1"]
