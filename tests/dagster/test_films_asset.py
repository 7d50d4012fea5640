"""The ``films`` asset over a storyboard rendered on an in-thread fake ComfyUI server.

The storyboard is ``data/jobs/storyboard.jsonl``: six video shots of 1.0 + 1.5 + 2.0 + 1.0 +
1.25 + 1.0 = 7.75 s, shot 4 at 12 fps (so the film is re-encoded). A single fake server
runs prompts in the order they are posted, which is line order, so script word N hits
shot N.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
import pytest
from dagster import (
    AssetCheckKey,
    AssetCheckSeverity,
    AssetKey,
    DagsterInstance,
    ExecuteInProcessResult,
    evaluate_automation_conditions,
    materialize,
)

from comfy_assets.assets import films, render_results, renders
from comfy_assets.definitions import defs
from comfy_assets.film.probe import probe
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.resources import ComfyPoolResource, ResultStoreResource
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.dagster.test_assets import checks, counts, serving, write_job_file

REPO = Path(__file__).resolve().parents[2]
PARTITION = "storyboard"
SHOT_SECONDS = [1.0, 1.5, 2.0, 1.0, 1.25, 1.0]
FRAME_S = 1 / 24


@pytest.fixture
def storyboard(watch: Callable[[str], Path]) -> Path:
    """The sample storyboard in a watched folder of its own; returns its path."""
    folder = watch("video_shot.json")
    shutil.copy(REPO / "data/jobs/storyboard.jsonl", folder)
    return folder / "storyboard.jsonl"


def materialize_partition(
    instance: DagsterInstance,
    comfy: ComfyPoolResource,
    store_dir: Path,
    *,
    partition: str = PARTITION,
    only_films: bool = False,
    media_url: str | None = None,
) -> ExecuteInProcessResult:
    """Run render_job's assets for one partition, as the sensor would, then films, as
    films_automation_sensor would (or films alone); returns the films run's result."""
    store = ResultStoreResource(folder=str(store_dir), media_url=media_url)
    resources = {"comfy": comfy, "result_store": store}
    if not only_films:
        if partition not in instance.get_dynamic_partitions("job_files"):
            instance.add_dynamic_partitions("job_files", [partition])
        materialize(
            [renders, render_results],
            partition_key=partition,
            instance=instance,
            resources=resources,
        )
    if partition not in instance.get_dynamic_partitions("storyboards"):
        instance.add_dynamic_partitions("storyboards", [partition])
    return materialize(
        [films],
        partition_key=partition,
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )


def film_event(result: ExecuteInProcessResult):
    events = [
        e for e in result.get_asset_materialization_events() if e.asset_key == AssetKey("films")
    ]
    return events[0].materialization if events else None


def gate_evaluation(result: ExecuteInProcessResult):
    (evaluation,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "gate"]
    return evaluation


def shot_files(store_dir: Path, job_ids: list[str]) -> dict[str, list[Path]]:
    """The output files of each job as the store records them (absolute paths)."""
    with Store(store_dir) as store:
        return {
            job_id: [store.job_dir(PARTITION, job_id) / f.path for f in store.files(job_id)]
            for job_id in job_ids
        }


def with_policy(comfy: ComfyPoolResource, policy: str) -> ComfyPoolResource:
    return ComfyPoolResource(**{**comfy.model_dump(), "policy": policy})


def test_a_clean_storyboard_becomes_a_film_as_long_as_its_shots(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    job_file = load_job_file(storyboard)
    fake = FakeComfy(prompt_seconds=0.005)

    with serving(fake) as comfy:
        result = materialize_partition(instance, comfy, tmp_path / "store")

    assert result.success
    assert checks(result)["gate"] is True
    film = tmp_path / "store" / PARTITION / "film.mp4"
    probed = probe(film)
    assert probed.duration_s == pytest.approx(sum(SHOT_SECONDS), abs=FRAME_S)
    metadata = film_event(result).metadata
    assert metadata["path"].value == str(film.resolve())
    assert metadata["duration_s"].value == pytest.approx(probed.duration_s, abs=1e-3)
    assert metadata["shot_count"].value == 6
    assert metadata["degraded_shots"].value == []
    assert (metadata["policy"].value, metadata["draft"].value) == ("delivery", False)
    assert metadata["concat_mode"].value == "reencode"  # shot 4 is 12 fps
    sheet = metadata["contact_sheet"].value
    assert sheet.startswith("![film contact sheet](data:image/png;base64,")
    assert len(sheet) < 20_000  # small enough for the event log
    assert Path(metadata["contact_sheet_path"].value).is_file()
    # The cost report: six attempts, all successful, nothing wasted.
    assert metadata["attempts"].value == 6
    assert metadata["failed_attempts"].value == 0
    assert metadata["gpu_seconds_wasted"].value == 0.0
    assert metadata["gpu_seconds"].value == metadata["gpu_seconds_success"].value
    for key in (
        "expected_s_skip_failures",
        "expected_s_rerun_whole_batch",
        "expected_s_tiered_retry",
    ):
        assert metadata[key].value == metadata["expected_s_skip_failures"].value
    prompt_ids = {job.prompt_id for job in job_file.jobs}
    assert counts([fake], "executed") == dict.fromkeys(prompt_ids, 1)
    assert not list((tmp_path / "store" / PARTITION).glob(".film-work-*"))


def test_with_a_media_url_the_film_is_a_link_that_plays_it(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    with serving(FakeComfy(prompt_seconds=0.005)) as comfy:
        result = materialize_partition(
            instance, comfy, tmp_path / "store", media_url="http://media.test/store"
        )

    metadata = film_event(result).metadata
    film = tmp_path / "store" / PARTITION / "film.mp4"
    digest = hashlib.sha256(film.read_bytes()).hexdigest()[:12]
    assert list(metadata)[:2] == ["film", "contact_sheet"]  # at the top of the page
    assert metadata["film"].value == f"http://media.test/store/{PARTITION}/film.mp4?v={digest}"
    sheet = metadata["contact_sheet"].value
    assert sheet.startswith("[![film contact sheet](http://media.test/store/storyboard/")
    assert len(sheet) < 1000  # inline in the UI, no click


def test_a_failed_shot_blocks_the_film_under_delivery_and_keeps_the_other_shots(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    job_file = load_job_file(storyboard)
    fake = FakeComfy(script=["ok", "ok", "error"], prompt_seconds=0.005)

    with serving(fake) as comfy:
        result = materialize_partition(instance, comfy, tmp_path / "store")

    assert not result.success
    assert film_event(result) is None  # no materialization of a film that does not exist
    evaluation = gate_evaluation(result)
    assert (evaluation.passed, evaluation.severity) == (False, AssetCheckSeverity.ERROR)
    assert evaluation.blocking
    # Recorded on the partition (the UI shows it there), and named in the metadata too.
    assert evaluation.partition == PARTITION
    assert evaluation.metadata["partition"].value == PARTITION
    blocked = evaluation.metadata["blocked"].value
    assert blocked[0] == 3  # shots 1 and 2 rendered; 4-6 were never submitted (delivery)
    listing = evaluation.metadata["bad_shots"].value.splitlines()
    assert listing[0].startswith(f"- shot 3 (job {job_file.jobs[2].id}): blocked: failed_fatal:")
    assert "IndexError" in listing[0]
    assert all("not finished" in line for line in listing[1:])
    assert "shot 3" in evaluation.description
    (failure,) = result.get_step_failure_events()
    assert failure.step_key == "films"
    assert "gate blocked (delivery)" in failure.step_failure_data.user_failure_data.description

    partition_dir = tmp_path / "store" / PARTITION
    assert not (partition_dir / "film.mp4").exists()
    assert not (partition_dir / "film.contact.png").exists()
    assert not list(partition_dir.glob(".film-work-*"))
    kept = shot_files(tmp_path / "store", [job.id for job in job_file.jobs[:2]])
    for job, seconds in zip(job_file.jobs[:2], SHOT_SECONDS, strict=False):
        (path,) = kept[job.id]
        assert probe(path).duration_s == pytest.approx(seconds, abs=FRAME_S)
    assert (partition_dir / "results.csv").is_file()  # render_results is not downstream


def rgb(colour: int) -> np.ndarray:
    """EmptyImage's ``color`` (0xRRGGBB) as an RGB triple."""
    return np.array([(colour >> 16) & 255, (colour >> 8) & 255, colour & 255], dtype=float)


def mean_rgb(path: Path, t: float) -> np.ndarray:
    """Mean colour of the last frame shown at ``t`` seconds."""
    with av.open(str(path)) as container:
        chosen = None
        for frame in container.decode(video=0):
            if frame.time > t + 1e-6:
                break
            chosen = frame
    assert chosen is not None
    return chosen.to_ndarray(format="rgb24").reshape(-1, 3).mean(axis=0)


def test_under_draft_from_the_run_config_a_failed_shot_becomes_a_slate_of_its_length(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    fake = FakeComfy(script=["ok", "ok", "error"], prompt_seconds=0.005)

    with serving(fake) as comfy:
        # The header says delivery; the run config's policy wins.
        result = materialize_partition(instance, with_policy(comfy, "draft"), tmp_path / "store")

    assert result.success
    assert checks(result)["gate"] is True
    metadata = film_event(result).metadata
    assert (metadata["policy"].value, metadata["draft"].value) == ("draft", True)
    assert metadata["degraded_shots"].value == [3]
    assert metadata["placeholder_shots"].value == [3]
    film = tmp_path / "store" / PARTITION / "film.mp4"
    assert probe(film).duration_s == pytest.approx(sum(SHOT_SECONDS), abs=FRAME_S)
    with av.open(str(film)) as container:
        assert container.metadata["comment"].startswith("DRAFT: shots 3 (slate)")
    # Shot 3 (2.0 s from 2.5 s) is a dark slate for its whole length, not its green; the
    # shots around it keep their own colours.
    for t in (2.55, 3.5, 4.45):
        assert mean_rgb(film, t).max() < 90
    assert np.abs(mean_rgb(film, 2.45) - rgb(0xC0392B)).max() < 20  # shot 2
    assert np.abs(mean_rgb(film, 4.55) - rgb(0xF1C40F)).max() < 20  # shot 4


def test_a_truncated_or_wrong_length_shot_is_caught_by_the_gate(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    job_file = load_job_file(storyboard)
    fake = FakeComfy(prompt_seconds=0.005)
    store_dir = tmp_path / "store"

    with serving(fake) as comfy:
        assert materialize_partition(instance, comfy, store_dir).success
        film = store_dir / PARTITION / "film.mp4"
        before = film.read_bytes()
        files = shot_files(store_dir, [job.id for job in job_file.jobs])
        (shot2,) = files[job_file.jobs[1].id]
        shot2.write_bytes(shot2.read_bytes()[: shot2.stat().st_size // 2])
        (shot1,) = files[job_file.jobs[0].id]
        (shot5,) = files[job_file.jobs[4].id]
        shutil.copy(shot1, shot5)  # 1.0 s where 1.25 s is expected (tolerance 10 %)
        result = materialize_partition(instance, comfy, store_dir, only_films=True)

    assert not result.success
    evaluation = gate_evaluation(result)
    assert not evaluation.passed
    assert evaluation.metadata["blocked"].value == [2, 5]
    shot2_line, shot5_line = evaluation.metadata["bad_shots"].value.splitlines()
    assert shot2_line.startswith("- shot 2 ") and "truncated" in shot2_line
    assert shot5_line.startswith("- shot 5 ") and "duration 1.000 s, expected 1.250 s" in shot5_line
    assert film.read_bytes() == before  # the earlier film is left as it was
    assert all(n == 1 for n in counts([fake], "executed").values())  # nothing re-rendered


def test_rerunning_after_a_requeue_renders_only_the_failed_shot_and_the_film_passes(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    job_file = load_job_file(storyboard)
    fake = FakeComfy(script=["ok"] * 5 + ["error"], prompt_seconds=0.005)
    store_dir = tmp_path / "store"

    with serving(fake) as comfy:
        first = materialize_partition(instance, comfy, store_dir)
        assert gate_evaluation(first).metadata["blocked"].value == [6]
        with Store(store_dir) as store:
            assert store.requeue(job_file.jobs[5].id)
        second = materialize_partition(instance, comfy, store_dir)

    assert second.success
    assert checks(second)["gate"] is True
    executed = counts([fake], "executed")
    failed = job_file.jobs[5].prompt_id
    assert executed == {job.prompt_id: 1 for job in job_file.jobs} | {failed: 2}
    film = store_dir / PARTITION / "film.mp4"
    assert probe(film).duration_s == pytest.approx(sum(SHOT_SECONDS), abs=FRAME_S)
    assert film_event(second).metadata["degraded_shots"].value == []


def test_a_fixed_job_line_renders_only_that_shot_and_turns_a_draft_into_a_clean_film(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    lines = storyboard.read_text().splitlines()
    header = json.loads(lines[0])
    header["header"]["policy"] = "draft"  # this time from the job file's header
    storyboard.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    fake = FakeComfy(script=["ok", "ok", "error"], prompt_seconds=0.005)
    store_dir = tmp_path / "store"

    with serving(fake) as comfy:
        first = materialize_partition(instance, comfy, store_dir)
        assert film_event(first).metadata["placeholder_shots"].value == [3]
        before = load_job_file(storyboard)
        shot3 = json.loads(lines[3])
        shot3["set"]["1.color"] = 0x123456  # the fix: a changed job line, a new prompt_id
        lines[3] = json.dumps(shot3)
        storyboard.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
        after = load_job_file(storyboard)
        second = materialize_partition(instance, comfy, store_dir)

    assert second.success
    fixed = after.jobs[2].prompt_id
    assert fixed != before.jobs[2].prompt_id
    assert counts([fake], "executed") == {job.prompt_id: 1 for job in before.jobs} | {fixed: 1}
    metadata = film_event(second).metadata
    assert (metadata["draft"].value, metadata["degraded_shots"].value) == (False, [])
    assert metadata["policy"].value == "draft"
    film = store_dir / PARTITION / "film.mp4"
    assert probe(film).duration_s == pytest.approx(sum(SHOT_SECONDS), abs=FRAME_S)


def test_a_film_partition_added_by_hand_for_a_file_without_shots_cuts_no_film(
    tmp_path: Path, instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "workflows").mkdir()
    shutil.copy(REPO / "data/workflows/image.json", tmp_path / "workflows")
    folder = tmp_path / "jobs"
    folder.mkdir()
    monkeypatch.setenv("COMFY_ASSETS_JOB_DIRS", str(folder))
    write_job_file(folder, "stills", [1, 2])

    with serving(FakeComfy()) as comfy:
        result = materialize_partition(instance, comfy, tmp_path / "store", partition="stills")

    assert result.success
    assert film_event(result) is None  # no materialized film for the UI to show green
    assert "gate" not in checks(result)  # nothing was gated
    (observation,) = [
        e.asset_observation_data.asset_observation
        for e in result.all_events
        if e.event_type_value == "ASSET_OBSERVATION"
    ]
    assert (observation.asset_key, observation.partition) == (AssetKey("films"), "stills")
    assert observation.metadata["status"].value == "no shots"
    assert not (tmp_path / "store" / "stills" / "film.mp4").exists()


def films_requested(instance: DagsterInstance, cursor: object = None) -> tuple[set, object]:
    """One evaluation of the automation conditions: the film partitions it requests, and the
    cursor for the next."""
    evaluation = evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
    return evaluation.get_requested_partitions(AssetKey("films")), evaluation.cursor


def test_a_storyboard_film_is_requested_once_its_renders_are_built(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    instance.add_dynamic_partitions("job_files", [PARTITION, "stills"])
    instance.add_dynamic_partitions("storyboards", [PARTITION])  # as the sensor does
    store_dir = tmp_path / "store"
    with serving(FakeComfy(prompt_seconds=0.005)) as comfy:
        wanted, cursor = films_requested(instance)
        assert wanted == set()  # renders not built yet: nothing to cut
        resources = {"comfy": comfy, "result_store": ResultStoreResource(folder=str(store_dir))}
        materialize(
            [renders, render_results],
            partition_key=PARTITION,
            instance=instance,
            resources=resources,
        )
        wanted, cursor = films_requested(instance, cursor)
        assert wanted == {PARTITION}
        materialize_partition(instance, comfy, store_dir, only_films=True)
        wanted, cursor = films_requested(instance, cursor)
        assert wanted == set()  # cut: nothing changed since


def test_the_film_is_cut_behind_a_blocking_gate() -> None:
    graph = defs.resolve_asset_graph()

    assert AssetKey("films") in graph.executable_asset_keys
    assert AssetCheckKey(AssetKey("films"), "gate") in graph.asset_check_keys
    spec = films.get_spec_for_check_key(AssetCheckKey(AssetKey("films"), "gate"))
    assert spec.blocking


def test_a_render_that_changed_nothing_cuts_no_film_again(
    storyboard: Path, tmp_path: Path, instance
) -> None:
    store_dir = tmp_path / "store"
    fake = FakeComfy(prompt_seconds=0.005)
    with serving(fake) as comfy:
        materialize_partition(instance, comfy, store_dir)  # rendered and cut
        wanted, cursor = films_requested(instance)
        wanted, cursor = films_requested(instance, cursor)
        assert wanted == set()
        runs = len(fake.stats["runs"])
        # A backfill of renders over the partition: every job already done.
        resources = {"comfy": comfy, "result_store": ResultStoreResource(folder=str(store_dir))}
        assert materialize(
            [renders], partition_key=PARTITION, instance=instance, resources=resources
        ).success
        assert len(fake.stats["runs"]) == runs  # nothing rendered
        wanted, cursor = films_requested(instance, cursor)
        assert wanted == set()  # nothing changed: the film stands

        # A new take of a shot changes what the film is made of.
        lines = storyboard.read_text().splitlines()
        shot = json.loads(lines[1])  # after the header
        shot["take"] = 2
        storyboard.write_text("\n".join([lines[0], json.dumps(shot), *lines[2:]]) + "\n")
        assert materialize(
            [renders], partition_key=PARTITION, instance=instance, resources=resources
        ).success
        wanted, cursor = films_requested(instance, cursor)
        assert wanted == {PARTITION}
