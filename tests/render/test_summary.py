"""A batch's summary holds its dead letters in bounded memory: the first
``DEAD_LETTERS_NAMED`` in the file's order, every one counted, by reason for the first
``REASONS_COUNTED`` reasons. The limits are made small here so that a few jobs stand for
a million."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest

from comfy_assets.jobs.parse import job_from_dict
from comfy_assets.jobs.stream import JobIds
from comfy_assets.render import summary
from comfy_assets.render.summary import BatchSummary, summarize, summarize_file
from comfy_assets.store import Store

# The reason of each job's dead letter, by line; None: the job stays pending.
REASONS = ["b", None, "a", "b", "c", "b", None, "d"]


@pytest.fixture
def dead_letters(store: Store, workflow_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Two named, two reasons counted; the jobs of ``REASONS`` in one partition, the
    store's pages of two jobs: their ids, by line."""
    monkeypatch.setattr(summary, "DEAD_LETTERS_NAMED", 2)
    monkeypatch.setattr(summary, "REASONS_COUNTED", 2)
    monkeypatch.setattr(summary, "PAGE", 2)
    jobs = [
        job_from_dict(
            # Ids out of line order: the store's pages go by id, the names by line.
            {"id": str(uuid.UUID(int=100 - i)), "workflow": "image.json", "set": {}},
            base_dir=workflow_dir,
            source="test",
            line=i + 1,
        )
        for i in range(len(REASONS))
    ]
    store.register_jobs("p", jobs)
    for job, reason in zip(jobs, REASONS, strict=True):
        if reason is not None:
            assert store.claim(job.id, "w1") == "claimed"
            store.dead_letter(job.id, "w1", reason)
    return [j.id for j in jobs]


def check(got: BatchSummary, ids: list[str]) -> None:
    assert (got.dead_lettered, got.done, got.not_done) == (6, 0, 2)
    assert got.dead_letters == [(ids[0], "b"), (ids[2], "a")]  # the first two by line
    # The first two reasons met are counted, the others counted together.
    whole = Counter(r for r in REASONS if r is not None)
    assert len(got.dead_reasons) == 2
    assert {why: whole[why] for why in got.dead_reasons} == got.dead_reasons
    assert got.dead_other_reasons == 6 - sum(got.dead_reasons.values())


def test_a_summary_names_the_first_dead_letters_and_counts_them_all_by_reason(
    store: Store, dead_letters: list[str]
) -> None:
    got = summarize(store, "p", 1.0)
    check(got, dead_letters)
    # Met in line order: "b" and "a" are counted, "c" and "d" are other reasons.
    assert got.more_dead_letters("there") == (
        "  … and 4 more dead letters (6 in all: 3 × 'b'; 1 × 'a'; 2 with other reasons): there"
    )


def test_a_summary_of_a_file_read_a_page_at_a_time_does_the_same(
    store: Store, dead_letters: list[str]
) -> None:
    ids = JobIds(b"".join(uuid.UUID(i).bytes for i in dead_letters))
    check(summarize_file(store, "p", 1.0, None, {}, ids, 10), dead_letters)


def test_a_summary_of_fewer_dead_letters_than_named_names_every_one(
    store: Store, dead_letters: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(summary, "DEAD_LETTERS_NAMED", 6)
    got = summarize(store, "p", 1.0)
    named = [(i, r) for i, r in zip(dead_letters, REASONS, strict=True) if r is not None]
    assert got.dead_letters == named
    assert got.more_dead_letters("there") is None
