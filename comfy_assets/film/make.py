"""A partition's film from the store: its shots gated, then cut (``make_film``), the one
function the ``comfy-assets film`` command and the ``films`` asset share."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from comfy_assets.film.gate import FilmResult, build_film
from comfy_assets.film.shots import film_policy, shots_from_store
from comfy_assets.jobs.model import JobFile
from comfy_assets.store import Store


def make_film(
    store: Store, partition: str, job_file: JobFile, out: Path, policy: str | None = None
) -> FilmResult:
    """Gate the shots of ``job_file`` as ``store`` has them under ``partition`` and write
    the film to ``out`` (a contact sheet beside it). ``policy`` ("delivery" or "draft")
    overrides the job file's header. Scratch files (stills, slates) live beside ``out``
    until the concat and are removed whatever happens. Raises GateBlocked (nothing
    written), ValueError (an unknown policy), MediaError (the film could not be written).
    """
    chosen = film_policy(job_file, policy)
    shots = shots_from_store(store, partition, job_file)
    # build_film creates it only once the gate has passed; it is scratch for the concat.
    work_dir = out.parent / f".film-work-{uuid.uuid4().hex[:8]}"
    try:
        return build_film(shots, chosen, out, work_dir=work_dir)
    finally:
        if work_dir.exists():
            shutil.rmtree(work_dir)
