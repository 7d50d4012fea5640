"""Exactly once across processes: racing runners, and a runner killed mid-job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import ROOT, executed, posted, run_argv, write_jobs


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "comfy_assets.cli", *args]


def run_args(jobs: Path, url: str, store: Path, *extra: str) -> list[str]:
    fast = ["--base-delay-s", "0.01", "--max-delay-s", "0.05", "--poll-s", "0.05"]
    return cli(*run_argv(jobs, store, [f"gpu0={url}"], *fast, *extra))


def wait_until(condition, timeout_s: float, what: str) -> None:
    """Poll a condition (not a sleep as synchronisation: the condition is the signal)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_two_runners_fed_the_same_jobs_twice_execute_each_once(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jobs = write_jobs(tmp_path / "jobs", 8)
    store = tmp_path / "store"
    Store(store)  # create the schema once, before the race
    script = "; ".join(" ".join(run_args(jobs, "{url}", store)) for _ in range(2))
    with fake.serve_in_thread(port=0) as url:
        procs = [
            subprocess.Popen(
                ["bash", "-c", script.replace("{url}", url)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for job in load_job_file(jobs).jobs:
        assert executed(fake, job.prompt_id) == 1, job.id
        assert posted(fake, job.prompt_id) == 1, job.id
    assert sum(o.count("summary: 8 done, 0 dead-lettered") for o in outputs) == 4


def test_a_killed_runner_leaves_a_claim_the_next_run_takes_over_without_executing_again(tmp_path):
    # `silent`: the socket says nothing after `status`, and a 60 s poll keeps the first
    # runner from learning that the prompt finished: we kill it right after the fake's
    # own record says the prompt succeeded, before it could write the done record.
    fake = FakeComfy(script=["silent"], prompt_seconds=0.005)
    jobs = write_jobs(tmp_path / "jobs", 1)
    job = load_job_file(jobs).jobs[0]
    store_dir = tmp_path / "store"
    with fake.serve_in_thread(port=0) as url:
        first = subprocess.Popen(
            run_args(
                jobs, url, store_dir, "--lease-s", "1", "--server-lease-s", "1", "--poll-s", "60"
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_until(
            lambda: any(r["outcome"] == "success" for r in fake.stats["runs"]), 60, "the render"
        )
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        store = Store(store_dir)
        # Killed within moments of its POST: the rendering move may not be written yet
        # (render/rendering.py), but the claim and the prompt_id the catch-up needs are.
        record = store.get(job.id)
        assert record.state in ("submitted", "rendering")
        assert record.prompt_id == job.prompt_id
        second = subprocess.run(
            run_args(jobs, url, store_dir, "--lease-s", "1"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert second.returncode == 0, second.stdout + second.stderr
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    assert "caught up, nothing posted" in second.stdout
    record = store.get(job.id)
    assert record.state == "succeeded"
    assert len(store.files(job.id)) == 2
    details = [e.detail or "" for e in store.events(job_id=job.id)]
    assert any("claim taken over" in d for d in details), details


def test_a_bad_job_file_is_rejected_with_every_error_and_nothing_posted(tmp_path):
    fake = FakeComfy()
    folder = tmp_path / "jobs"
    good = write_jobs(folder, 2)
    lines = good.read_text().splitlines()
    bad = [
        lines[0],
        "{not json",
        json.dumps({"id": "NOT-A-UUID", "workflow": "image.json"}),
        json.dumps({"id": json.loads(lines[0])["id"], "workflow": "image.json"}),
        json.dumps(
            {"id": json.loads(lines[1])["id"], "workflow": "image.json", "set": {"9.seed": 1}}
        ),
    ]
    good.write_text("\n".join(bad) + "\n")
    with fake.serve_in_thread(port=0) as url:
        result = subprocess.run(
            run_args(good, url, tmp_path / "store"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    for line_no in (2, 3, 4, 5):
        assert f"jobs.jsonl:{line_no}:" in result.stderr, result.stderr
    assert fake.stats["prompts"] == {}


def test_a_run_found_gone_stops_at_once_and_leaves_its_prompt_to_the_taker(tmp_path):
    # Another process found this run gone (its heartbeat looked stopped) and took its
    # claims: the run must neither record, nor post, nor remove its prompt again.
    fake = FakeComfy(prompt_seconds=3.0)
    jobs = write_jobs(tmp_path / "jobs", 2)
    by_prompt = {j.prompt_id: j for j in load_job_file(jobs).jobs}
    store_dir = tmp_path / "store"
    with fake.serve_in_thread(port=0) as url:
        run = subprocess.Popen(
            run_args(jobs, url, store_dir),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: any(r["outcome"] is None for r in fake.stats["runs"]), 60, "a prompt")
        store = Store(store_dir)
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE comfy_owners SET gone_at = 1.0"))
        out, err = run.communicate(timeout=60)
        runs = fake.stats["runs"]
    assert run.returncode == 1, out + err
    assert "comfy-assets: stopping at once: this process (owner " in err
    assert "was found gone by another" in err
    assert len(runs) == 1  # nothing posted after
    assert runs[0]["outcome"] != "interrupted"  # nor removed: it is the taker's now
    assert store.get(by_prompt[runs[0]["prompt_id"]].id).state in ("submitted", "rendering")
