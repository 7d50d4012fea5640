"""The assets over a store whose files are not on this disk (``LinkedFileStore``, the
stand-in for an object store, given to every ``Store``): the contact sheets, the film,
results.csv and all_results.csv are read through the store (shots and outputs copied
from it) and written with ``write_file``, and the UI's pictures and film are presigned
links, good for a week, that it shows inline."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from dagster import AssetKey, materialize

from comfy_assets.assets import all_results, films, render_results, renders
from comfy_assets.film.probe import probe
from comfy_assets.resources import ResultStoreResource
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.dagster.test_assets import serving
from tests.file_store_support import LinkedFileStore

REPO = Path(__file__).resolve().parents[2]
PARTITION = "storyboard"
WEEK_S = 7 * 24 * 3600


def metadata_of(result, asset: str) -> dict:
    [event] = [
        e for e in result.get_asset_materialization_events() if e.asset_key == AssetKey(asset)
    ]
    return event.materialization.metadata


def test_films_sheets_and_results_go_through_the_object_store(
    watch: Callable[[str], Path], tmp_path: Path, instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = watch("video_shot.json")
    shutil.copy(REPO / "data/jobs/storyboard.jsonl", folder)
    store_dir = tmp_path / "store"
    # The bytes live in the store's folder (where the batch writes outputs today); every
    # reader and writer of the assets reaches them only through the file store.
    linked = LinkedFileStore(store_dir)
    opened = ResultStoreResource.open

    def open_linked(self: ResultStoreResource, *, retry_s: float | None = None) -> Store:
        store = opened(self, retry_s=retry_s)
        store.file_store = linked  # type: ignore[attr-defined]
        return store

    monkeypatch.setattr(ResultStoreResource, "open", open_linked)
    resources = {"result_store": ResultStoreResource(folder=str(store_dir))}
    instance.add_dynamic_partitions("job_files", [PARTITION])
    instance.add_dynamic_partitions("storyboards", [PARTITION])

    with serving(FakeComfy(prompt_seconds=0.005)) as comfy:
        resources["comfy"] = comfy  # type: ignore[assignment]
        rendered = materialize(
            [renders, render_results],
            partition_key=PARTITION,
            instance=instance,
            resources=resources,
        )
        cut = materialize([films], partition_key=PARTITION, instance=instance, resources=resources)
    gathered = materialize([all_results], instance=instance, resources=resources)
    assert rendered.success and cut.success and gathered.success

    assert sorted(linked.written) == sorted(
        [
            f"{PARTITION}/outputs.contact.png",
            f"{PARTITION}/results.csv",
            # results.csv's segment and their index (render/segments.py)
            f"{PARTITION}/.results/0.csv",
            f"{PARTITION}/.results/segments.json",
            f"{PARTITION}/film.mp4",
            f"{PARTITION}/film.contact.png",
            "all_results.csv",
        ]
    )
    # Six shots and their outputs read through the store: the sheet of outputs and the
    # gate (which decodes each shot whole) each copied them; results.csv read back (and
    # joined from its segment: ``.results/``).
    outputs = [key for key in linked.opened if key.count("/") >= 2 and "/.results/" not in key]
    assert len(outputs) == 12 and len(set(outputs)) == 6
    assert f"{PARTITION}/results.csv" in linked.opened

    film = store_dir / PARTITION / "film.mp4"
    assert probe(film).duration_s == pytest.approx(7.75, abs=1 / 24)
    renders_meta = metadata_of(rendered, "renders")
    sheet = renders_meta["contact_sheet"].value
    link = f"{linked.base_url}/{PARTITION}/outputs.contact.png?X-Amz-Expires={WEEK_S}&"
    assert sheet.startswith(f"[![{PARTITION}: 6 outputs of 6 jobs]({link}")
    assert len(sheet) < 1000  # the UI shows it inline
    assert renders_meta["contact_sheet_path"].value == (
        f"s3://fake-bucket/farm/files/{PARTITION}/outputs.contact.png"
    )
    assert renders_meta["store"].value == f"s3://fake-bucket/farm/files/{PARTITION}"
    film_meta = metadata_of(cut, "films")
    assert film_meta["film"].value.startswith(f"{linked.base_url}/{PARTITION}/film.mp4?")
    assert film_meta["contact_sheet"].value.startswith("[![film contact sheet](http://objects")
    assert film_meta["path"].value == f"s3://fake-bucket/farm/files/{PARTITION}/film.mp4"
    results_meta = metadata_of(rendered, "render_results")
    assert results_meta["path"].value == f"s3://fake-bucket/farm/files/{PARTITION}/results.csv"
    table = pd.read_csv(store_dir / "all_results.csv", dtype=str)
    assert list(table["partition"]) == [PARTITION] * 6
    assert set(table["state"]) == {"succeeded"}
    assert set(linked.expiries) == {WEEK_S}
