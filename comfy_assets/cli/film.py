"""``comfy-assets film``: cut a storyboard already rendered into the store into a film,
without Dagster, behind the same gate as the ``films`` asset.

Register it in ``cli.COMMANDS`` as ``add_film_parser``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from comfy_assets.cli.options import add_command, add_input_options, bad_input
from comfy_assets.cli.run import add_store_options, open_store, store_files
from comfy_assets.film.gate import FilmResult, GateBlocked
from comfy_assets.film.make import make_film
from comfy_assets.film.probe import MediaError
from comfy_assets.film.shots import (
    bad_shot_lines,
    film_path,
    has_shots,
)
from comfy_assets.jobs.inputs import rules_of
from comfy_assets.jobs.model import POLICIES, JobFileError
from comfy_assets.jobs.parse import load_job_file

if TYPE_CHECKING:
    from comfy_assets.store import Store

EXIT_OK = 0
EXIT_BLOCKED = 1
EXIT_NOT_WRITTEN = 1


def add_film_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``film`` on the ``comfy-assets`` subparsers."""
    p = add_command(sub, "film", "cut a rendered storyboard into a film, behind the gate")
    p.add_argument("--jobs", type=Path, required=True, help="the job file (JSONL) rendered")
    add_input_options(p)
    add_store_options(p, retry=False)
    p.add_argument("--partition", default=None, help="partition name (default: file stem)")
    p.add_argument("--policy", choices=POLICIES, default=None, help="overrides the job file header")
    p.add_argument(
        "--out", type=Path, default=None, help="film path (default <store>/<partition>/film.mp4)"
    )
    p.set_defaults(func=film_command)


def film_command(args: argparse.Namespace) -> int:
    """Gate the shots of ``args.jobs`` as the store has them, then write the film.

    Prints the film's path, then a one-line summary; the contact sheet goes beside the
    film as ``<name>.contact.png``. Exit 0 when the film is written; 1 when the gate
    blocks (nothing written; one line per missing or bad shot, with why); 2 for bad
    input: an unreadable or invalid job file, a file without shots, an ``--out`` that is a
    folder, not named ``.mp4`` or whose folder can't be made, no store at ``--store``, or
    a partition holding none of the file's jobs. A film that can't be written (a full disk, a tool failing:
    MediaError, OSError) is one ``error:`` line and exit 1, nothing left at ``--out``.
    """
    files = store_files(args)
    if isinstance(files, int):
        return files
    try:
        job_file = load_job_file(args.jobs, rules=rules_of(args, files))
    except JobFileError as e:
        return bad_input(str(e))
    if not has_shots(job_file):
        return bad_input(f"{args.jobs}: no job has a shot number; there is no film to cut")
    if args.out is not None and args.out.is_dir():
        return bad_input(
            f"--out {args.out} is a folder: give the film's file name, such as {args.out / 'film.mp4'}"
        )
    if args.out is not None and args.out.suffix.lower() != ".mp4":
        return bad_input(
            f"--out {args.out}: the film is an MP4 file: give a name ending in .mp4, such as "
            f"{args.out.with_suffix('.mp4')}"
        )
    if args.out is not None:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return bad_input(f"--out {args.out}: its folder can't be made ({e.strerror or e})")
    partition = args.jobs.stem if args.partition is None else args.partition
    store = open_store(args, existing=True, file_store=files)
    if isinstance(store, int):
        return store
    try:
        registered = {record.job_id for record in store.jobs(partition)}
        if not registered & {job.id for job in job_file.jobs}:
            return bad_input(
                f"partition {partition!r} of {args.store} holds none of the jobs of "
                f"{args.jobs}: render it first (comfy-assets run), or name the partition it "
                "was rendered under with --partition"
            )
        out: Path = args.out if args.out is not None else film_path(args.store, partition)
        inside = _job_folder_of(store, partition, registered, out)
        if inside is not None:
            return bad_input(
                f"--out {args.out} is inside the folder of job {inside}, where its rendered "
                "files are: give a path outside the jobs' folders"
            )
        film = make_film(store, partition, job_file, out, args.policy)
    except GateBlocked as blocked:
        print(blocked.result.describe().splitlines()[0])
        for line in bad_shot_lines(blocked.result):
            print(f"  {line}")
        return EXIT_BLOCKED
    except (MediaError, OSError) as e:
        print(f"error: the film was not written: {e}", file=sys.stderr)
        return EXIT_NOT_WRITTEN
    finally:
        store.close()
    print(film.concat.path)
    print(summary_line(film))
    return EXIT_OK


def summary_line(film: FilmResult) -> str:
    """``film: 6 shots, 7.750 s, delivery, concat copy``; a draft names its degraded shots."""
    if film.gate.draft:
        kind = f"DRAFT (degraded shots {', '.join(map(str, film.gate.degraded))}"
        if film.gate.placeholders:
            kind += f"; slates for shots {', '.join(map(str, film.gate.placeholders))}"
        kind += ")"
    else:
        kind = film.gate.mode
    return f"film: {film.concat.clips} shots, {film.concat.duration_s:.3f} s, {kind}, concat {film.concat.mode}"


def _job_folder_of(store: Store, partition: str, job_ids: set[str], out: Path) -> str | None:
    """The job of ``job_ids`` whose folder in ``store`` (``<root>/<partition>/<job id>/``)
    holds ``out`` (links followed), or None: a film written there could replace a shot it
    is cut from."""
    folders = (store.root / partition).resolve()
    target = out.resolve()
    if not target.is_relative_to(folders):
        return None
    parts = target.relative_to(folders).parts
    return parts[0] if parts and parts[0] in job_ids else None
