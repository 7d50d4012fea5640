"""From the result store to a film: the shots of a job file, its policy, its attempt costs.

Shared by the ``films`` asset and ``comfy-assets film`` so both judge a storyboard the
same way. No Dagster here: the store is read, nothing is written.

The job file is the truth about what the film should be (which jobs are shots, their
numbers, lengths and optional flags); the store says what became of each job. A job the
store does not have under the partition, or has with other inputs (another prompt_id), is
taken as ``pending``: it has yet to be rendered, so the gate cannot pass it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from comfy_assets.film.gate import GateResult, Policy, Shot, pick_file
from comfy_assets.jobs.model import JobFile
from comfy_assets.jobs.states import DONE
from comfy_assets.render.cost import AttemptCost, cost_report
from comfy_assets.store import AttemptRecord, JobRecord, Store
from comfy_assets.store.files.local import output_copy

FILM_NAME = "film.mp4"
FILM_SHEET_NAME = "film.contact.png"  # beside the film: gate.build_film names it so
NOT_RENDERED = "pending"


def film_path(root: Path, partition: str) -> Path:
    """Where a partition's film is written: ``<store>/<partition>/film.mp4`` (its contact
    sheet goes beside it as ``film.contact.png``)."""
    return Path(root) / partition / FILM_NAME


def film_keys(partition: str) -> tuple[str, str]:
    """The store file keys of a partition's film and its contact sheet:
    ``<partition>/film.mp4``, ``<partition>/film.contact.png``."""
    return f"{partition}/{FILM_NAME}", f"{partition}/{FILM_SHEET_NAME}"


def has_shots(job_file: JobFile) -> bool:
    """True when some job of the file has a ``shot`` number (the file is a storyboard)."""
    return any(job.shot is not None for job in job_file.jobs)


def film_policy(job_file: JobFile, override: str | None = None) -> Policy:
    """The film policy: ``override`` (the run config's ``policy``) if given, else the job
    file header's; the duration tolerance always comes from the header.

    Raises ValueError for a mode other than "delivery" or "draft".
    """
    mode = override or job_file.header.policy
    return Policy(mode=mode, duration_tolerance=job_file.header.duration_tolerance)  # type: ignore[arg-type]


def shots_from_store(
    store: Store, partition: str, job_file: JobFile, scratch: Path | None = None
) -> list[Shot]:
    """One ``Shot`` per job of ``job_file`` that has a shot number, in line order.

    ``shot``, ``duration_s`` and ``optional`` come from the job file; ``state``, ``reason``
    and ``files`` from the store's record of the job under ``partition``: in a folder
    store every output where it is (``<store>/<partition>/<job id>/<path>``); in an object
    store only the one the gate reads (``gate.pick_file``) of a done job, copied to
    ``<scratch>/<job id>/<path>`` (an object gone from the store is a path where nothing
    is, which the gate calls missing). Files recorded for another prompt_id than the
    job's current one are left out, so a render of old inputs never stands in for the
    shot. A job missing from the partition, or recorded with other inputs, is "pending".
    Raises ValueError for an object store without ``scratch``, OSError, and what the
    file store raises.
    """
    records = {record.job_id: record for record in store.jobs(partition)}
    shots = []
    for job in job_file.jobs:
        if job.shot is None:
            continue
        record = records.get(job.id)
        state, reason, files = _what_became_of(store, partition, job.prompt_id, record, scratch)
        shots.append(
            Shot(
                shot=job.shot,
                job_id=job.id,
                state=state,
                files=files,
                duration_s=job.duration_s,
                optional=job.optional,
                reason=reason,
            )
        )
    return shots


def _what_became_of(
    store: Store, partition: str, prompt_id: str, record: JobRecord | None, scratch: Path | None
) -> tuple[str, str | None, list[Path]]:
    """(state, reason, files) of one job as the store has it for these inputs."""
    if record is None:
        return NOT_RENDERED, f"not in the store under partition {partition!r}", []
    if record.prompt_id != prompt_id:
        return NOT_RENDERED, "its inputs changed since it was rendered", []
    current = [f for f in store.files(record.job_id) if f.prompt_id == prompt_id]
    # Only a done shot's media is read by the gate, and of it only the file it picks.
    read = pick_file([Path(f.path) for f in current]) if record.state in DONE else None
    file_store = store.file_store
    files = []
    for f in current:
        path = file_store.output_path(partition, record.job_id, f)
        if path is None and Path(f.path) == read:
            if scratch is None:
                raise ValueError(f"{file_store.location}: a film needs a scratch folder")
            try:
                path = output_copy(file_store, partition, record.job_id, f, scratch)
            except FileNotFoundError:
                path = scratch / record.job_id / f.path  # nothing there: the gate says missing
        if path is not None:
            files.append(path)
    return str(record.state), record.reason, files


def attempt_seconds(attempt: AttemptRecord) -> float:
    """GPU seconds of one attempt: the server's own run time when recorded, else the
    attempt's wall time minus its queue wait (never below zero)."""
    if attempt.gpu_seconds is not None:
        return max(0.0, attempt.gpu_seconds)
    return max(0.0, attempt.seconds - (attempt.queue_wait_s or 0.0))


def attempt_costs(store: Store, job_ids: Iterable[str]) -> list[AttemptCost]:
    """Every recorded attempt of ``job_ids`` as ``cost.AttemptCost`` (the inputs of
    ``cost.cost_report``), job by job in the order given, attempts by number.

    Seconds are GPU seconds (see ``attempt_seconds``). Empty when nothing was attempted
    (every job caught up from an earlier run, or none ran yet).
    """
    costs = []
    for job_id in job_ids:
        for attempt in store.attempts(job_id):
            costs.append(
                AttemptCost(
                    job_id=job_id,
                    seconds=attempt_seconds(attempt),
                    outcome=attempt.outcome,  # type: ignore[arg-type]  # store checks OUTCOMES
                )
            )
    return costs


def film_cost_report(store: Store, job_file: JobFile) -> dict[str, float | int | None] | None:
    """``cost.cost_report`` over every attempt of every job of ``job_file`` (the whole
    partition's GPU time, successful and wasted), ``shots`` = its number of jobs.
    None when no attempt is recorded."""
    costs = attempt_costs(store, [job.id for job in job_file.jobs])
    if not costs:
        return None
    return cost_report(costs, len(job_file.jobs))


def bad_shot_lines(gate: GateResult) -> list[str]:
    """One line per missing or bad shot (every verdict but "ok"), in shot order:
    ``shot 3 (job <id>): blocked: failed_fatal: IndexError ...``; a multi-line reason (a
    traceback) is folded onto its line."""
    return [" ".join(v.line().split()) for v in gate.verdicts if v.verdict != "ok"]
