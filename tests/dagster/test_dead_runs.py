"""dead_runs_sensor: a STARTED run whose batch's owner stopped beating in the store is
failed (and so retried); a run whose owner beats is never touched."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import (
    DagsterEvent,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    SkipReason,
    build_sensor_context,
)
from dagster._core.test_utils import create_run_for_test, instance_for_test

from comfy_assets.farm.dead_runs import NO_LIVE_OWNER_S, dead_run_reason
from comfy_assets.resources import ResultStoreResource
from comfy_assets.sensors import dead_runs_sensor
from comfy_assets.store import OWNER_DEAD_S, OwnerRecord, Store
from tests.support import gone_owner

# The production profile's run retries.
RUN_RETRIES = {"enabled": True, "max_retries": 2, "retry_on_asset_or_op_failure": False}


def owner(
    name: str = "host-a:7:0123abcd",
    *,
    started_at: float = 1000.0,
    beat_age_s: float = 1.0,
    gone: bool = False,
    gone_at: float | None = None,
    released_at: float | None = None,
) -> OwnerRecord:
    return OwnerRecord(
        owner=name,
        host=name.split(":")[0],
        pid=int(name.split(":")[1]),
        run_id="run-1",
        started_at=started_at,
        beat_at=started_at + 5.0,
        gone_at=gone_at,
        released_at=released_at,
        beat_age_s=beat_age_s,
        gone=gone,
    )


def test_a_run_whose_owner_beats_is_alive_however_long_it_runs() -> None:
    assert dead_run_reason([owner()], started_s_ago=30 * 86400.0, renders=True) is None


def test_a_run_whose_owner_went_silent_is_dead_and_the_reason_names_the_owner() -> None:
    reason = dead_run_reason([owner(beat_age_s=42.0, gone=True)], started_s_ago=60.0, renders=True)

    assert reason is not None
    assert "host-a:7:0123abcd (host host-a, pid 7)" in reason
    assert "no heartbeat in the result store for 42 s" in reason
    assert "database's clock" in reason


def test_an_owner_found_gone_by_another_process_makes_its_run_dead() -> None:
    reason = dead_run_reason(
        [owner(beat_age_s=3.0, gone=True, gone_at=1004.0)], started_s_ago=60.0, renders=True
    )

    assert reason is not None and "found gone by another process" in reason


def test_any_live_owner_keeps_the_run_alive() -> None:
    dead = owner("host-a:7:0123abcd", beat_age_s=99.0, gone=True)
    live = owner("host-b:8:4567cdef", started_at=900.0)

    assert dead_run_reason([dead, live], started_s_ago=60.0, renders=True) is None


def test_a_released_newest_owner_means_the_batch_ended_and_the_run_goes_on() -> None:
    earlier_dead = owner("host-a:7:0123abcd", beat_age_s=300.0, gone=True)
    released = owner(
        "host-a:9:89abcdef", started_at=2000.0, beat_age_s=20.0, gone=True, released_at=2010.0
    )

    assert dead_run_reason([earlier_dead, released], started_s_ago=400.0, renders=True) is None


def test_a_run_whose_batch_ended_long_ago_without_the_run_ending_is_dead() -> None:
    released = owner(beat_age_s=NO_LIVE_OWNER_S + 5, gone=True, released_at=1005.0)

    reason = dead_run_reason([released], started_s_ago=NO_LIVE_OWNER_S * 2, renders=True)
    assert reason is not None and "batch ended" in reason
    # Not a rendering run: nothing says how long its other steps take.
    assert dead_run_reason([released], started_s_ago=NO_LIVE_OWNER_S * 2, renders=False) is None


def test_a_run_with_no_owner_yet_is_left_alone_until_it_never_registered_for_long() -> None:
    assert dead_run_reason([], started_s_ago=30.0, renders=True) is None
    assert dead_run_reason([], started_s_ago=None, renders=True) is None
    assert dead_run_reason([], started_s_ago=NO_LIVE_OWNER_S * 10, renders=False) is None

    reason = dead_run_reason([], started_s_ago=NO_LIVE_OWNER_S + 1, renders=True)
    assert reason is not None and "no batch of it has registered" in reason


# On a real instance (SQLite storage in a temporary DAGSTER_HOME, the profile's retries).


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test(overrides={"run_retries": RUN_RETRIES}) as inst:
        yield inst


def started_run(instance: DagsterInstance, partition: str) -> str:
    """A render_job run of ``partition`` that Dagster has marked STARTED; its id."""
    run = create_run_for_test(
        instance,
        job_name="render_job",
        status=DagsterRunStatus.STARTING,
        tags={"dagster/partition": partition, "dagster/max_retries": "2"},
    )
    instance.report_dagster_event(
        DagsterEvent(event_type_value=DagsterEventType.RUN_START.value, job_name="render_job"),
        run_id=run.run_id,
    )
    return run.run_id


def tick(instance: DagsterInstance, store_dir: Path) -> str:
    """One evaluation of the sensor; its skip reason."""
    resources = {"result_store": ResultStoreResource(folder=str(store_dir))}
    with build_sensor_context(instance=instance, resources=resources) as context:
        result = dead_runs_sensor(context)
    assert isinstance(result, SkipReason)
    return result.skip_message or ""


def status(instance: DagsterInstance, run_id: str) -> DagsterRunStatus:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return run.status


def failure_messages(instance: DagsterInstance, run_id: str) -> list[str]:
    return [
        entry.dagster_event.message or ""
        for entry in instance.all_logs(run_id, of_type=DagsterEventType.RUN_FAILURE)
        if entry.dagster_event is not None
    ]


def test_a_run_whose_host_died_is_failed_with_why_and_will_be_retried(
    instance: DagsterInstance, store: Store
) -> None:
    dead = started_run(instance, "films_a")
    silent = gone_owner(store, "host-a:2:deadbeef", silent_s=40.0, run_id=dead)
    alive = started_run(instance, "films_b")
    store.register_owner("host-b:3:cafe0123", run_id=alive, host="host-b", pid=3)
    starting = started_run(instance, "films_c")  # no batch registered yet

    skip = tick(instance, store.root)

    assert status(instance, dead) == DagsterRunStatus.FAILURE
    [message] = failure_messages(instance, dead)
    assert "owner host-a:2:deadbeef (host host-a, pid 2)" in message
    # 40 s of silence when the owner row was written, and the seconds the test took since.
    assert re.search(r"no heartbeat in the result store for 4\d s", message), message
    assert dead in skip and "failed 1 dead run" in skip
    # The run retries daemon re-launches it: the failure is not an asset's.
    run = instance.get_run_by_id(dead)
    assert run is not None and run.tags.get("dagster/will_retry") == "true"
    # Its owner is marked found gone: should its process beat again, it stops at once.
    assert store.owner_gone(silent) == "found gone by another process"
    assert store.beat_owner(silent) is False
    # Nothing else is touched: a run whose owner beats, a run still reaching its batch.
    assert status(instance, alive) == DagsterRunStatus.STARTED
    assert status(instance, starting) == DagsterRunStatus.STARTED
    assert store.owner_gone("host-b:3:cafe0123") is None
    assert failure_messages(instance, alive) == failure_messages(instance, starting) == []


def test_a_run_failed_once_is_not_failed_again_and_a_live_run_never_is(
    instance: DagsterInstance, store: Store
) -> None:
    dead = started_run(instance, "films_a")
    gone_owner(store, "host-a:2:deadbeef", silent_s=OWNER_DEAD_S + 5, run_id=dead)
    alive = started_run(instance, "films_b")
    store.register_owner("host-b:3:cafe0123", run_id=alive, host="host-b", pid=3)

    tick(instance, store.root)
    skip = tick(instance, store.root)

    assert len(failure_messages(instance, dead)) == 1
    assert skip == "1 run(s) in progress, none dead"
    assert status(instance, alive) == DagsterRunStatus.STARTED


def test_with_no_run_in_progress_the_store_is_not_even_opened(
    instance: DagsterInstance, tmp_path: Path
) -> None:
    store_dir = tmp_path / "nowhere"

    assert tick(instance, store_dir) == "no run in progress"
    assert not store_dir.exists()
