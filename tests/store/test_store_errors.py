"""Every error the store raises is a StoreError, and still the builtin kind it was: a
caller catches the store's errors as one, and code catching RuntimeError, LookupError,
KeyError or ValueError catches what it did."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from comfy_assets.jobs.parse import job_from_dict
from comfy_assets.store import (
    ClaimLost,
    NoStore,
    PartitionConflict,
    Store,
    StoreDiskFull,
    StoreError,
    StoreUnavailable,
    UnknownJob,
    Via,
)
from comfy_assets.store.health import UnknownServer


def test_a_claim_not_held_an_unknown_job_and_an_id_taken_are_store_errors(
    store: Store, workflow_dir: Path
) -> None:
    job_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "test-store-errors:0"))
    job = job_from_dict(
        {"id": job_id, "workflow": "image.json"}, base_dir=workflow_dir, source="test", line=1
    )
    store.register_jobs("film-a", [job])
    store.claim(job.id, "w1", now=100.0)
    with pytest.raises(StoreError, match="w2 does not hold the claim") as lost:
        store.transition(job.id, "submitted", owner="w2", via=Via(server="gpu0", attempt=1))
    assert isinstance(lost.value, ClaimLost) and isinstance(lost.value, RuntimeError)
    with pytest.raises(LookupError, match="job nope: not in the store") as unknown:
        store.claim("nope", "w1")
    assert isinstance(unknown.value, UnknownJob) and isinstance(unknown.value, StoreError)
    with pytest.raises(StoreError, match="film-a") as taken:
        store.register_jobs("film-b", [job])
    assert isinstance(taken.value, PartitionConflict) and isinstance(taken.value, ValueError)


def test_no_store_where_one_was_expected_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no result store at"):
        Store.existing(tmp_path / "nothing")


def test_each_error_keeps_its_builtin_kind() -> None:
    kinds = {
        ClaimLost: RuntimeError,
        UnknownJob: LookupError,
        PartitionConflict: ValueError,
        NoStore: ValueError,
        StoreUnavailable: RuntimeError,
        StoreDiskFull: StoreUnavailable,
        UnknownServer: KeyError,
    }
    for error, kind in kinds.items():
        assert issubclass(error, StoreError) and issubclass(error, kind), error
