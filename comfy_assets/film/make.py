"""A partition's film from the store: its shots gated, then cut (``make_film``, to a path
of this machine; ``store_film``, into the store as ``<partition>/film.mp4``), what the
``comfy-assets film`` command and the ``films`` asset share."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from comfy_assets.film.gate import FilmResult, build_film
from comfy_assets.film.shots import film_keys, film_policy, shots_from_store
from comfy_assets.jobs.model import JobFile
from comfy_assets.store import Store
from comfy_assets.store.files.local import writing


@dataclass(frozen=True)
class StoredFilm:
    """A film written into the store: ``result`` as ``build_film`` made it (its paths are
    where it was made, gone for a store whose files are not on this disk), ``film_key``
    and ``sheet_key`` the store file keys of the film and its contact sheet."""

    result: FilmResult
    film_key: str
    sheet_key: str


def make_film(
    store: Store, partition: str, job_file: JobFile, out: Path, policy: str | None = None
) -> FilmResult:
    """Gate the shots of ``job_file`` as ``store`` has them under ``partition`` and write
    the film to ``out`` (a contact sheet beside it). ``policy`` ("delivery" or "draft")
    overrides the job file header. Shots of a store whose files are not on this disk are
    copied to a scratch folder first (the gate decodes each one whole); scratch files
    (copies, stills, slates) are removed whatever happens. Raises GateBlocked (nothing
    written), ValueError (an unknown policy), MediaError (the film could not be
    written), OSError, and what the file store raises.
    """
    chosen = film_policy(job_file, policy)
    with tempfile.TemporaryDirectory(prefix="comfy-assets-shots-") as scratch:
        shots = shots_from_store(store, partition, job_file, Path(scratch))
        # build_film creates it only once the gate has passed; it is scratch for the concat.
        work_dir = out.parent / f".film-work-{uuid.uuid4().hex[:8]}"
        try:
            return build_film(shots, chosen, out, work_dir=work_dir)
        finally:
            if work_dir.exists():
                shutil.rmtree(work_dir)


def store_film(
    store: Store, partition: str, job_file: JobFile, policy: str | None = None
) -> StoredFilm:
    """``make_film`` into the store's own files ``<partition>/film.mp4`` and
    ``<partition>/film.contact.png`` (``shots.film_keys``): made in place in a folder
    store, else made in a scratch folder and stored whole once complete (an earlier film
    stays as it was when the gate blocks or the film fails). Raises as ``make_film``."""
    files = store.file_store
    keys = film_keys(partition)
    with tempfile.TemporaryDirectory(prefix="comfy-assets-film-") as scratch:
        with writing(files, keys, Path(scratch)) as [out, _sheet]:
            result = make_film(store, partition, job_file, out, policy)
    return StoredFilm(result, *keys)
