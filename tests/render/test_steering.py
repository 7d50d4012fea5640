"""What a running batch tells: the time left (``about 14 s to go``), why its jobs left
wait, and how far each running prompt is (``node 5/7 KSampler, step 3/5``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from comfy_assets.cli.progress_bar import ProgressBar
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render import steering
from comfy_assets.render.eta import Estimator, Running, format_left
from comfy_assets.render.progress import Progress
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.pool.test_models_pool import model_jobs
from tests.support import batch_over_fakes, fake_servers, fast_batch, fast_config, write_jobs

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.2, "about 1 s to go"),
        (14.4, "about 14 s to go"),
        (59.4, "about 59 s to go"),
        (59.6, "about 1 min to go"),
        (180, "about 3 min to go"),
        (3599, "about 1 h 0 min to go"),
        (2 * 3600 + 5 * 60 + 10, "about 2 h 5 min to go"),
    ],
)
def test_the_time_left_reads_in_seconds_minutes_or_hours(seconds: float, text: str) -> None:
    assert format_left(seconds) == text


def test_the_estimate_weighs_each_workflow_by_its_own_seconds_and_the_share_of_servers():
    now = [0.0]
    est = Estimator(clock=lambda: now[0])
    assert est.left_s({"a": 3}, [], usable=2) is None  # nothing measured yet
    # Two servers busy all along: prompts of "a" take 2 s, of "b" 10 s.
    for t in range(1, 11):
        now[0] = 2.0 * t
        est.prompt_ended("a", 2.0)
        est.prompt_ended("a", 2.0)
    est.prompt_ended("b", 10.0)
    left = est.left_s({"a": 4, "b": 2}, [Running("b", 4.0)], usable=2)
    assert left == pytest.approx((4 * 2 + 2 * 10 + 6) / 2, rel=0.01)
    # A workflow not measured counts at the mean of those that are.
    assert est.mean_s("c") == pytest.approx((20 * 2 + 10) / 21)
    # Half the servers (another batch shares them): about twice the time.
    alone = Estimator(clock=lambda: now[0])
    alone.started = now[0] = 0.0
    for t in range(1, 11):
        now[0] = 2.0 * t
        alone.prompt_ended("a", 2.0)
    assert alone.left_s({"a": 10}, [], usable=2) == pytest.approx(20.0)


def test_progress_lines_end_with_the_estimate_and_give_the_reasons():
    p = Progress(
        total=40,
        done=12,
        estimate_s=14.2,
        waiting=(("rendering", 2), ("waiting for a server", 23), ("in backoff", 3)),
        running=("job 1a2b3c4d on gpu0: node 3/7 KSampler, step 14/20",),
    )
    assert p.lines() == [
        "12/40 done, 28 left, about 14 s to go",
        "28 left: 2 rendering, 23 waiting for a server, 3 in backoff",
        "job 1a2b3c4d on gpu0: node 3/7 KSampler, step 14/20",
    ]


def test_the_bar_shows_the_estimate_and_the_running_prompt(tmp_path: Path) -> None:
    with (tmp_path / "bar").open("w") as stream:
        bar = ProgressBar(40, stream)
        bar.update(
            Progress(
                total=40,
                done=12,
                estimate_s=200,
                waiting=(("waiting for a server", 28),),
                running=("job 1a2b3c4d on gpu0: node 3/7 KSampler, step 14/20",),
            )
        )
        bar.close()
    drawn = (tmp_path / "bar").read_text()
    assert (
        "12 done, about 3 min to go; 28 left: 28 waiting for a server; job 1a2b3c4d on gpu0: node 3/7 KSampler, step 14/20"
        in drawn
    )


async def test_a_batch_reports_the_step_of_its_running_prompts_and_its_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steering, "EVERY_S", 0.02)
    fakes = [FakeComfy(models=["a.safetensors"], prompt_seconds=0.05) for _ in range(2)]
    jf = model_jobs(tmp_path / "jobs", ["a.safetensors"] * 8)
    for job in jf.jobs:
        job.workflow["3"]["inputs"]["steps"] = 5
    seen: list[Progress] = []
    summary = await batch_over_fakes(jf, Store(tmp_path / "s"), *fakes, on_progress=seen.append)
    assert summary.done == 8
    running = {line for p in seen for line in p.running}
    step = re.compile(r"job [0-9a-f]{8} on gpu[01]: node 5/7 KSampler, step [1-5]/5")
    assert any(step.fullmatch(line) for line in running), sorted(running)
    ends = [p.line() for p in seen if p.ended and p.remaining]
    assert ends and all(re.fullmatch(r"\d+/8 done, \d+ left, about \d+ s to go", e) for e in ends)
    reasons = [p.waiting_line() for p in seen if p.waiting_line()]
    assert any("waiting for a server" in r for r in reasons)
    assert seen[-1].line() == "8/8 done, 0 left"


async def test_each_progress_adds_up_to_the_jobs_left_and_names_no_ended_job(
    tmp_path: Path,
) -> None:
    # Jobs end every few tens of ms, well within the estimate's refresh (REFRESH_S): the
    # progress given at each end is still a look at the batch as it is then.
    fakes = [FakeComfy(prompt_seconds=0.02) for _ in range(2)]
    jf = load_job_file(write_jobs(tmp_path / "jobs", 24))
    ended: set[str] = set()
    seen: list[tuple[Progress, frozenset[str]]] = []

    def on_line(text: str) -> None:
        if " succeeded " in text:
            ended.add(text.split()[1][:8])

    summary = await batch_over_fakes(
        jf,
        Store(tmp_path / "s"),
        *fakes,
        on_line=on_line,
        on_progress=lambda p: seen.append((p, frozenset(ended))),
    )
    assert summary.done == 24
    looked = [(p, done) for p, done in seen if p.remaining and p.waiting]
    assert len(looked) >= 20
    for p, done in looked:
        parts = dict(p.waiting)
        assert sum(parts.values()) == p.remaining, p.waiting_line()
        # One prompt per server: a job downloading its outputs is not rendering.
        assert parts.get("rendering", 0) == len(p.running) <= 2, p.lines()
        named = {line.split()[1] for line in p.running}
        assert not named & done, (p.running, sorted(done))


async def test_a_run_again_of_a_done_partition_says_it_checks_its_jobs(tmp_path: Path) -> None:
    fake = FakeComfy(prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 12))
    store = Store(tmp_path / "s")
    async with fake_servers(fake) as servers:
        first = await fast_batch(jf, servers, store)
        seen: list[Progress] = []
        again = await fast_batch(jf, servers, store, on_progress=seen.append)
    assert first.done == again.done == 12
    lines = [p.waiting_line() for p in seen if p.waiting_line()]
    assert lines and all(
        re.fullmatch(r"(\d+) left: \1 done before, being checked", line) for line in lines
    ), lines


async def test_jobs_left_after_the_delivery_policy_stopped_are_said_not_submitted(
    tmp_path: Path,
) -> None:
    # Shot 1 fails for good under delivery: the batch stops submitting the other shots.
    fake = FakeComfy(script=["error"], prompt_seconds=0.005)
    shots = [{"shot": i + 1} for i in range(4)]
    jf = load_job_file(write_jobs(tmp_path / "jobs", 4, extra=shots))
    seen: list[Progress] = []
    summary = await batch_over_fakes(
        jf,
        Store(tmp_path / "s"),
        fake,
        config=fast_config(attempts=1, policy="delivery"),
        on_progress=seen.append,
    )
    assert summary.stopped and summary.stopped.startswith("stopped after the fatal failure")
    after = [p.waiting_line() for p in seen if p.waiting_line() and p.dead_lettered]
    assert after, [p.lines() for p in seen]
    for line in after:
        assert "waiting for a server" not in line
        assert re.fullmatch(r"(\d+) left: \1 not submitted: the batch stopped submitting", line)
