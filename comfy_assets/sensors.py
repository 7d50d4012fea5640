"""The default farm's Dagster sensors: ``job_file_sensor`` (watched folders in,
partitions and runs out) and ``dead_runs_sensor`` (a run whose batch stopped beating is
failed), as ``comfy_assets.definitions`` has them, and the run tags the job-file sensor
sets.

A face: how a tick works, its cursor and its limits are in
``comfy_assets.farm.job_file_sensor`` and ``comfy_assets.farm.dead_runs``.
"""

from comfy_assets.farm.dead_runs import build_dead_runs_sensor
from comfy_assets.farm.job_file_sensor import (
    JOB_FILE_SHA_TAG,
    JOB_FILE_TAG,
    MAX_RUNS_ENV,
    SENSOR_INTERVAL_ENV,
    STRAY_GRACE_S,
    SeenFile,
    build_job_file_sensor,
    current_problems,
    dump_cursor,
    job_file_tick,
    parse_cursor,
)
from comfy_assets.farm.names import DEFAULT_FARM

__all__ = [
    "JOB_FILE_SHA_TAG",
    "JOB_FILE_TAG",
    "MAX_RUNS_ENV",
    "SENSOR_INTERVAL_ENV",
    "STRAY_GRACE_S",
    "SeenFile",
    "build_dead_runs_sensor",
    "build_job_file_sensor",
    "current_problems",
    "dead_runs_sensor",
    "dump_cursor",
    "job_file_sensor",
    "job_file_tick",
    "parse_cursor",
]

job_file_sensor = build_job_file_sensor(DEFAULT_FARM)
dead_runs_sensor = build_dead_runs_sensor(DEFAULT_FARM)
