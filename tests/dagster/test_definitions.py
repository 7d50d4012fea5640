"""The definitions load, and the deployment is configured by the environment alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dagster import AssetCheckKey, AssetKey, DefaultSensorStatus, IdentityPartitionMapping

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.definitions import defs
from comfy_assets.farm.partitions import job_files_partitions, storyboard_partitions
from comfy_assets.resources import ComfyPoolResource, ServerConfig, default_resources

REPO = Path(__file__).resolve().parents[2]


def test_render_job_renders_and_tabulates_one_job_file() -> None:
    job = defs.resolve_job_def("render_job")

    assert job.partitions_def == job_files_partitions
    assert job.tags["dagster/max_retries"] == "2"
    graph = job.asset_layer.asset_graph
    assert graph.executable_asset_keys == {AssetKey("renders"), AssetKey("render_results")}
    assert graph.asset_check_keys == {
        AssetCheckKey(AssetKey("renders"), "no_dead_letters"),
        AssetCheckKey(AssetKey("renders"), "all_jobs_done"),
    }


def test_films_has_a_partition_per_storyboard_and_follows_its_renders() -> None:
    graph = defs.resolve_asset_graph()
    node = graph.get(AssetKey("films"))

    assert node.partitions_def == storyboard_partitions
    mapping = graph.get_partition_mapping(AssetKey("films"), AssetKey("renders"))
    assert isinstance(mapping, IdentityPartitionMapping)
    assert node.automation_condition is not None
    automation = defs.resolve_sensor_def("films_automation_sensor")
    assert automation.default_status == DefaultSensorStatus.RUNNING
    assert automation.asset_selection.resolve(graph) == {AssetKey("films")}


def test_every_asset_and_the_sensor_are_defined() -> None:
    assert set(defs.resolve_all_asset_keys()) == {
        AssetKey("job_files"),
        AssetKey("renders"),
        AssetKey("render_results"),
        AssetKey("all_results"),
        AssetKey("films"),
    }
    sensor = defs.resolve_sensor_def("job_file_sensor")
    assert sensor.default_status == DefaultSensorStatus.RUNNING
    assert sensor.job_name == "render_job"
    assert sensor.minimum_interval_seconds == 10
    automation = defs.resolve_sensor_def("results_automation_sensor")
    assert automation.default_status == DefaultSensorStatus.RUNNING
    dead_runs = defs.resolve_sensor_def("dead_runs_sensor")
    assert dead_runs.default_status == DefaultSensorStatus.RUNNING
    assert dead_runs.targets == []  # it fails dead runs; run retries launch them again


def test_the_graph_reads_job_files_renders_results_films_all_results() -> None:
    graph = defs.resolve_asset_graph()

    def parents(name: str) -> set[str]:
        return {key.to_user_string() for key in graph.get(AssetKey(name)).parent_keys}

    assert parents("job_files") == set()
    assert parents("renders") == {"job_files"}
    assert parents("render_results") == {"renders"}
    assert parents("films") == {"renders"}
    assert parents("all_results") == {"render_results"}
    assert not graph.get(AssetKey("job_files")).is_executable  # the sensor reports it
    assert graph.get(AssetKey("all_results")).automation_condition is not None


def test_checks_are_recorded_per_partition_except_the_job_files_check() -> None:
    graph = defs.resolve_asset_graph()
    partitioned = {
        key.to_user_string(): graph.get(key).partitions_def for key in graph.asset_check_keys
    }
    assert partitioned == {
        "renders:no_dead_letters": job_files_partitions,
        "renders:all_jobs_done": job_files_partitions,
        "films:gate": storyboard_partitions,
        "job_files:valid": None,  # one verdict on every file of the watched folders
    }


def test_every_asset_has_a_group_an_owner_kinds_and_a_short_description() -> None:
    graph = defs.resolve_asset_graph()
    groups = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        groups[key.to_user_string()] = node.group_name
        assert node.owners == ["team:render"]
        assert node.kinds
        assert node.description and len(node.description) < 300
        assert "``" not in node.description  # written for the UI, not for Sphinx
    assert groups == {
        "job_files": "job_files",
        "renders": "renders",
        "render_results": "renders",
        "all_results": "renders",
        "films": "films",
    }
    for resource in default_resources().values():
        for name, field in type(resource).model_fields.items():
            assert field.description, f"{type(resource).__name__}.{name} has no description"


def test_resources_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("COMFY_ASSETS_SERVERS", "a=http://10.0.0.1:8188,b=http://10.0.0.2:8188")
    monkeypatch.setenv("COMFY_ASSETS_STORE", str(tmp_path))
    monkeypatch.setenv("COMFY_ASSETS_DB_URL", "postgresql+psycopg://u@h/db")

    resources = default_resources()
    comfy = resources["comfy"].process_config_and_initialize()
    store = resources["result_store"].process_config_and_initialize()

    assert comfy.server_specs() == [
        ServerSpec("a", "http://10.0.0.1:8188"),
        ServerSpec("b", "http://10.0.0.2:8188"),
    ]
    assert store.folder == str(tmp_path)
    assert store.db_url == "postgresql+psycopg://u@h/db"


def test_defaults_without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("COMFY_ASSETS_SERVERS", "COMFY_ASSETS_STORE", "COMFY_ASSETS_DB_URL"):
        monkeypatch.delenv(name, raising=False)

    resources = default_resources()
    comfy = resources["comfy"].process_config_and_initialize()
    store = resources["result_store"].process_config_and_initialize()

    assert [s.url for s in comfy.server_specs()] == [
        "http://127.0.0.1:8188",
        "http://127.0.0.1:8189",
    ]
    assert (store.folder, store.db_url) == ("store", None)


def test_a_server_list_overrides_the_spec_and_batch_settings_pass_through() -> None:
    comfy = ComfyPoolResource(
        servers=[ServerConfig(name="x", url="http://127.0.0.1:9")], attempts=2, max_queue=3
    )

    assert comfy.server_specs() == [ServerSpec("x", "http://127.0.0.1:9")]
    config = comfy.batch_config()
    assert (config.attempts, config.max_queue) == (2, 3)


def test_workspace_and_dagster_home_template() -> None:
    workspace = yaml.safe_load((REPO / "workspace.yaml").read_text())
    module = workspace["load_from"][0]["python_module"]
    assert module["module_name"] == "comfy_assets.definitions"

    home = yaml.safe_load((REPO / "dagster_home/dagster.yaml").read_text())
    assert home["run_retries"] == {
        "enabled": True,
        "max_retries": 2,
        "retry_on_asset_or_op_failure": False,
    }
    assert home["run_monitoring"]["enabled"] is True
    assert home["telemetry"]["enabled"] is False


def test_dagster_home_template_is_a_valid_instance_config(tmp_path: Path) -> None:
    from dagster import DagsterInstance

    (tmp_path / "dagster.yaml").write_text((REPO / "dagster_home/dagster.yaml").read_text())
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        assert instance.run_retries_enabled
        assert instance.run_retries_max_retries == 2
        assert instance.run_monitoring_enabled


def test_the_definitions_are_the_default_farm_of_the_factory_and_a_second_farm_shares_nothing(
    tmp_path: Path,
) -> None:
    from dagster import Definitions

    from comfy_assets.farm.defs import build_farm_defs
    from comfy_assets.farm.names import DEFAULT_FARM, Farm
    from comfy_assets.resources import ResultStoreResource

    resources = default_resources()
    again = build_farm_defs(DEFAULT_FARM, resources["comfy"], resources["result_store"])
    assert set(again.resolve_all_asset_keys()) == set(defs.resolve_all_asset_keys())
    names = {s.name for s in defs.sensors}
    assert {s.name for s in again.sensors} == names
    draft = build_farm_defs(
        Farm(key_prefix=("draft",), job_dirs=(tmp_path,)),
        ComfyPoolResource(servers_spec="gpu0=http://127.0.0.1:8188"),
        ResultStoreResource(folder=str(tmp_path / "store")),
    )
    both = Definitions.merge(defs, draft)  # no name or key in common
    keys = set(both.resolve_all_asset_keys())
    assert AssetKey(["draft", "renders"]) in keys and AssetKey("renders") in keys
    assert both.resolve_job_def("draft_render_job").partitions_def.name == "draft_job_files"
    assert {s.name for s in both.sensors} == names | {f"draft_{name}" for name in names}
    with pytest.raises(ValueError, match="key_prefix"):
        Farm(key_prefix=("no/slash",))
