"""A sick server in every shape a farm shows (5xx on every POST, 400 or node_errors that
the others do not answer, out of memory, wedged inside a node) is the server's: its jobs
render elsewhere, it is quarantined, and none of its failures makes a dead letter; a farm
whose every server is sick leaves its jobs pending."""

from __future__ import annotations

from pathlib import Path

import pytest

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render import blame
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import batch_over_fakes, fast_config, write_jobs


def posts(fake: FakeComfy) -> int:
    """POST /prompt requests the fake received, answered or not."""
    return int(fake.stats["requests"].get("POST /prompt", 0))


async def render(store: Store, fakes: list[FakeComfy], jobs: Path, lines: list[str], **config):
    return await batch_over_fakes(
        load_job_file(jobs),
        store,
        *fakes,
        partition=jobs.stem,
        config=fast_config(**config),
        on_line=lines.append,
    )


def one_sick_of_three(
    tmp_path: Path, word: str, db: str, request: pytest.FixtureRequest
) -> tuple[FakeComfy, list[FakeComfy], Store, str | None]:
    """A fake whose every prompt meets the script word ``word`` (1 ms a node), two healthy
    fakes (20 ms a node), and a store at ``tmp_path/store`` on ``db`` ("pg": the test's
    PostgreSQL database, else SQLite); returns the sick fake, the healthy ones, the store and
    its database URL (None for SQLite)."""
    sick = FakeComfy(default_word=word, prompt_seconds=0.001)
    healthy = [FakeComfy(prompt_seconds=0.02) for _ in range(2)]
    url = request.getfixturevalue("own_pg_url") if db == "pg" else None
    return sick, healthy, Store(tmp_path / "store", url), url


@pytest.mark.parametrize(
    ("word", "db"),
    [
        ("500", "sqlite"),
        ("invalid", "sqlite"),
        ("partial", "sqlite"),
        ("oom", "sqlite"),
        ("500", "pg"),
    ],
)
async def test_one_sick_server_of_three_in_any_shape_costs_no_job(tmp_path, word, db, request):
    sick, healthy, store, url = one_sick_of_three(tmp_path, word, db, request)
    lines: list[str] = []
    jobs = write_jobs(tmp_path / "jobs", 30, name="big.jsonl")
    summary = await render(store, [*healthy, sick], jobs, lines)
    assert summary.counts.get("failed_fatal", 0) == 0
    assert summary.counts["succeeded"] == 30
    assert posts(sick) <= 5
    assert store.server_health()["gpu2"].state == "quarantined"
    kinds = [kind for _, server, kind, _ in store.server_events() if server == "gpu2"]
    assert kinds[:1] == ["quarantined"]


async def test_a_wedged_server_is_quarantined_and_its_job_renders_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setattr(blame, "STALL_MIN_S", 0.5)
    wedged = FakeComfy(default_word="wedge", prompt_seconds=0.001)
    healthy = [FakeComfy(prompt_seconds=0.02) for _ in range(2)]
    store = Store(tmp_path / "store")
    lines: list[str] = []
    jobs = write_jobs(tmp_path / "jobs", 12, name="wedge.jsonl")
    summary = await render(store, [*healthy, wedged], jobs, lines, wedge_s=0.5)
    assert summary.counts["succeeded"] == 12
    assert posts(wedged) == 1  # never posted there again while its prompt is stuck
    health = store.server_health()["gpu2"]
    assert health.state == "quarantined"
    assert "is wedged" in (health.reason or "")
    # Stuck until someone restarts it: the longest cool-down, not a trial a minute later.
    assert (health.until or 0) - store.now() > 3000
    (stuck,) = [j for j, _, _ in health.failed_jobs]
    notes = [e.detail or "" for e in store.events(stuck)]
    assert any("may have rendered there too" in n for n in notes)
    assert store.get(stuck).state == "succeeded" and store.get(stuck).server != "gpu2"


@pytest.mark.parametrize("word", ["500", "oom", "wedge"])
async def test_a_farm_whose_every_server_is_sick_leaves_its_jobs_pending(
    tmp_path, word, monkeypatch
):
    # A wedged prompt says nothing, and no job renders to measure: the stall before any
    # run of its kind (STALL_FIRST_RUNS x STALL_MIN_S) ends it, not its deadline (30 s).
    monkeypatch.setattr(blame, "STALL_MIN_S", 0.05)
    fakes = [FakeComfy(default_word=word, prompt_seconds=0.001) for _ in range(3)]
    store = Store(tmp_path / "store")
    lines: list[str] = []
    jobs = write_jobs(tmp_path / "jobs", 9, name="sick.jsonl")
    summary = await render(store, fakes, jobs, lines, wedge_s=0.3, unreachable_timeout_s=0.5)
    assert summary.counts.get("failed_fatal", 0) == 0
    assert summary.counts.get("succeeded", 0) == 0
    assert "no server usable" in (summary.stopped or "")
    health = store.server_health()
    assert {health[f"gpu{i}"].state for i in range(3)} == {"quarantined"}
