"""Which version of a partition's job file an asset works on (the Dagster layer).

``renders`` renders the file as it is and records its sha256 as ``job_file_sha256``;
``render_results`` and ``films`` work on that version, and refuse a file changed since.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

from dagster import AssetExecutionContext, AssetRecordsFilter, Failure

from comfy_assets.farm.job_file_sensor import JOB_FILE_SHA_TAG
from comfy_assets.farm.names import DEFAULT_FARM, Farm
from comfy_assets.farm.partitions import AmbiguousJobFileError, find_job_file, input_rules_from_env
from comfy_assets.jobs.inputs import ObjectSource
from comfy_assets.jobs.model import JobFile, JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.stream import JobScan, scan_job_file

T = TypeVar("T")


def job_file_missing(
    context: AssetExecutionContext, partition: str, farm: Farm = DEFAULT_FARM
) -> bool:
    """True, with an error line in the run's log, when no watched folder has the
    partition's job file: a partition added by hand (the UI's "+ Add a partition") or one
    whose file was removed. The step then materializes nothing and succeeds: Dagster shows
    an asset red after a failed run until a later run materializes it, and a partition
    that names no file will never be materialized (job_file_sensor deletes it)."""
    try:
        find_job_file(partition, farm.dirs())
    except FileNotFoundError as exc:
        context.log.error(f"partition {partition}: {exc}; nothing to do (added by hand?)")
        return True
    except AmbiguousJobFileError:
        return False  # load_partition_file fails the step with the names
    return False


def load_partition_file(partition: str, farm: Farm = DEFAULT_FARM) -> JobFile:
    """The job file of a partition; a missing or invalid file fails without retries."""
    return _read_partition_file(partition, farm, load_job_file)


def scan_partition_file(
    partition: str, farm: Farm = DEFAULT_FARM, objects: ObjectSource | None = None
) -> JobScan | JobFile:
    """The job file of a partition validated whole in one pass, its jobs not held but
    built a chunk at a time as the batch takes them, as ``run`` does (``scan_job_file``: a
    file whose jobs take inputs from other jobs is loaded whole). The batch's summary of
    a ``JobScan`` names a few jobs only (``summarize_file``): ``renders`` reads its records
    from the store; ``objects`` reads its ``s3://`` inputs (the store's files). A missing
    or invalid file fails without retries."""
    return _read_partition_file(partition, farm, scan_job_file, objects)


def scan_requested_file(
    context: AssetExecutionContext, partition: str, farm: Farm, objects: ObjectSource
) -> JobScan | JobFile:
    """``scan_partition_file`` of the partition's job file (its ``s3://`` inputs read by
    ``objects``, the store's files), with a warning in the run's log when the file
    changed since the sensor requested the run (its tag ``JOB_FILE_SHA_TAG``)."""
    job_file = scan_partition_file(partition, farm, objects)
    requested = context.run.tags.get(JOB_FILE_SHA_TAG)
    if requested and requested != job_file.sha256:
        context.log.warning(
            f"{job_file.path} changed since the sensor requested this run; rendering the "
            f"current version {job_file.sha256[:16]} (the sensor requests a run for it too)"
        )
    return job_file


def file_job_ids(job_file: JobScan | JobFile) -> Sequence[str]:
    """The job ids of a job file, in line order (a ``JobScan``'s made when read)."""
    if isinstance(job_file, JobScan):
        return job_file.job_ids()
    return [job.id for job in job_file.jobs]


def _read_partition_file(
    partition: str, farm: Farm, read: Callable[..., T], objects: ObjectSource | None = None
) -> T:
    """``read`` of the partition's job file with the input rules of the environment (its
    ``s3://`` inputs read by ``objects``); a missing or invalid file fails without
    retries."""
    rules = dataclasses.replace(input_rules_from_env(), objects=objects)
    try:
        return read(find_job_file(partition, farm.dirs()), rules=rules)
    except (FileNotFoundError, AmbiguousJobFileError, JobFileError, ValueError) as exc:
        raise Failure(description=f"partition {partition}: {exc}", allow_retries=False) from exc


def rendered_sha256(
    context: AssetExecutionContext, partition: str, farm: Farm = DEFAULT_FARM
) -> str | None:
    """sha256 of the job file version that ``renders`` last materialized for ``partition``
    (its ``job_file_sha256`` metadata); None when ``renders`` has no materialization."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=farm.key("renders"), asset_partitions=[partition]), limit=1
    ).records
    if not records or records[0].asset_materialization is None:
        return None
    value = records[0].asset_materialization.metadata.get("job_file_sha256")
    return str(value.value) if value is not None else None


def load_rendered_file(
    context: AssetExecutionContext, partition: str, farm: Farm = DEFAULT_FARM
) -> JobFile:
    """The partition's job file, when it is the version ``renders`` rendered.

    A file changed since then fails the step without retries (the table or film would
    describe jobs that were not rendered; the sensor requests a run for the new version).
    With no ``renders`` materialization yet, the current file is used and a warning says
    so: the store's records of its jobs are all there is."""
    return _rendered(context, partition, farm, load_partition_file(partition, farm))


def scan_rendered_file(
    context: AssetExecutionContext, partition: str, farm: Farm = DEFAULT_FARM
) -> JobScan | JobFile:
    """``load_rendered_file``, the file validated in one pass without holding its jobs
    (``scan_partition_file``): its job ids in line order (``file_job_ids``) cost 16
    bytes a job."""
    return _rendered(context, partition, farm, scan_partition_file(partition, farm))


def _rendered(context: AssetExecutionContext, partition: str, farm: Farm, job_file: T) -> T:
    """``job_file`` (a ``JobFile`` or ``JobScan``) when it is the version ``renders``
    rendered (``load_rendered_file``)."""
    found: JobFile | JobScan = job_file  # type: ignore[assignment]
    rendered = rendered_sha256(context, partition, farm)
    if rendered is None:
        context.log.warning(
            f"partition {partition}: renders has no materialization yet; using the current "
            f"{found.path} ({found.sha256[:16]}) and what the store holds for its jobs"
        )
    elif rendered != found.sha256:
        raise Failure(
            description=(
                f"partition {partition}: {found.path} changed after renders rendered it "
                f"(rendered {rendered[:16]}, now {found.sha256[:16]}); materialize renders "
                "for the new version first (the sensor requests a run for it)"
            ),
            metadata={"rendered_sha256": rendered, "job_file_sha256": found.sha256},
            allow_retries=False,
        )
    return job_file
