"""A huge value a server quotes back in its failure makes a reason of a few hundred
characters, its length said: in the dead letter, its events, results.csv and the lines
printed."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from comfy_assets.comfy.types import excerpt
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.results import MAX_CELL_CHARS
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import write_jobs

HUGE = 50 * 1024**2  # characters: 52,428,800
BOUND = 1_000  # characters a reason, an event or a line may have here


def test_excerpt_cuts_a_long_text_saying_its_length_and_escapes_what_no_store_takes() -> None:
    assert excerpt("short\n  text") == "short text"
    cut = excerpt("a" * HUGE)
    assert cut == "a" * 300 + "… (52,428,800 characters)"
    assert excerpt("x\x00y\ud800") == "x\\x00y\\ud800"


@pytest.mark.timeout(300)
def test_a_50_mb_value_a_failure_quotes_gives_a_bounded_reason_event_cell_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = "p" * HUGE
    # A file name ComfyUI cannot write (its OSError quotes the path), and a checkpoint no
    # server has (our own reason quotes it).
    jobs = write_jobs(tmp_path / "jobs", 2, extra=[{"set": {"3.filename_prefix": huge}}, {}])
    ckpt = write_jobs(tmp_path / "jobs", 1, name="ckpt.jsonl", workflow="text_to_image.json")
    lines = [json.loads(ckpt.read_text())]
    lines[0]["set"] = {"4.ckpt_name": huge}
    (tmp_path / "jobs" / "jobs.jsonl").open("a").write(json.dumps(lines[0]) + "\n")
    loaded = load_job_file(jobs).jobs
    fake = FakeComfy(prompt_seconds=0.005, models=["v1-5-pruned-emaonly-fp16.safetensors"])
    store = tmp_path / "store"
    with fake.serve_in_thread(port=0) as url:
        code = main(
            ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", "--store", str(store)]
            + ["--attempts", "1", "--poll-s", "0.05"]
        )
    assert code == 1
    out = capsys.readouterr().out.splitlines()
    assert "summary: 1 done, 2 dead-lettered" in out
    assert max(len(line) for line in out) < BOUND
    with (store / "jobs" / "results.csv").open(newline="", encoding="utf-8") as handle:
        rows = {row["job_id"]: row for row in csv.DictReader(handle)}
    file_name, ckpt_job = loaded[0], loaded[2]
    reason = rows[file_name.id]["reason"]
    assert "File name too long" in reason and "(52,428,8" in reason, reason
    assert rows[ckpt_job.id]["reason"] == (
        f"no server has checkpoint '{'p' * 300}… (52,428,800 characters)' (gpu0 checked)"
    )
    # The job's own value is cut in its cell too, so any csv reader reads the file.
    assert rows[file_name.id]["3.filename_prefix"] == excerpt(huge, MAX_CELL_CHARS)
    assert (store / "jobs" / "results.csv").stat().st_size < 100_000
    for job in (file_name, ckpt_job):
        assert len(rows[job.id]["reason"]) < BOUND
        events = Store(store).events(job.id)
        assert max(len(e.detail or "") for e in events) < BOUND
