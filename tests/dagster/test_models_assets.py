"""What loading models cost, as the results CSV and the Dagster metadata show it: per job
its models and whether its server had to load one, per partition the loads per server
and the GPU seconds they took, counted the way the fakes counted them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from dagster import DagsterInstance, TableMetadataValue, materialize

from comfy_assets.assets import render_results, renders
from comfy_assets.render.cost import model_load_cost
from comfy_assets.resources import ComfyPoolResource, ResultStoreResource, ServerConfig
from comfy_assets.store import ModelLoadRecord
from fake_comfy import FakeComfy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def jobs_dir(watch: Callable[[str], Path]) -> Path:
    """A watched job folder beside ``workflows/text_to_image.json``."""
    return watch("text_to_image.json")


def test_a_render_tells_each_jobs_models_and_the_loads_per_server(
    jobs_dir: Path, tmp_path: Path, instance: DagsterInstance
) -> None:
    names = ["a.safetensors", "b.safetensors"] * 3
    lines = [
        json.dumps(
            {
                "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"test-models-assets/{i}")),
                "workflow": "../workflows/text_to_image.json",
                "set": {"4.ckpt_name": name, "3.seed": i, "5.width": 64, "5.height": 64},
            }
        )
        for i, name in enumerate(names)
    ]
    (jobs_dir / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    fakes = [
        FakeComfy(
            models=["a.safetensors", "b.safetensors"], model_load_s=0.05, prompt_seconds=0.001
        )
        for _ in range(2)
    ]
    instance.add_dynamic_partitions("job_files", ["mixed"])
    with fakes[0].serve_in_thread(port=0) as url0, fakes[1].serve_in_thread(port=0) as url1:
        comfy = ComfyPoolResource(
            servers=[ServerConfig(name="gpu0", url=url0), ServerConfig(name="gpu1", url=url1)],
            base_delay_s=0.01,
            jitter=False,
            poll_s=0.05,
            unhealthy_wait_s=0.05,
        )
        result = materialize(
            [renders, render_results],
            partition_key="mixed",
            instance=instance,
            resources={"comfy": comfy, "result_store": ResultStoreResource(folder=str(tmp_path))},
        )
    loads = {
        f"gpu{i}": sum(len(t) for t in f.stats["model_loads"].values()) for i, f in enumerate(fakes)
    }

    (event,) = [
        e for e in result.get_asset_materialization_events() if e.asset_key.path == ["renders"]
    ]
    metadata = event.materialization.metadata
    assert metadata["model_loads"].value == sum(loads.values())
    by_server = metadata["model_loads_by_server"]
    assert isinstance(by_server, TableMetadataValue)
    assert {r.data["server"]: r.data["loads"] for r in by_server.records} == {
        s: n for s, n in loads.items() if n
    }
    assert metadata["model_load_gpu_seconds"].value >= 0.05 * sum(loads.values())
    job_table = metadata["job_table"]
    assert [r.data["models"] for r in job_table.records] == names
    assert sum(r.data["model_loaded"] for r in job_table.records) == sum(loads.values())

    frame = pd.read_csv(tmp_path / "mixed" / "results.csv", dtype=str, keep_default_na=False)
    assert list(frame.columns[-9:]) == [
        "state",
        "server",
        "models",
        "model_loaded",
        "failed_on",
        "attempts",
        "seconds",
        "files",
        "reason",
    ]
    assert frame["models"].tolist() == names
    assert (frame["model_loaded"] == "True").sum() == sum(loads.values())


def test_a_load_costs_its_tries_gpu_seconds_beyond_the_usual_for_its_model():
    def tried(server: str, model: str, loaded: bool, seconds: float | None) -> ModelLoadRecord:
        return ModelLoadRecord("j", 1, server, (model,), loaded, "success", seconds)

    cost = model_load_cost(
        [
            tried("gpu0", "a", True, 2.5),
            tried("gpu0", "a", False, 0.5),
            tried("gpu0", "a", False, 0.7),
            tried("gpu1", "b", True, 3.0),  # no plain b: the plain a's median stands in
            tried("gpu1", "b", True, None),  # never ran (refused): no load
        ]
    )
    assert (cost.loads, cost.gpu_seconds) == (2, 4.3)
    assert cost.by_server == {"gpu0": (1, 1.9), "gpu1": (1, 2.4)}
