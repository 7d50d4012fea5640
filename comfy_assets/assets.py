"""The Dagster assets: render a job file's partition, tabulate it, gather every table,
and cut a storyboard's shots into a film.

Thin on purpose: the work is ``comfy_assets.render.batch.run_batch_sync``, the table is
``comfy_assets.render.results`` and the film is ``comfy_assets.film.gate.build_film`` (fed by
``comfy_assets.film.shots``); this module turns their answers into Dagster events.
"""

import base64
import io
from collections.abc import Iterator, Sequence
from pathlib import Path

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetRecordsFilter,
    Failure,
    MaterializeResult,
    MetadataValue,
    RetryRequested,
    asset,
)
from PIL import Image

from comfy_assets.film.gate import FilmResult, GateBlocked, GateResult
from comfy_assets.film.make import make_film
from comfy_assets.film.shots import (
    bad_shot_lines,
    film_cost_report,
    film_path,
    film_policy,
    has_shots,
)
from comfy_assets.jobs.model import JobFile, JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.states import DONE
from comfy_assets.partitions import AmbiguousJobFileError, find_job_file, job_files_partitions
from comfy_assets.render.results import (
    RESULTS_CSV,
    combine_results,
    markdown_table,
    results_csv_path,
    write_csv,
    write_results,
)
from comfy_assets.render.run import run_batch_sync
from comfy_assets.render.summary import BatchSummary
from comfy_assets.resources import ComfyPoolResource, ResultStoreResource
from comfy_assets.sensors import JOB_FILE_SHA_TAG
from comfy_assets.store import Store, StoreUnavailable

THUMBNAILS = 4
THUMBNAIL_PX = 64
# Thumbnails come from the first jobs only: a video batch has no PNG to find.
THUMBNAIL_SCAN_JOBS = 20
JOB_TABLE_ROWS = 50
# The contact sheet shown in the UI is shrunk to fit this box: metadata lives in the event log.
CONTACT_SHEET_PX = 480
# A render stopped because no server was reachable is tried again this much later.
NO_SERVER_RETRY_WAIT_S = 60


def _load_partition_file(partition: str) -> JobFile:
    """The job file of a partition; a missing or invalid file fails without retries."""
    try:
        return load_job_file(find_job_file(partition))
    except (FileNotFoundError, AmbiguousJobFileError, JobFileError) as exc:
        raise Failure(description=f"partition {partition}: {exc}", allow_retries=False) from exc


def _rendered_sha256(context: AssetExecutionContext, partition: str) -> str | None:
    """sha256 of the job file version that ``renders`` last materialized for ``partition``
    (its ``job_file_sha256`` metadata); None when ``renders`` has no materialization."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey("renders"), asset_partitions=[partition]), limit=1
    ).records
    if not records or records[0].asset_materialization is None:
        return None
    value = records[0].asset_materialization.metadata.get("job_file_sha256")
    return str(value.value) if value is not None else None


def _load_rendered_file(context: AssetExecutionContext, partition: str) -> JobFile:
    """The partition's job file, when it is the version ``renders`` rendered.

    A file changed since then fails the step without retries (the table or film would
    describe jobs that were not rendered; the sensor requests a run for the new version).
    With no ``renders`` materialization yet, the current file is used and a warning says
    so: the store's records of its jobs are all there is."""
    job_file = _load_partition_file(partition)
    rendered = _rendered_sha256(context, partition)
    if rendered is None:
        context.log.warning(
            f"partition {partition}: renders has no materialization yet; using the current "
            f"{job_file.path} ({job_file.sha256[:16]}) and what the store holds for its jobs"
        )
    elif rendered != job_file.sha256:
        raise Failure(
            description=(
                f"partition {partition}: {job_file.path} changed after renders rendered it "
                f"(rendered {rendered[:16]}, now {job_file.sha256[:16]}); materialize renders "
                "for the new version first (the sensor requests a run for it)"
            ),
            metadata={"rendered_sha256": rendered, "job_file_sha256": job_file.sha256},
            allow_retries=False,
        )
    return job_file


def _thumbnails(store: Store, partition: str, job_ids: Sequence[str]) -> str:
    """Markdown of small PNG thumbnails (base64 data URIs) of the first PNG outputs."""
    images: list[str] = []
    for job_id in job_ids[:THUMBNAIL_SCAN_JOBS]:
        for record in store.files(job_id):
            if len(images) >= THUMBNAILS:
                return " ".join(images)
            if not record.path.lower().endswith(".png"):
                continue
            with Image.open(store.job_dir(partition, job_id) / record.path) as image:
                image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
                buffer = io.BytesIO()
                image.convert("RGB").save(buffer, format="PNG", optimize=True)
            data = base64.b64encode(buffer.getvalue()).decode("ascii")
            images.append(f"![{job_id[:8]} {record.path}](data:image/png;base64,{data})")
    return " ".join(images)


def _jobs_markdown(summary: BatchSummary, job_ids: Sequence[str]) -> str:
    by_id = {record.job_id: record for record in summary.jobs}
    lines = ["| job | state | server | attempts | seconds | reason |", "|---|---|---|---|---|---|"]
    for job_id in list(job_ids)[:JOB_TABLE_ROWS]:
        record = by_id.get(job_id)
        if record is None:
            lines.append(f"| {job_id} | missing | | | | |")
            continue
        seconds = "" if record.seconds is None else f"{record.seconds:.2f}"
        reason = (record.reason or "").replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(
            f"| {job_id} | {record.state} | {record.server or ''} | {record.attempts} "
            f"| {seconds} | {reason} |"
        )
    if len(job_ids) > JOB_TABLE_ROWS:
        lines.append(f"\n… {len(job_ids) - JOB_TABLE_ROWS} more jobs in results.csv")
    return "\n".join(lines)


@asset(
    partitions_def=job_files_partitions,
    check_specs=[
        AssetCheckSpec(
            "no_dead_letters",
            asset="renders",
            description="No job of the file ended as a dead letter (permanent failure).",
        ),
        AssetCheckSpec(
            "all_jobs_done",
            asset="renders",
            description="Every job of the current file version is succeeded or degraded.",
        ),
    ],
    kinds={"comfyui"},
)
def renders(
    context: AssetExecutionContext, comfy: ComfyPoolResource, result_store: ResultStoreResource
) -> MaterializeResult:
    """Every job of the partition's job file rendered on the ComfyUI pool.

    Jobs already done with the same inputs are not posted again (the result store
    remembers them by prompt_id); changed jobs get a new prompt_id and render again.

    Dead letters: the batch runs to its end, then the asset **materializes with the check
    ``no_dead_letters`` failed** (severity ERROR), every dead letter logged as an error
    and listed in the check's metadata. It does not raise: Dagster cannot fail a step and
    record its materialization, and raising would skip ``render_results``, losing the CSV
    rows of the jobs that did render. A storyboard stopped by its delivery policy also
    fails ``all_jobs_done``. A run cancelled from the UI ends CANCELED: the batch
    interrupts our prompts, releases its claims and server leases, and re-raises.
    A missing or invalid job file fails the run without retries.
    """
    partition = context.partition_key
    job_file = _load_partition_file(partition)
    requested = context.run.tags.get(JOB_FILE_SHA_TAG)
    if requested and requested != job_file.sha256:
        context.log.warning(
            f"{job_file.path} changed since the sensor requested this run; rendering the "
            f"current version {job_file.sha256[:16]} (the sensor requests a run for it too)"
        )
    job_ids = [job.id for job in job_file.jobs]

    store = result_store.open()
    try:
        summary = run_batch_sync(
            job_file,
            partition=partition,
            servers=comfy.server_specs(),
            store=store,
            config=comfy.batch_config(),
            on_line=context.log.info,
        )
        thumbnails = _thumbnails(store, partition, job_ids)
    except StoreUnavailable as e:
        # The batch stopped and removed its prompts; Dagster tries the step again later.
        raise RetryRequested(
            max_retries=comfy.no_server_retries, seconds_to_wait=NO_SERVER_RETRY_WAIT_S
        ) from e
    finally:
        store.close()

    in_file = set(job_ids)
    current = [record for record in summary.jobs if record.job_id in in_file]
    done = sum(1 for record in current if record.state in DONE)
    dead = [(job_id, reason) for job_id, reason in summary.dead_letters if job_id in in_file]
    for job_id, reason in dead:
        context.log.error(f"job {job_id}: DEAD LETTER, {reason}")
    if summary.stopped:
        context.log.error(summary.stopped)
    for server, why in summary.unreachable.items():
        context.log.warning(f"server {server} unreachable: {why}")
    if summary.no_server:
        # Nothing is wrong with the jobs: the step fails, and Dagster tries it again later.
        raise RetryRequested(
            max_retries=comfy.no_server_retries, seconds_to_wait=NO_SERVER_RETRY_WAIT_S
        ) from RuntimeError(summary.stopped)

    counts = {state: int(n) for state, n in sorted(summary.counts.items()) if n}
    metadata: dict[str, object] = {
        "job_file": MetadataValue.path(str(job_file.path.resolve())),
        "job_file_sha256": job_file.sha256,
        "jobs": len(job_ids),
        "done": done,
        "dead_lettered": len(dead),
        "counts": MetadataValue.json(counts),
        "gpu_seconds": MetadataValue.float(float(summary.gpu_seconds)),
        "seconds": MetadataValue.float(float(summary.seconds)),
        "store": MetadataValue.path(str(result_store.root.resolve() / partition)),
        "job_table": MetadataValue.md(_jobs_markdown(summary, job_ids)),
    }
    if thumbnails:
        metadata["thumbnails"] = MetadataValue.md(thumbnails)
    if summary.stopped:
        metadata["stopped"] = summary.stopped
    dead_md = "\n".join(f"- `{job_id}`: {reason}" for job_id, reason in dead)
    return MaterializeResult(
        metadata=metadata,
        check_results=[
            AssetCheckResult(
                check_name="no_dead_letters",
                passed=not dead,
                severity=AssetCheckSeverity.ERROR,
                metadata={"dead_lettered": len(dead), "dead_letters": MetadataValue.md(dead_md)},
                description=f"{len(dead)} dead-lettered jobs" if dead else "no dead letters",
            ),
            AssetCheckResult(
                check_name="all_jobs_done",
                passed=done == len(job_ids),
                severity=AssetCheckSeverity.ERROR,
                metadata={"done": done, "jobs": len(job_ids), "counts": MetadataValue.json(counts)},
                description=f"{done} of {len(job_ids)} jobs done",
            ),
        ],
    )


@asset(partitions_def=job_files_partitions, deps=[renders], kinds={"pandas", "csv"})
def render_results(
    context: AssetExecutionContext, result_store: ResultStoreResource
) -> MaterializeResult:
    """The partition's results table, a row per job of the current job file, as CSV.

    Columns: job_id, one per ``set`` key, state, server, attempts, seconds, files
    (``name:sha256[:12]``), reason. Dead letters are rows too, with their reason.
    Built for the job file version ``renders`` rendered; fails if the file changed since.
    """
    partition = context.partition_key
    job_file = _load_rendered_file(context, partition)
    job_ids = [job.id for job in job_file.jobs]
    store = result_store.open()
    try:
        path, frame = write_results(store, partition, job_ids)
    finally:
        store.close()
    context.log.info(f"wrote {len(frame)} rows to {path}")
    return MaterializeResult(
        metadata={
            "dagster/row_count": len(frame),
            "job_file_sha256": job_file.sha256,
            "path": MetadataValue.path(str(path.resolve())),
            "preview": MetadataValue.md(markdown_table(frame)),
        }
    )


@asset(deps=[render_results], kinds={"pandas", "csv"})
def all_results(
    context: AssetExecutionContext, result_store: ResultStoreResource
) -> MaterializeResult:
    """Every partition's results CSV in one, ``<store>/all_results.csv``, with a
    ``partition`` column. Partitions without a CSV yet are listed in the log."""
    root = result_store.root
    tables: dict[str, Path] = {}
    for partition in context.instance.get_dynamic_partitions(job_files_partitions.name):
        path = results_csv_path(root, partition)
        if path.exists():
            tables[partition] = path
        else:
            context.log.warning(f"partition {partition} has no {RESULTS_CSV} yet")
    frame = combine_results(tables)
    path = write_csv(frame, root / "all_results.csv")
    return MaterializeResult(
        metadata={
            "dagster/row_count": len(frame),
            "partitions": len(tables),
            "path": MetadataValue.path(str(path.resolve())),
            "preview": MetadataValue.md(markdown_table(frame)),
        }
    )


def _contact_sheet_md(path: Path) -> str:
    """The contact sheet shrunk to CONTACT_SHEET_PX as a markdown image (base64 PNG)."""
    with Image.open(path) as image:
        image.thumbnail((CONTACT_SHEET_PX, CONTACT_SHEET_PX))
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG", optimize=True)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"![contact sheet](data:image/png;base64,{data})"


def _gate_check(gate: GateResult, partition: str) -> AssetCheckResult:
    """The ``gate`` check's result: passed or not, each missing or bad shot with why.

    Dagster 1.13 records a check returned by a partitioned asset without its partition,
    so the partition is in the metadata and the description."""
    listing = "\n".join(f"- {line}" for line in bad_shot_lines(gate)) or "every shot ok"
    return AssetCheckResult(
        check_name="gate",
        passed=gate.passed,
        severity=AssetCheckSeverity.ERROR,
        description=f"partition {partition}: {gate.describe()}",
        metadata={
            "partition": partition,
            "policy": gate.mode,
            "shots": len(gate.verdicts),
            "blocked": MetadataValue.json(gate.blocked),
            "degraded": MetadataValue.json(gate.degraded),
            "bad_shots": MetadataValue.md(listing),
        },
    )


def _film_metadata(
    film: FilmResult, cost: dict[str, float | int | None] | None
) -> dict[str, object]:
    """The film materialization's metadata: the film, then the cost report as numbers."""
    metadata: dict[str, object] = {
        "path": MetadataValue.path(str(film.path.resolve())),
        "duration_s": MetadataValue.float(float(film.duration_s)),
        "shot_count": film.shot_count,
        "degraded_shots": MetadataValue.json(film.degraded),
        "placeholder_shots": MetadataValue.json(film.placeholders),
        "policy": film.gate.mode,
        "draft": film.draft,
        "concat_mode": film.concat_mode,
        "contact_sheet": MetadataValue.md(_contact_sheet_md(film.contact_sheet)),
        "contact_sheet_path": MetadataValue.path(str(film.contact_sheet.resolve())),
    }
    if film.concat_reason:
        metadata["concat_reason"] = film.concat_reason
    for key, value in (cost or {}).items():
        if value is None:  # a strategy that never finishes (every attempt failed)
            metadata[key] = MetadataValue.null()
        elif isinstance(value, int):
            metadata[key] = MetadataValue.int(value)
        else:
            metadata[key] = MetadataValue.float(float(value))
    return metadata


@asset(
    partitions_def=job_files_partitions,
    deps=[renders],
    check_specs=[
        AssetCheckSpec(
            "gate",
            asset="films",
            blocking=True,
            description=(
                "Every shot is done, decodes fully and lasts its duration_s; under draft a "
                "failed or broken shot may be a slate. Evaluated before the film is written."
            ),
        )
    ],
    kinds={"video"},
)
def films(
    context: AssetExecutionContext, comfy: ComfyPoolResource, result_store: ResultStoreResource
) -> Iterator[AssetCheckResult | MaterializeResult]:
    """The partition's shots in ``shot`` order as ``<store>/<partition>/film.mp4`` (and
    ``film.contact.png``), for the job file version ``renders`` rendered.

    Policy: "delivery" (every shot rendered, decoding fully, lasting its ``duration_s``)
    or "draft" (a failed, missing or broken shot becomes a slate); the run config's
    ``comfy.policy`` wins over the job file's header. The blocking check ``gate`` judges
    every shot first: when it blocks, no film is written, no materialization is recorded,
    the check lists each bad shot and why, and the step fails without retries. Metadata:
    path, duration_s, shot_count, degraded and placeholder shots, policy, draft,
    concat_mode, the contact sheet, and the cost report (seconds; ``render.cost``). A job
    file without shots materializes with ``status: no shots`` and no film; a job file
    changed since ``renders`` fails the step.
    """
    partition = context.partition_key
    job_file = _load_rendered_file(context, partition)
    if not has_shots(job_file):
        context.log.info(f"{job_file.path}: no job has a shot number; no film")
        yield MaterializeResult(
            metadata={"status": "no shots", "job_file_sha256": job_file.sha256},
            check_results=[
                AssetCheckResult(
                    check_name="gate",
                    passed=True,
                    description=f"partition {partition}: no shots, no film to gate",
                    metadata={"partition": partition, "status": "no shots"},
                )
            ],
        )
        return
    try:
        film_policy(job_file, comfy.policy)
    except ValueError as exc:
        raise Failure(description=f"comfy.policy: {exc}", allow_retries=False) from exc

    store = result_store.open()
    try:
        cost = film_cost_report(store, job_file)
        film = make_film(
            store, partition, job_file, film_path(result_store.root, partition), comfy.policy
        )
    except GateBlocked as blocked:
        for line in bad_shot_lines(blocked.result):
            context.log.error(line)
        yield _gate_check(blocked.result, partition)
        raise Failure(
            description=blocked.result.describe(),
            metadata={"blocked": MetadataValue.json(blocked.result.blocked)},
            allow_retries=False,
        ) from blocked
    finally:
        store.close()
    policy = film_policy(job_file, comfy.policy)

    how = f"draft, slates for shots {film.placeholders}" if film.draft else policy.mode
    context.log.info(
        f"film {film.path}: {film.shot_count} shots, {film.duration_s:.3f} s ({how}), "
        f"concat {film.concat_mode}"
    )
    yield MaterializeResult(
        metadata={**_film_metadata(film, cost), "job_file_sha256": job_file.sha256},
        check_results=[_gate_check(film.gate, partition)],
    )
