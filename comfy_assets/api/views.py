"""The JSON the API answers with: a job, its events, its files. Times are UTC ISO 8601
with milliseconds (as ``comfy-assets events`` prints them), links relative to the API's
root."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from comfy_assets.jobs.events import Event
from comfy_assets.jobs.states import FAILED_FATAL, IN_FLIGHT, PENDING
from comfy_assets.store import AttemptRecord, FileRecord, JobRecord
from comfy_assets.store.api_jobs import ApiJob
from comfy_assets.store.files.folder import content_type


def iso(t: float | None) -> str | None:
    """Epoch seconds as ``2026-12-02T19:05:11.768+00:00``; None stays None."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def job_path(job_id: str) -> str:
    return f"/v1/jobs/{job_id}"


def file_url(job_id: str, name: str) -> str:
    return f"{job_path(job_id)}/files/{quote(name, safe='/')}"


def current_files(record: JobRecord | None, files: list[FileRecord]) -> list[FileRecord]:
    """The files of the job's current prompt (its take and inputs), by path."""
    if record is None:
        return []
    return [f for f in files if f.prompt_id == record.prompt_id]


def job_view(
    api: ApiJob,
    record: JobRecord | None,
    files: list[FileRecord],
    attempts: list[AttemptRecord],
) -> dict[str, Any]:
    """A job as ``GET /v1/jobs/{id}`` answers it. A job whose store row is not written
    yet (the API died between its two writes; the worker writes it) is pending."""
    path = job_path(api.job_id)
    servers: list[str] = []
    for attempt in attempts:
        if attempt.server is not None and attempt.server not in servers:
            servers.append(attempt.server)
    if record is not None and record.server is not None and record.server not in servers:
        servers.append(record.server)
    state = record.state if record is not None else PENDING
    tries = 0
    if record is not None:
        # The attempt under way counts too: its row is written when it ends.
        tries = record.attempts_before + record.attempts + (state in IN_FLIGHT)
    return {
        "id": api.job_id,
        "state": str(state),
        "take": record.take if record is not None else api.content.get("take", 1),
        "attempts": tries,
        "servers": servers,
        "reason": record.reason if record is not None and state == FAILED_FATAL else None,
        "created_at": iso(api.created_at),
        "updated_at": iso(record.updated_at if record is not None else api.created_at),
        "finished_at": iso(record.finished_at if record is not None else None),
        "webhook": api.webhook,
        "files": [
            {
                "name": f.path,
                "bytes": f.bytes,
                "sha256": f.sha256,
                "content_type": f.content_type or content_type(f.path),
                "url": file_url(api.job_id, f.path),
            }
            for f in current_files(record, files)
        ],
        "links": {
            "self": path,
            "events": f"{path}/events",
            "cancel": f"{path}/cancel",
            "requeue": f"{path}/requeue",
        },
    }


def event_view(event: Event) -> dict[str, Any]:
    """One transition: ``{"id", "time", "from", "to", "server", "attempt", "detail"}``
    (``from`` None for the first; ``from == to`` for a note, a webhook attempt say)."""
    return {
        "id": event.id,
        "time": iso(event.time),
        "from": event.from_state,
        "to": event.to_state,
        "server": event.server,
        "attempt": event.attempt,
        "detail": event.detail,
    }
