"""What must hold after every schedule, checked from the store, the fakes' own records,
the runs' output and results.csv.

``violations(played)`` returns one line per broken invariant (empty: all hold):

- no Python traceback in any run's stdout or stderr (nor from the worker or the harness),
  and every run ended by itself within the harness's timeout;
- every line a run prints and every reason and event detail in the store reads as words:
  no Python repr of an object (``REPR``: ``<Name(...``, ``<Name: ...``, ``object at 0x``),
  and is at most ``BOUND`` characters (a hostile job's huge value is quoted cut);
- the worker's hostile message (``Schedule.hostile``) is dead-lettered once, as invalid,
  naming its ``set`` field and the character (``HOSTILE_REASON``);
- every job ends done (its files in the store, their sha256 the one recorded and the one
  of the server's file by that name) or dead-lettered with a reason that names the fault
  (``FAULT_REASON``);
- a job's prompt succeeds at most once per store, unless the job's events say why
  (``EXCUSED``: the server forgot the run, its outputs were gone, the catch-up could not
  reach the server);
- never two of our prompts at once on one server: no prompt of ours is posted (the fake's
  ``posted`` time of a run) while another of ours is queued or executing there (a `late`
  prompt executes until its last message, execution_success or execution_error, before
  its history);
- nothing of ours queued or running on any server at the end, and every server idle;
- ``<store>/<partition>/results.csv`` has one row per job, in file order, with its state;
- every POST of a job with inputs (the fake's ``posts``) comes after that server took an
  upload of each input under its content-derived name (``comfy_assets/<sha256><suffix>``
  of the picture's bytes, or of the upstream job's file its done record names): the
  fake's ``uploaded`` first time; the server keeps its input folder across restarts;
- a chained job is never posted before each job it continues from is done: its first
  POST in a phase comes after the upstream's first ``succeeded`` event in that store;
- each run that was not killed or stopped exits 0 when every job of its file is done, 1
  otherwise; a run stopped by SIGTERM exits 143 (or as it would have, had it ended
  first), and every prompt of ours left on a server after it is one its output says it
  could not remove.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
from pathlib import Path
from typing import Any

from comfy_assets.jobs.model import INPUT_SUBFOLDER, InputFile, Job, JobFile
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.states import DONE, FAILED_FATAL
from comfy_assets.store import Store
from tests.campaign.play import Phase, Played

TRACEBACK = "Traceback (most recent call last)"
# A dead letter's reason names what went wrong: ComfyUI's own error, the HTTP status, or
# what the runner saw (lost, deadline, socket, missing outputs).
FAULT_REASON = re.compile(
    r"prompt_outputs_failed_validation|IndexError|OutOfMemory|node_errors|outputs missing"
    r"|outputs dropped"
    r"|\b404\b|\b500\b|\b400\b|lost|deadline|interrupted|socket|connect|disconnect"
    r"|unreachable|timed out|timeout|partial|not executed|Internal Server Error"
    r"|no server has|CUDA|No space left|infrastructure|failed on|File name too long",
    re.IGNORECASE,
)
# The most characters a reason, an event's detail or a printed line may have: a value a
# failure quotes (a hostile job's huge file name) is cut to a few hundred.
BOUND = 2_000
# An object's repr where a reason should be: what a person reads is the class's guts.
REPR = re.compile(r"<[A-Z]\w*[(:]|\bobject at 0x[0-9a-f]+")
# The extension an uploaded input keeps (data/recorded/upload.json: the server keeps a
# name's extension; a plain one only, so a name is never a path).
PLAIN_SUFFIX = re.compile(r"\.[a-z0-9]{1,8}")
# A hostile message's dead letter: refused as invalid, its field and character named.
HOSTILE_REASON = re.compile(
    r"^invalid job: .*: set\.\S+: holds (a NUL character|a lone UTF-16 surrogate)"
)
EXCUSED = re.compile(r"may render twice|outputs missing|prompt lost")


def violations(played: Played) -> list[str]:
    """Every broken invariant of ``played``, one line each (see the module docstring)."""
    found: list[str] = [f"harness: {e}" for e in played.errors]
    for phase in played.phases:
        found += _runs(phase)
        found += _jobs(played, phase)
    found += _one_at_a_time(played)
    for server, left in played.ours_left.items():
        if left:
            found.append(f"{server}: our prompts still queued or running at the end: {left}")
    for server, why in played.not_idle.items():
        found.append(f"{server}: not idle at the end: {why}")
    return found


def _runs(phase: Phase) -> list[str]:
    found = []
    for i, run in enumerate(phase.runs):
        who = f"{phase.store.name} run {i + 1}"
        for name, text in (("stdout", run.stdout), ("stderr", run.stderr)):
            if TRACEBACK in text:
                # Its end names the exception: keep that when the traceback is long.
                trace = text[text.index(TRACEBACK) :]
                shown = trace if len(trace) <= 4000 else f"{trace[:1000]}\n...\n{trace[-3000:]}"
                found.append(f"{who}: traceback on {name}: {shown}")
            found += [f"{who}: a repr on {name}: {line}" for line in _reprs(text.splitlines())]
            found += [
                f"{who}: a line of {len(line)} characters on {name}: {line[:300]}"
                for line in text.splitlines()
                if len(line) > BOUND
            ]
        if run.timed_out:
            tail = "\n".join(run.stderr.splitlines()[-40:])
            found.append(
                f"{who}: did not end within the harness's timeout; its stderr ended:\n{tail}"
            )
        if run.stopped and run.returncode not in (0, 1, 143):
            found.append(f"{who}: stopped by SIGTERM, exit {run.returncode}, expected 143")
        for server, left in phase.left_after_stop.items():
            for prompt_id in left:
                if (
                    run.stopped
                    and f"could not remove prompt {prompt_id}" not in run.stdout + run.stderr
                ):
                    found.append(
                        f"{who}: stopped by SIGTERM, our prompt {prompt_id} still on {server}, "
                        "and no line says it could not be removed"
                    )
    return found


def _reprs(lines: list[str]) -> list[str]:
    """The lines of ``lines`` with an object's repr in them (``REPR``), each cut to 300."""
    return [line[:300] for line in lines if REPR.search(line)]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _jobs(played: Played, phase: Phase) -> list[str]:
    found: list[str] = []
    store = Store(phase.store)  # its records (an object store's outputs: ``phase.stored``)
    try:
        for jobs_path in phase.job_files:
            job_file = load_job_file(jobs_path)
            partition = jobs_path.stem
            all_done = True
            for job in job_file.jobs:
                who = f"{phase.store.name} job {job.id}"
                record = store.get(job.id)
                if record is None:
                    found.append(f"{who}: not in the store")
                    all_done = False
                    continue
                if record.state in DONE:
                    found += _files(store, phase, partition, job.id, record.server, who)
                elif record.state == FAILED_FATAL:
                    all_done = False
                    if not FAULT_REASON.search(record.reason or ""):
                        found.append(f"{who}: dead letter names no fault: {record.reason!r}")
                elif not _left_for_quarantine(phase, job.id):
                    all_done = False
                    found.append(f"{who}: ended {record.state}, neither done nor a dead letter")
                else:
                    all_done = False  # every server able to run it quarantined: left pending
                details = [e.detail or "" for e in store.events(job.id)]
                found += [
                    f"{who}: a repr in its reason or events: {line}"
                    for line in _reprs([record.reason or "", *details])
                ]
                found += [
                    f"{who}: a reason or event of {len(text)} characters: {text[:300]}"
                    for text in [record.reason or "", *details]
                    if len(text) > BOUND
                ]
                successes = _successes(played, phase, job.prompt_id)
                if successes > 1 and not any(EXCUSED.search(d) for d in details):
                    found.append(
                        f"{who}: prompt {job.prompt_id} succeeded {successes} times, no event "
                        f"says why; events: {details}"
                    )
            found += _results_csv(store, phase, partition, [j.id for j in job_file.jobs])
            found += _inputs_before_posts(played, phase, store, jobs_path, job_file)
            found += _upstream_done_before_posts(played, phase, store, job_file)
            for i, run in enumerate(phase.runs):
                if run.killed or run.stopped or run.args == ["worker"] or run.jobs != jobs_path:
                    continue
                expected = 0 if all_done else 1
                if run.returncode != expected:
                    found.append(
                        f"{phase.store.name} run {i + 1}: exit {run.returncode}, expected "
                        f"{expected} (all done: {all_done})"
                    )
        if phase.worker is not None:
            w = phase.worker
            if w["acked"] != w["messages"]:
                found.append(f"worker: {w['acked']} of {w['messages']} messages acked: {w}")
            if played.schedule.hostile and not (
                len(w["hostile"]) == 1 and HOSTILE_REASON.search(w["hostile"][0])
            ):
                found.append(f"worker: the hostile message not dead-lettered as invalid: {w}")
    finally:
        store.close()
    return found


def _left_for_quarantine(phase: Phase, job_id: str) -> bool:
    """Whether a run of ``phase`` that did not end by a signal said it left ``job_id``
    pending because every server that can run it is quarantined (or stopped with none
    usable)."""
    ended = [r for r in phase.runs if not r.killed and not r.stopped]
    return any(
        f"job {job_id}: not run, every server that can run it is quarantined" in out
        or "no server usable" in out
        for out in (r.stdout + r.stderr for r in ended)
    )


def _files(
    store: Store, phase: Phase, partition: str, job_id: str, server: str | None, who: str
) -> list[str]:
    found = []
    files = store.files(job_id)
    if not files:
        found.append(f"{who}: done without files")
    on_server = phase.server_bytes.get(server or "", {})
    for f in files:
        if phase.file_store is not None:  # an object store's, read before it stopped
            stored = phase.stored.get(f"{job_id}/{f.path}")
        else:
            path = store.job_dir(partition, job_id) / f.path
            stored = _sha256(path) if path.is_file() else None
        if stored is None:
            found.append(f"{who}: {f.path} missing from the store")
            continue
        if stored != f.sha256:
            found.append(f"{who}: {f.path} sha256 differs from its done record")
        if on_server.get(f.path) != f.sha256:
            found.append(
                f"{who}: {f.path} sha256 {f.sha256[:12]} is not {server}'s file "
                f"({(on_server.get(f.path) or 'absent')[:12]})"
            )
    return found


def _successes(played: Played, phase: Phase, prompt_id: str) -> int:
    """Successful runs of ``prompt_id`` on every server during ``phase``."""
    count = 0
    for i, (_, stats) in enumerate(played.stats.items()):
        for run in stats["runs"][phase.first_run[i] : phase.end_run[i]]:
            count += run["prompt_id"] == prompt_id and run["outcome"] == "success"
    return count


def _posts(played: Played, phase: Phase, prompt_id: str) -> list[tuple[str, float]]:
    """(server, time) of every POST /prompt of ``prompt_id`` during ``phase``."""
    found = []
    for i, (server, stats) in enumerate(played.stats.items()):
        for post in stats["posts"][phase.first_post[i] : phase.end_post[i]]:
            if post["prompt_id"] == prompt_id:
                found.append((server, post["time"]))
    return found


def _content_name(sha256: str, path: str) -> str:
    """The name an input is uploaded under: its bytes' sha256 and the path's extension."""
    suffix = Path(path).suffix.lower()
    return f"{INPUT_SUBFOLDER}/{sha256}{suffix if PLAIN_SUFFIX.fullmatch(suffix) else ''}"


def _input_names(store: Store, folder: Path, job: Job) -> dict[str, str]:
    """Input key -> the content-derived name the prompt's server must have before its
    POST: of the picture's bytes, or of the upstream job's file (the ``index``-th of
    its node, in path order) as its done record in ``store`` says; an upstream file not
    recorded is left out (the POST then came before the upstream was done, a violation
    of its own)."""
    names = {}
    for inp in job.inputs:
        if isinstance(inp, InputFile):
            names[inp.key] = _content_name(_sha256(folder / inp.path), inp.path)
            continue
        files = sorted(
            (f for f in store.files(inp.job) if f.node_id == inp.node), key=lambda f: f.path
        )
        if inp.index < len(files):
            f = files[inp.index]
            names[inp.key] = _content_name(f.sha256, f.path)
    return names


def _inputs_before_posts(
    played: Played, phase: Phase, store: Store, jobs_path: Path, job_file: JobFile
) -> list[str]:
    found = []
    for job in job_file.jobs:
        if not job.inputs:
            continue
        names = _input_names(store, jobs_path.parent, job)
        for server, at in _posts(played, phase, job.prompt_id):
            uploaded = played.stats[server]["uploaded"]
            for key, name in names.items():
                first = uploaded.get(name, {}).get("first")
                if first is None or first >= at:
                    when = (
                        "never uploaded"
                        if first is None
                        else f"first uploaded {first - at:.3f} s after the POST"
                    )
                    found.append(
                        f"{phase.store.name} job {job.id}: prompt {job.prompt_id} posted to "
                        f"{server} before input {key} was uploaded there as {name} ({when})"
                    )
    return found


def _upstream_done_before_posts(
    played: Played, phase: Phase, store: Store, job_file: JobFile
) -> list[str]:
    found = []
    for job in job_file.jobs:
        posts = _posts(played, phase, job.prompt_id)
        if not job.depends_on or not posts:
            continue
        server, first = min(posts, key=lambda p: p[1])
        for upstream in job.depends_on:
            done = [e.time for e in store.events(upstream) if e.to_state == "succeeded"]
            if not done or min(done) >= first:
                when = (
                    "it never succeeded"
                    if not done
                    else f"it succeeded {min(done) - first:.3f} s after the POST"
                )
                found.append(
                    f"{phase.store.name} job {job.id}: prompt {job.prompt_id} posted to "
                    f"{server} before job {upstream} it continues from was done "
                    f"({when})"
                )
    return found


def _one_at_a_time(played: Played) -> list[str]:
    found = []
    for server, stats in played.stats.items():
        busy = played.busy_clients[server]
        found += overlapping_posts(server, [r for r in stats["runs"] if r["client_id"] != busy])
    return found


def overlapping_posts(server: str, runs: list[dict[str, Any]]) -> list[str]:
    """One line per prompt of ``runs`` (a fake's records of our prompts on ``server``)
    posted while another of them was queued or running there."""
    found = []
    ours = sorted(runs, key=lambda r: r["posted"])
    for before, after in zip(ours, ours[1:], strict=False):
        end = before["end"] if before["end"] is not None else float("inf")
        if before["word"] == "late" and before["outcome"] in ("success", "error"):
            # Its last message (execution_success or execution_error) came before its
            # history: from then on it holds no GPU, only its place in /queue.
            end = before["last_message"]
        if after["posted"] < end:
            found.append(
                f"{server}: prompt {after['prompt_id']} posted while our prompt "
                f"{before['prompt_id']} was queued or running ({before['outcome']}, "
                f"{end - after['posted']:.3f} s before it ended)"
            )
    return found


def _results_csv(store: Store, phase: Phase, partition: str, job_ids: list[str]) -> list[str]:
    if phase.file_store is not None:  # an object store's, read before it stopped
        text = phase.results_csv.get(partition)
    else:
        path = phase.store / partition / "results.csv"
        text = path.read_text() if path.is_file() else None
    if text is None:
        return [f"{phase.store.name}: {partition}/results.csv missing"]
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    found = []
    if [r["job_id"] for r in rows] != job_ids:
        found.append(
            f"{phase.store.name}: results.csv rows {len(rows)} are not the {len(job_ids)} jobs"
        )
    for row in rows:
        record = store.get(row["job_id"])
        if record is not None and row["state"] != record.state:
            found.append(
                f"{phase.store.name}: results.csv says {row['job_id']} {row['state']}, "
                f"the store {record.state}"
            )
    return found
