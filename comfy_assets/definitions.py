"""The Dagster definitions of comfy-assets (``workspace.yaml``, ``[tool.dagster]``).

Job files dropped into the watched folders become partitions of ``renders`` through
``job_file_sensor``, which launches ``render_job`` (renders + render_results) once per file
version. A job file with shots is a partition of ``films`` too (``storyboards``):
``films_automation_sensor`` cuts its shots into ``film.mp4`` behind the blocking ``gate``
check once its render run has ended. ``all_results`` gathers every partition's table,
built again by ``results_automation_sensor`` after any render. ``dead_runs_sensor`` fails
a run whose batch stopped beating in the store (its host died), so run retries launch it
again.
``job_files`` (the files themselves, reported by the sensor) is upstream of ``renders``.
"""

from __future__ import annotations

from dagster import (
    AssetSelection,
    AutomationConditionSensorDefinition,
    DefaultSensorStatus,
    Definitions,
    define_asset_job,
)

from comfy_assets.assets import (
    all_results,
    films,
    job_files,
    job_files_valid,
    render_results,
    renders,
)
from comfy_assets.dead_runs import dead_runs_sensor
from comfy_assets.resources import default_resources
from comfy_assets.sensors import job_file_sensor

# Run retries (dagster.yaml: retry_on_asset_or_op_failure false) only re-launch runs whose
# worker died; the batch itself retries each job with backoff.
render_job = define_asset_job(
    "render_job",
    selection=[renders, render_results],  # both partitioned by job_files
    tags={"dagster/max_retries": "2"},
    description=(
        "Render every job of one job file and write its results CSV (a storyboard's film "
        "follows, launched by films_automation_sensor)."
    ),
)

# Cuts a storyboard's film after its renders: films is partitioned by storyboards only,
# so it cannot share render_job (one partitions definition a job).
films_automation_sensor = AutomationConditionSensorDefinition(
    "films_automation_sensor",
    target=AssetSelection.assets(films),
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=10,
    description="Cuts a storyboard's film once its render run has ended (and after each "
    "new render of it).",
)

# Builds render_results after renders launched without it (a backfill of renders), then
# all_results after any results; running from the start like job_file_sensor (the default
# automation sensor starts stopped).
results_automation_sensor = AutomationConditionSensorDefinition(
    "results_automation_sensor",
    target=AssetSelection.assets(render_results, all_results),
    default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=10,
    description="Materializes a job file's render_results after its renders however they "
    "were launched, and all_results again after any job file's results change.",
)

defs = Definitions(
    assets=[job_files, renders, render_results, films, all_results],
    asset_checks=[job_files_valid],
    sensors=[
        job_file_sensor,
        results_automation_sensor,
        films_automation_sensor,
        dead_runs_sensor,
    ],
    jobs=[render_job],
    resources=default_resources(),
)
