"""The Dagster assets: the job files, their renders and results tables, every table in
one, and a storyboard's film.

Thin on purpose: the work is ``comfy_assets.render.run.run_batch_sync``, the table is
``comfy_assets.render.results``, the film is ``comfy_assets.film.make``, and the metadata
(tables, pictures, the job files' check) is built by ``comfy_assets.farm.metadata``; this
module turns their answers into Dagster events. ``build_assets`` makes one farm's assets
(``comfy_assets.farm.names``); ``comfy_assets.assets`` holds the default farm's.
"""

import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from dagster import (
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetDep,
    AssetExecutionContext,
    AssetKey,
    AssetObservation,
    AssetsDefinition,
    AssetSpec,
    DataVersion,
    DynamicPartitionsDefinition,
    Failure,
    IdentityPartitionMapping,
    MaterializeResult,
    MetadataValue,
    PreviewWarning,
    RetryRequested,
    asset,
    asset_check,
    multi_asset,
)

from comfy_assets.farm.automation import (
    ALL_RESULTS_CONDITION,
    FILMS_CONDITION,
    RENDER_RESULTS_CONDITION,
)
from comfy_assets.farm.job_file_sensor import current_problems
from comfy_assets.farm.metadata import (
    JOB_COLUMNS,
    Metadata,
    OutputsSheet,
    column_schema,
    film_metadata,
    job_files_check_fields,
    job_frame,
    job_table,
    model_load_metadata,
    outputs_contact_sheet,
    results_metadata,
    servers_metadata,
    stored_picture,
    table,
)
from comfy_assets.farm.names import Farm
from comfy_assets.farm.partition_view import dead_letter_lines, read_view
from comfy_assets.farm.partitions import JOB_FILES_ASSET, JOB_FILES_CHECK
from comfy_assets.farm.resources import ComfyPoolResource, ResultStoreResource
from comfy_assets.farm.versions import (
    file_job_ids,
    job_file_missing,
    load_rendered_file,
    scan_rendered_file,
    scan_requested_file,
)
from comfy_assets.film.gate import GateBlocked, GateResult
from comfy_assets.film.make import store_film
from comfy_assets.film.probe import MediaError
from comfy_assets.film.shots import (
    bad_shot_lines,
    film_cost_report,
    film_policy,
    has_shots,
)
from comfy_assets.render.combine import write_combined
from comfy_assets.render.progress import log_every
from comfy_assets.render.results import (
    RESULTS_CSV,
    results_key,
    write_results,
)
from comfy_assets.render.run import run_batch_sync
from comfy_assets.render.steering import run_priority
from comfy_assets.store import StoreUnavailable
from comfy_assets.store.files.local import file_copy, file_location

# The store file key of every partition's results in one table.
ALL_RESULTS_CSV = "all_results.csv"
# Who answers for these assets in the UI (Dagster owners: an e-mail or "team:<name>").
OWNERS = ["team:render"]
# The pictures shown in the UI are shrunk to fit this box: metadata lives in the event log.
CONTACT_SHEET_PX = 480
# A render stopped because no server was reachable is tried again this much later.
NO_SERVER_RETRY_WAIT_S = 60
# A running render logs how far it has come at most this often (and when it ends).
PROGRESS_LOG_S = 5.0


def _partition_check(
    name: str,
    asset: AssetKey,
    description: str,
    partitions_def: DynamicPartitionsDefinition,
    **kwargs: Any,
) -> AssetCheckSpec:
    """A check recorded per partition of the asset (shown on the partition in the UI)."""
    # Dagster 1.13 marks partitions_def on a check as preview and warns on every import.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreviewWarning)
        return AssetCheckSpec(
            name,
            asset=asset,
            partitions_def=partitions_def,
            description=description,
            **kwargs,
        )


def render_partition(
    context: AssetExecutionContext,
    farm: Farm,
    comfy: ComfyPoolResource,
    result_store: ResultStoreResource,
) -> Iterator[MaterializeResult]:
    """Render the partition's job file; yield its job table, counts and checks (nothing for
    a partition that names no job file)."""
    # Dead letters: the batch runs to its end, then the asset materializes with the check
    # no_dead_letters failed (severity ERROR). It does not raise: Dagster cannot fail a step
    # and record its materialization, and raising would skip render_results, losing the
    # CSV rows of the jobs that did render. A storyboard stopped by its delivery policy
    # fails all_jobs_done too. A cancel from the UI ends CANCELED: the batch interrupts our
    # prompts, releases its claims and server leases, and re-raises. A missing or invalid
    # job file fails the run without retries.
    partition = context.partition_key
    if job_file_missing(context, partition, farm):
        return
    store = result_store.open()
    try:
        job_file = scan_requested_file(context, partition, farm, store.file_store)
    except BaseException:
        store.close()
        raise
    job_ids = file_job_ids(job_file)

    sheet: OutputsSheet | None = None
    try:
        summary = run_batch_sync(
            job_file,
            partition=partition,
            servers=comfy.server_specs(),
            store=store,
            config=comfy.batch_config(),
            # The run's owner row names it: a run whose owner is gone has died (dead_runs.py).
            run_id=context.run_id,
            on_line=context.log.info,
            on_progress=log_every(context.log.info, PROGRESS_LOG_S),
            # The run queue's order is the pool's too (docs/steering.md).
            priority=run_priority(context.run.tags),
        )
        # The store read a page at a time: what is held and shown does not grow with
        # the partition (partition_view.py).
        view = read_view(store, partition, job_ids, summary.counts)
        health = store.server_health()
        try:
            sheet = outputs_contact_sheet(
                store, partition, view.sheet, view.outputs, view.output_jobs
            )
        except MediaError as exc:
            context.log.warning(f"no contact sheet of the outputs: {exc}")
    except StoreUnavailable as e:
        # The batch stopped and removed its prompts; Dagster tries the step again later.
        raise RetryRequested(
            max_retries=comfy.no_server_retries, seconds_to_wait=NO_SERVER_RETRY_WAIT_S
        ) from e
    finally:
        store.close()

    done = view.done
    dead = summary.dead_lettered  # of the file's jobs only
    files = store.file_store
    where = file_location(files, results_key(partition), resolved=True)
    for line in dead_letter_lines(summary.dead_letters, dead, where):
        context.log.error(line)
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
    # The UI's view of the rows results.csv writes (render_results): all of them, or
    # the dead letters and failures first and a sample (view.shown_line).
    jobs = job_frame(view.rows)
    metadata: Metadata = {}
    if sheet is not None:
        # First, so the pictures are at the top of the asset's page.
        metadata["contact_sheet"] = MetadataValue.md(
            stored_picture(
                files,
                sheet.key,
                f"{partition}: {sheet.caption()}",
                CONTACT_SHEET_PX,
                result_store.media_url,
            )
        )
        metadata["pictures"] = (
            f"{sheet.caption()}, each labelled with its shot and job, or job and file name"
        )
    metadata |= {
        "job_file": MetadataValue.path(str(job_file.path.resolve())),
        "job_file_sha256": job_file.sha256,
        "jobs": len(job_ids),
        "done": done,
        "dead_lettered": dead,
        "counts": MetadataValue.json(counts),
        "gpu_seconds": MetadataValue.float(float(summary.gpu_seconds)),
        "seconds": MetadataValue.float(float(summary.seconds)),
        # Where the partition's files are: its folder, or its objects' prefix.
        "store": MetadataValue.path(file_location(files, partition, resolved=True)),
        "job_table": job_table(jobs),  # the full ids and cells are in results.csv
        **servers_metadata([s.name for s in comfy.server_specs()], view.done_by_server, health),
    }
    if view.cut():
        metadata["job_table_shown"] = view.shown_line(where)
    if view.model_cost.tries:  # what loading models cost, per server (none loaded: nothing)
        metadata.update(model_load_metadata(view.model_cost.cost()))
    if sheet is not None:
        metadata["contact_sheet_path"] = MetadataValue.path(
            file_location(files, sheet.key, resolved=True)
        )
    if summary.stopped:
        metadata["stopped"] = summary.stopped
    dead_frame = jobs[jobs["state"] == "failed_fatal"][["job", "reason", "job_id"]]
    yield MaterializeResult(
        # What the film and the results are made of: a render that changed nothing (a
        # backfill) keeps it, and nothing downstream is built again for it.
        data_version=DataVersion(view.data_version),
        metadata=metadata,
        check_results=[
            AssetCheckResult(
                check_name="no_dead_letters",
                passed=not dead,
                severity=AssetCheckSeverity.ERROR,
                # No numbers: the check's plot would draw every partition's as one series.
                metadata={
                    "partition": partition,
                    "dead_letters": table(dead_frame, column_schema(dead_frame, JOB_COLUMNS)),
                },
                description=f"{dead} dead-lettered jobs" if dead else "no dead letters",
            ),
            AssetCheckResult(
                check_name="all_jobs_done",
                passed=done == len(job_ids),
                severity=AssetCheckSeverity.ERROR,
                metadata={
                    "partition": partition,
                    "done": f"{done} of {len(job_ids)} jobs",
                    "counts": MetadataValue.json(counts),
                },
                description=f"{done} of {len(job_ids)} jobs done",
            ),
        ],
    )


def write_partition_results(
    context: AssetExecutionContext, farm: Farm, result_store: ResultStoreResource
) -> MaterializeResult:
    """Write the partition's results CSV, a row per job of the job file version that
    renders rendered (the step fails if the file changed since)."""
    partition = context.partition_key
    job_file = scan_rendered_file(context, partition, farm)
    job_ids = file_job_ids(job_file)
    store = result_store.open()
    try:
        path, results = write_results(store, partition, job_ids)
    finally:
        store.close()
    context.log.info(f"wrote {len(results)} rows to {path}")
    where = file_location(store.file_store, results_key(partition), resolved=True)
    return MaterializeResult(
        metadata={**results_metadata(results, where), "job_file_sha256": job_file.sha256}
    )


def gather_results(
    context: AssetExecutionContext, farm: Farm, result_store: ResultStoreResource
) -> MaterializeResult:
    """Concatenate every partition's results CSV into the store's file all_results.csv;
    partitions without one are logged. Read and written through the store's files (in
    an object store, copies in a scratch folder)."""
    store = result_store.open()
    files = store.file_store
    store.close()  # only its files are read
    tables: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="comfy-assets-results-") as scratch:
        for partition in context.instance.get_dynamic_partitions(farm.job_files_partitions_name):
            try:
                tables[partition] = file_copy(files, results_key(partition), Path(scratch))
            except FileNotFoundError:
                context.log.warning(f"partition {partition} has no {RESULTS_CSV} yet")
        results = write_combined(files, ALL_RESULTS_CSV, tables)
    where = file_location(files, ALL_RESULTS_CSV, resolved=True)
    return MaterializeResult(
        metadata={**results_metadata(results, where), "partitions": len(tables)}
    )


def _gate_check(gate: GateResult, partition: str) -> AssetCheckResult:
    """The ``gate`` check's result: passed or not, each missing or bad shot with why (the
    check is recorded on the partition; its metadata names it too)."""
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


def cut_film(
    context: AssetExecutionContext,
    farm: Farm,
    comfy: ComfyPoolResource,
    result_store: ResultStoreResource,
) -> Iterator[AssetCheckResult | AssetObservation | MaterializeResult]:
    """Cut the partition's shots into ``<store>/<partition>/film.mp4`` (and
    ``film.contact.png``) for a job file whose jobs have ``shot`` numbers, in the version
    renders rendered (the step fails if the file changed since)."""
    # Policy: "delivery" (every shot must be rendered, decode fully and last its
    # duration_s within duration_tolerance) or "draft" (a failed, missing or broken shot
    # becomes a slate of its duration_s and the film is marked DRAFT), from the job file's
    # header line ({"header": {"policy": "draft", "duration_tolerance": 0.1}}, default
    # delivery, 0.1); the run config's comfy.policy wins over it.
    #
    # Gate: the blocking check judges every shot before anything is written. When it
    # blocks, its failed result lists each missing or bad shot and why, then the step fails
    # with Failure(allow_retries=False): no film is written and no materialization is
    # recorded (an earlier film stays as it was). Returning the failed check with a
    # MaterializeResult instead would record a materialization of a film that does not
    # exist (Dagster 1.13 records it, then fails the step). The shots are never touched.
    #
    # Metadata: the film (path, duration_s probed from it, shot_count, degraded and
    # placeholder shots, policy, draft, concat_mode), the contact sheet, and the cost
    # report of comfy_assets.render.cost over every recorded attempt of the file's jobs.
    partition = context.partition_key
    if job_file_missing(context, partition, farm):
        return
    job_file = load_rendered_file(context, partition, farm)
    if not has_shots(job_file):
        context.log.info(f"{job_file.path}: no job has a shot number; no film")
        yield AssetObservation(
            asset_key=farm.key("films"),
            partition=partition,
            description="no shots in this job file: no film",
            metadata={"status": "no shots", "job_file_sha256": job_file.sha256},
        )
        return
    try:
        film_policy(job_file, comfy.policy)
    except ValueError as exc:
        raise Failure(description=f"comfy.policy: {exc}", allow_retries=False) from exc

    store = result_store.open()
    try:
        cost = film_cost_report(store, job_file)
        film = store_film(store, partition, job_file, comfy.policy)
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
    files = store.file_store
    made = film.result

    how: str = policy.mode
    if made.gate.draft:
        slates = ", ".join(map(str, made.gate.placeholders))
        how = f"draft, slates for shots {slates}" if slates else "draft"
    context.log.info(
        f"film {file_location(files, film.film_key)}: {made.concat.clips} shots, "
        f"{made.concat.duration_s:.3f} s ({how}), concat {made.concat.mode}"
    )
    yield MaterializeResult(
        metadata={
            **film_metadata(film, cost, CONTACT_SHEET_PX, files, result_store.media_url),
            "job_file_sha256": job_file.sha256,
        },
        check_results=[_gate_check(made.gate, partition)],
    )


class FarmAssets(NamedTuple):
    """One farm's assets and checks (``build_assets``)."""

    job_files: AssetSpec
    job_files_valid: AssetChecksDefinition
    renders: AssetsDefinition
    render_results: AssetsDefinition
    all_results: AssetsDefinition
    films: AssetsDefinition


def build_assets(farm: Farm) -> FarmAssets:
    """The assets of ``farm``: its job files, renders (with the checks no_dead_letters and
    all_jobs_done), render_results, all_results and films (with the blocking check gate),
    keyed, grouped and partitioned by the farm, reading its resources ``farm.comfy_key``
    and ``farm.store_key``."""
    jobs_partitions = farm.job_files_partitions
    films_partitions = farm.storyboard_partitions
    renders_key = farm.key("renders")
    both = {farm.comfy_key, farm.store_key}

    def spec(name: str, group: str, kind: str, description: str, **kwargs: Any) -> AssetSpec:
        """One of the farm's assets, owned by OWNERS, of one kind."""
        return AssetSpec(
            farm.key(name),
            group_name=farm.group_of(group),
            owners=OWNERS,
            kinds={kind},
            description=description,
            **kwargs,
        )

    job_files = spec(
        JOB_FILES_ASSET,
        "job_files",
        "json",
        "The job files (*.jsonl) in the watched folders, one partition a file. Each "
        f"accepted version is recorded here by {farm.name('job_file_sensor')}; a bad "
        "file fails the check `valid`, every error on its own line, until it is fixed.",
        partitions_def=jobs_partitions,
    )

    @asset_check(
        asset=farm.job_files_key,
        name=JOB_FILES_CHECK,
        description="Every job file in the watched folders is valid (the sensor reports this "
        "check on each change; executing it validates every file now).",
    )
    def job_files_valid() -> AssetCheckResult:
        """Validate every job file of the watched folders now."""
        return AssetCheckResult(**job_files_check_fields(current_problems(farm.dirs())))

    @multi_asset(
        name=farm.name("renders"),
        specs=[
            spec(
                "renders",
                "renders",
                "comfyui",
                "Every job of the job file rendered on the ComfyUI pool; jobs already done "
                "with the same inputs are not rendered again. Shows the job table and a "
                "contact sheet of every output.",
                deps=[job_files],
                partitions_def=jobs_partitions,
            )
        ],
        check_specs=[
            _partition_check(
                "no_dead_letters",
                renders_key,
                "No job of the file failed for good (a dead letter).",
                jobs_partitions,
            ),
            _partition_check(
                "all_jobs_done",
                renders_key,
                "Every job of the file's current version is succeeded or degraded.",
                jobs_partitions,
            ),
        ],
        partitions_def=jobs_partitions,
        # A partition that names no job file materializes nothing and checks nothing (see
        # job_file_missing), which a subsettable asset may leave out.
        can_subset=True,
        required_resource_keys=both,
    )
    def renders(context: AssetExecutionContext) -> Iterator[MaterializeResult]:
        """Render the partition's job file (``render_partition``)."""
        yield from render_partition(
            context,
            farm,
            getattr(context.resources, farm.comfy_key),
            getattr(context.resources, farm.store_key),
        )

    # Both results tables: a CSV each, in the renders group, reading the farm's store.
    tables: dict[str, Any] = {
        "group_name": farm.group_of("renders"),
        "owners": OWNERS,
        "kinds": {"pandas", "csv"},
        "required_resource_keys": {farm.store_key},
    }

    @asset(
        key=farm.key("render_results"),
        partitions_def=jobs_partitions,
        deps=[renders_key],
        automation_condition=RENDER_RESULTS_CONDITION,
        description=(
            "The job file's results table (results.csv): a row per job with its `set` "
            "values, state, server, attempts, seconds, output files and reason."
        ),
        **tables,
    )
    def render_results(context: AssetExecutionContext) -> MaterializeResult:
        """Write the partition's results CSV (``write_partition_results``)."""
        return write_partition_results(context, farm, getattr(context.resources, farm.store_key))

    @asset(
        key=farm.key("all_results"),
        deps=[farm.key("render_results")],
        automation_condition=ALL_RESULTS_CONDITION,
        description="Every job file's results in one table (all_results.csv) with a "
        "`partition` column; built again automatically after any render.",
        **tables,
    )
    def all_results(context: AssetExecutionContext) -> MaterializeResult:
        """Concatenate every partition's results CSV (``gather_results``)."""
        return gather_results(context, farm, getattr(context.resources, farm.store_key))

    @multi_asset(
        name=farm.name("films"),
        specs=[
            spec(
                "films",
                "films",
                "video",
                "A storyboard's shots cut into one film (film.mp4, in shot order) behind the "
                "blocking check `gate`; policy delivery or draft (a bad shot becomes a "
                "slate). A partition per job file with shots, built after its renders. Shows "
                "the film, its contact sheet and what the render cost.",
                # Same keys: a storyboard's film is cut from that job file's renders.
                deps=[AssetDep(renders_key, partition_mapping=IdentityPartitionMapping())],
                partitions_def=films_partitions,
                automation_condition=FILMS_CONDITION,
            )
        ],
        check_specs=[
            _partition_check(
                "gate",
                farm.key("films"),
                "Every shot is done, decodes fully and lasts its duration_s (under draft a "
                "bad shot may be a slate); judged before the film is written.",
                films_partitions,
                blocking=True,
            )
        ],
        partitions_def=films_partitions,
        # A partition added by hand for a job file without shots has no film: neither the
        # film nor its gate is recorded (only an observation saying so; the sensor then
        # deletes the partition), which a subsettable asset may leave out.
        can_subset=True,
        required_resource_keys=both,
    )
    def films(
        context: AssetExecutionContext,
    ) -> Iterator[AssetCheckResult | AssetObservation | MaterializeResult]:
        """Cut the partition's shots into its film (``cut_film``)."""
        yield from cut_film(
            context,
            farm,
            getattr(context.resources, farm.comfy_key),
            getattr(context.resources, farm.store_key),
        )

    return FarmAssets(job_files, job_files_valid, renders, render_results, all_results, films)
