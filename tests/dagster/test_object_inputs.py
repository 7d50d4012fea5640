"""``s3://`` inputs in Dagster: the sensor's tick, which reaches no store, takes them by
their form (a bad URL is still the file's error, by line and field); the ``renders`` run
reads them through its store's files and uploads their bytes to the server."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from dagster import materialize

from comfy_assets.assets import renders
from comfy_assets.farm.job_file_sensor import sensor_rules
from comfy_assets.jobs.model import JobFileError
from comfy_assets.jobs.stream import scan_job_file
from comfy_assets.resources import ResultStoreResource
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.dagster.test_assets import serving
from tests.render.test_file_store_wiring import ObjectFolderStore
from tests.render.test_inputs_render import picture, pixels_of
from tests.support import job_id

URL = "s3://plates/shots/plate.png"


def jobs_with(folder: Path, urls: list[str]) -> Path:
    """``folder/plates.jsonl``: a job inverting each picture ``urls`` names."""
    lines = [
        json.dumps(
            {
                "id": job_id(i, "s3-dagster"),
                "workflow": "../workflows/invert_picture.json",
                "inputs": {"1.image": url},
            }
        )
        for i, url in enumerate(urls)
    ]
    path = folder / "plates.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_tick_takes_an_s3_input_by_its_form_and_refuses_a_url_naming_no_object(
    watch: Callable[[str], Path],
) -> None:
    path = jobs_with(watch("invert_picture.json"), [URL, "s3://plates"])
    with pytest.raises(JobFileError) as info:
        scan_job_file(path, rules=sensor_rules())
    (error,) = info.value.errors  # the first line is taken: nothing read it
    assert (error.line, error.field) == (2, "inputs.1.image")
    assert "not an object's URL (s3://BUCKET/KEY)" in error.message


def test_renders_reads_an_s3_input_through_the_stores_files_and_uploads_it(
    watch: Callable[[str], Path], tmp_path: Path, instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs_with(watch("invert_picture.json"), [URL])
    source = picture(tmp_path / "plate.png", 5)
    objects = ObjectFolderStore(tmp_path / "store", {URL: (tmp_path / "plate.png").read_bytes()})
    opened = ResultStoreResource.open

    def open_with_objects(self: ResultStoreResource, *, retry_s: float | None = None) -> Store:
        store = opened(self, retry_s=retry_s)
        store.file_store = objects
        return store

    monkeypatch.setattr(ResultStoreResource, "open", open_with_objects)
    instance.add_dynamic_partitions("job_files", ["plates"])
    fake = FakeComfy(prompt_seconds=0.005)
    with serving(fake) as comfy:
        result = materialize(
            [renders],
            partition_key="plates",
            instance=instance,
            resources={
                "result_store": ResultStoreResource(folder=str(tmp_path / "store")),
                "comfy": comfy,
            },
        )

    assert result.success
    assert int(fake.stats["uploads"]) == 1
    assert objects.opened == [URL, URL]  # hashed when the run read the file, then uploaded
    store = Store.existing(tmp_path / "store")
    (out,) = [f for f in store.files(job_id(0, "s3-dagster")) if f.path.endswith(".png")]
    inverted = pixels_of(store.job_dir("plates", job_id(0, "s3-dagster")) / out.path)
    expected = np.clip(255.0 * (1.0 - source.astype(np.float32) / 255.0), 0, 255)
    assert np.array_equal(inverted, expected.astype(np.uint8))
