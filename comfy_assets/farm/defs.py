"""One render farm's Dagster definitions, from its settings: the factory behind
``comfy_assets.definitions`` (the default farm) and every ``RenderFarm`` component.

Job files dropped into the farm's watched folders become partitions of its ``renders``
through its ``job_file_sensor``, which launches its ``render_job`` (renders +
render_results) once per file version. A job file with shots is a partition of its
``films`` too: its ``films_automation_sensor`` cuts the shots into ``film.mp4`` behind the
blocking ``gate`` check once the render run has ended. Its ``all_results`` gathers every
partition's table, built again by its ``results_automation_sensor`` after any render (and
``render_results`` after a render launched without it). Its ``dead_runs_sensor`` fails a
run whose batch stopped beating in the farm's store (its host died), so run retries
launch it again. Names are the farm's (``Farm.name``, ``Farm.key``).
"""

from __future__ import annotations

from dagster import (
    AssetSelection,
    AutomationConditionSensorDefinition,
    DefaultSensorStatus,
    Definitions,
    define_asset_job,
)

from comfy_assets.farm.assets import FarmAssets, build_assets
from comfy_assets.farm.dead_runs import build_dead_runs_sensor
from comfy_assets.farm.job_file_sensor import build_job_file_sensor
from comfy_assets.farm.launched_partition import add_launched_partition
from comfy_assets.farm.names import Farm
from comfy_assets.farm.resources import ComfyPoolResource, ResultStoreResource

# Run retries (dagster.yaml: retry_on_asset_or_op_failure false) only re-launch runs whose
# worker died; the batch itself retries each job with backoff.
RENDER_JOB_RETRIES = "2"


def build_farm_defs(
    farm: Farm,
    comfy: ComfyPoolResource,
    result_store: ResultStoreResource,
    assets: FarmAssets | None = None,
) -> Definitions:
    """The definitions of one farm: its assets and checks (``build_assets``, or
    ``assets`` already built for it), its render job, its four sensors and its two
    resources under ``farm.comfy_key`` and ``farm.store_key``. A ``--partition`` on the
    command line that names a job file of the farm is added first (``launched_partition``)."""
    built = assets if assets is not None else build_assets(farm)
    # `dg launch --partition KEY` of a job file the sensor has not seen yet.
    add_launched_partition(farm)
    render_job = define_asset_job(
        farm.name("render_job"),
        # Both partitioned by the farm's job files.
        selection=AssetSelection.assets(built.renders, built.render_results),
        tags={"dagster/max_retries": RENDER_JOB_RETRIES},
        description=(
            "Render every job of one job file and write its results CSV (a storyboard's "
            f"film follows, launched by {farm.name('films_automation_sensor')})."
        ),
    )
    # Cuts a storyboard's film after its renders: films is partitioned by storyboards
    # only, so it cannot share render_job (one partitions definition a job).
    films_automation_sensor = AutomationConditionSensorDefinition(
        farm.name("films_automation_sensor"),
        target=AssetSelection.assets(built.films),
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=farm.automation_interval_s,
        description="Cuts a storyboard's film once its render run has ended (and after each "
        "render that changed it).",
    )
    # Builds render_results after renders launched without it (a backfill of renders),
    # then all_results after any results; running from the start like job_file_sensor
    # (the default automation sensor starts stopped).
    results_automation_sensor = AutomationConditionSensorDefinition(
        farm.name("results_automation_sensor"),
        target=AssetSelection.assets(built.render_results, built.all_results),
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=farm.automation_interval_s,
        description="Materializes a job file's render_results after its renders however "
        "they were launched, and all_results again after any job file's results change.",
    )
    return Definitions(
        assets=[
            built.job_files,
            built.renders,
            built.render_results,
            built.films,
            built.all_results,
        ],
        asset_checks=[built.job_files_valid],
        sensors=[
            build_job_file_sensor(farm),
            results_automation_sensor,
            films_automation_sensor,
            build_dead_runs_sensor(farm),
        ],
        jobs=[render_job],
        resources={farm.comfy_key: comfy, farm.store_key: result_store},
    )
