"""Seeded, bounded random fault schedules.

``make_schedule(seed)`` is a pure function of the seed: the same seed gives the same
schedule (``Schedule.describe()`` prints it). A schedule has 1-3 fake servers, 4-8 jobs
(``JobPlan``: image jobs, jobs inverting an input picture, and jobs chained from an
earlier job's output; two of the pictures share a base name with other bytes), and:

- per server a script over the fake's whole vocabulary (``fake_comfy.script.WORDS`` and
  ``busy=N``), at most ``2 * jobs`` words;
- per server, maybe a ``FaultProxy`` in front: socket cuts at seeded times (HTTP and
  /ws), and/or ``GET /view`` answered 404 for a listed output, a few times or for good;
- maybe one sick server (of two or more): once its script is used up, every prompt
  fails there (an IndexError, a CUDA fault, a full disk, a 500, out of memory or
  node_errors: ``ServerPlan.sick``);
- maybe one server restart while one of our prompts runs, or while a download is under
  way (the fake stopped and served again on its port: queue and history forgotten);
- a mode: ``run`` (one ``comfy-assets run``), ``sigkill`` (a run killed with SIGKILL once
  some prompts ended, then a second run on the same store), ``sigterm`` (a run stopped
  with SIGTERM while one of our prompts runs, then a second run), ``concurrent`` (two runs at
  once on the shared servers and store, on one job file or two, each with a priority of
  its own now and then), ``cache_replay`` (a run,
  then the fake's output files deleted and the same file rendered into a new store: the
  cache replays names that are gone) or ``worker`` (the in-process worker fed every job
  twice: duplicate delivery; no chained jobs there, as ``enqueue`` refuses them).

The job plan and the lost answers of ``POST /upload/image`` come from a second generator
seeded by the seed, drawn after everything else: the faults of a seed are those it had
before jobs took input pictures.

About half the schedules are of text-to-image jobs over a mix of 1-3 checkpoints (one
of them, now and then, on no server: a dead letter at once, nothing posted) instead of
image jobs; each server then lists some of the checkpoints (every one on at least one
server), keeps 1-2 loaded and takes up to 50 ms to load one. Those draws come from a
random generator of their own, so the other draws of a seed stay what they were.

A quarter of the schedules of image, picture and chained jobs have a hostile job: an
image job whose ``3.filename_prefix`` is ``HUGE_CHARS`` characters long (``JobPlan``
kind ``huge``; no disk takes the file name, and ComfyUI's error quotes it), on a line no
chained job continues from. Every worker schedule gets one hostile message besides its
jobs: a ``set`` value holding a NUL or a lone UTF-16 surrogate (``Schedule.hostile``),
which the worker must dead-letter as invalid and serve on. Both from generators of
their own. A job file holding such text is refused whole before anything runs, so
``run`` schedules have no such line (tests/jobs/test_untakeable_text.py covers them).

Every worker schedule keeps its outputs in an object store (``StorePlan``: a SeaweedFS
behind ``tests/s3_fault_proxy.py``) that fails under it: down for a few seconds from the
first download, slow to answer, uploads cut halfway, writes answered 503 SlowDown; two
of those by the schedule's rank among the worker schedules (so any four consecutive ones
play every fault), others drawn from a generator of their own. (The ``comfy-assets run``
modes keep a folder store: a run writes results.csv into the store's folder.)

Bounds keep a schedule to seconds: fast prompts, small deadlines, few faults.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from fake_comfy.script import WORDS

# Input pictures of the jobs (paths relative to the job file): two share a base name and
# have other bytes, so a job given the other's picture would be seen.
PICTURES = ("pictures/a/key.png", "pictures/b/key.png", "pictures/c.png")
KINDS = ("image", "picture", "chained")
_KIND_WEIGHTS = (4, 3, 3)
MODES = ("run", "sigkill", "sigterm", "concurrent", "cache_replay", "worker")
# Words that fail a job for good (dead letter at once) are rarer, so most jobs test
# the paths that must end in a single success.
_WORD_WEIGHTS = {
    "ok": 10,
    "500": 2,
    "invalid": 1,
    "error": 1,
    "oom": 2,
    "drop": 2,
    "hang": 1,
    "slow": 2,
    "partial": 1,
    "late": 3,
    "silent": 2,
    "restart": 2,
    "busy": 1,
}
# The length of a hostile job's huge value (characters): a file name no disk takes.
HUGE_CHARS = 1024**2
# What a hostile message's ``set`` value holds: text no server or store takes.
HOSTILE_TEXT = ("\x00", "\ud800")
# The words of a sick server play as its default word (``ServerPlan.sick``), drawn apart.
SICK_WORDS = ("error", "cuda", "disk", "500", "oom", "partial")
# A wedged server (``wedge``) is played by tests/pool/test_sick_shapes.py: a campaign's server
# stays stuck for good once one prompt wedges it.
assert set(_WORD_WEIGHTS) - {"busy"} == WORDS - {"cuda", "disk", "wedge"}, (
    "every script word is played"
)


@dataclass(frozen=True)
class JobPlan:
    """One job line. kind: ``image`` (EmptyImage of its own colour, saved as ``solid``
    and ``inverted``), ``huge`` (an image job whose file name prefix is ``HUGE_CHARS``
    long: a dead letter quoting it, bounded), ``picture`` (LoadImage of ``PICTURES[picture]``, inverted, saved as
    ``img2img``) or ``chained`` (the same workflow, loading the file node ``node`` of the
    job on line ``upstream + 1`` wrote: an earlier line)."""

    kind: str = "image"
    picture: int = 0
    upstream: int = -1
    node: str = ""

    def describe(self) -> str:
        if self.kind == "huge":
            return f"huge:3.filename_prefix={HUGE_CHARS}chars"
        if self.kind == "picture":
            return f"picture:{PICTURES[self.picture]}"
        if self.kind == "chained":
            return f"chained:job{self.upstream}/node{self.node}"
        return self.kind


@dataclass(frozen=True)
class ServerPlan:
    """One fake server and what goes wrong on it.

    script: its script words. busy: prompts of another client queued at start.
    cuts: socket cuts by its proxy (0: none), each within ``cut_within_s`` of a
    connection's start. view_404: ``{filename pattern: count or None (for good)}`` and
    lose_answer: ``{"METHOD /path" prefix: count}`` for its proxy. restart: the fake is restarted once, ``restart_after_s`` after one of our
    prompts started there (``restart_at="prompt"``), or as soon as it serves its first
    ``GET /view`` (``"download"``).
    """

    script: tuple[str, ...]
    busy: int = 0
    cuts: int = 0
    cut_within_s: float = 1.0
    cut_probability: float = 0.3
    view_404: dict[str, int | None] = field(default_factory=dict)
    lose_answer: dict[str, int] = field(default_factory=dict)
    restart: bool = False
    restart_after_s: float = 0.0
    restart_at: str = "prompt"  # or "download": at the first GET /view it serves
    sick: str = ""  # its default word once the script is used up: every prompt fails
    models: tuple[str, ...] = ()  # checkpoints it lists (fake_comfy --models)
    model_load_s: float = 0.0
    resident: int = 1

    @property
    def proxied(self) -> bool:
        """Whether a FaultProxy stands in front of this server."""
        return bool(self.cuts or self.view_404 or self.lose_answer)


# The object store's faults a worker schedule plays (``StorePlan``).
STORE_FAULTS = ("down", "slow", "cut", "503")


@dataclass(frozen=True)
class StorePlan:
    """The store's files in an object store, and how it fails: down for ``down_s``
    seconds from the first ``GET /view`` a server answers (0: never), every answer
    ``delay_s`` seconds late, the first ``cuts`` writes cut after half their body, the
    first ``slowdowns`` writes answered 503 SlowDown (more than the client's 5 retries
    of one request make an attempt the store's failure)."""

    down_s: float = 0.0
    delay_s: float = 0.0
    cuts: int = 0
    slowdowns: int = 0

    def describe(self) -> str:
        return (
            f"object store: down={self.down_s:.2f}s delay={self.delay_s:.3f}s "
            f"cuts={self.cuts} slowdowns={self.slowdowns}"
        )


@dataclass(frozen=True)
class Schedule:
    """One campaign case (see the module docstring). Times in seconds."""

    seed: int
    jobs: int
    servers: tuple[ServerPlan, ...]
    mode: str
    attempts: int = 6
    kill_after_runs: int = 0  # sigkill: runs ended on the fakes before the kill
    same_file: bool = True  # concurrent: both runs on one job file
    checkpoints: tuple[str, ...] = ()  # per job, its checkpoint (text to image); () images
    prompt_seconds: float = 0.01
    timeout_s: float = 3.0
    poll_s: float = 0.1
    base_delay_s: float = 0.02
    lines: tuple[JobPlan, ...] = ()  # one per job (empty: every job an image job)
    # concurrent: each run's --priority (empty: none given)
    priorities: tuple[int, ...] = ()
    # worker: what the hostile message's set value holds ("": no such message)
    hostile: str = ""
    # worker: its outputs in an object store that fails so (None: a folder store)
    object_store: StorePlan | None = None

    @property
    def plan(self) -> tuple[JobPlan, ...]:
        """The job lines, one per job, in file order."""
        return self.lines or tuple(JobPlan() for _ in range(self.jobs))

    def describe(self) -> str:
        """A few lines that say the whole schedule (for failure messages and the bench)."""
        lines = [
            f"seed={self.seed} mode={self.mode} jobs={self.jobs} attempts={self.attempts} "
            f"kill_after_runs={self.kill_after_runs} same_file={self.same_file}"
            + (f" priorities={','.join(map(str, self.priorities))}" if self.priorities else "")
            + (f" hostile={self.hostile!a}" if self.hostile else ""),
            f"  lines: {' '.join(j.describe() for j in self.plan)}",
        ]
        if self.checkpoints:
            lines.append(f"  checkpoints per job: {','.join(self.checkpoints)}")
        if self.object_store is not None:
            lines.append(f"  {self.object_store.describe()}")
        for i, s in enumerate(self.servers):
            lines.append(
                f"  gpu{i}: script={','.join(s.script) or '-'} busy={s.busy} cuts={s.cuts} "
                f"within={s.cut_within_s:.2f}s view_404={s.view_404} lose={s.lose_answer} "
                f"restart={s.restart}@{s.restart_at}+{s.restart_after_s:.3f}s"
                + (f" sick={s.sick}" if s.sick else "")
                + (
                    f" models={','.join(s.models)} load={s.model_load_s:.3f}s resident={s.resident}"
                    if s.models
                    else ""
                )
            )
        return "\n".join(lines)


def _word(rng: random.Random) -> str:
    names = list(_WORD_WEIGHTS)
    word = rng.choices(names, weights=[_WORD_WEIGHTS[n] for n in names])[0]
    return f"busy={rng.randint(1, 2)}" if word == "busy" else word


def _view_404(rng: random.Random, jobs: int) -> dict[str, int | None]:
    roll = rng.random()
    if roll < 0.5:
        return {"*": rng.randint(1, 3)}  # the first few downloads, whatever the file
    if roll < 0.85:
        # One output for good: its job renders anew under a new name, or ends a dead
        # letter naming the 404.
        return {f"solid_{rng.randint(1, jobs):05d}_.png": None}
    # Every inverted image for good: every image job a dead letter, and every job chained
    # from one not rendered.
    return {"inverted_*": None}


def _plan(rng: random.Random, jobs: int, mode: str) -> tuple[JobPlan, ...]:
    """The job lines: image jobs, picture jobs and (but for the worker) jobs chained from
    an earlier line."""
    lines: list[JobPlan] = []
    for i in range(jobs):
        kinds = KINDS if i and mode != "worker" else KINDS[:2]
        kind = rng.choices(kinds, weights=_KIND_WEIGHTS[: len(kinds)])[0]
        if kind == "picture":
            lines.append(JobPlan("picture", picture=rng.randrange(len(PICTURES))))
        elif kind == "chained":
            up = rng.randrange(i)
            node = rng.choice(("3", "4")) if lines[up].kind == "image" else "3"
            lines.append(JobPlan("chained", upstream=up, node=node))
        else:
            lines.append(JobPlan())
    return tuple(lines)


def make_schedule(seed: int) -> Schedule:
    """The schedule of ``seed`` (deterministic)."""
    rng = random.Random(seed)
    jobs = rng.randint(4, 8)
    mode = MODES[seed % len(MODES)]  # any len(MODES) consecutive seeds play every mode
    servers = []
    for _ in range(rng.randint(1, 3)):
        script = tuple(_word(rng) for _ in range(rng.randint(0, 2 * jobs)))
        cuts = rng.randint(1, 3) if rng.random() < 0.35 else 0
        view = _view_404(rng, jobs) if rng.random() < 0.25 else {}
        restart = rng.random() < 0.2
        lose: dict[str, int] = {}
        if rng.random() < 0.3:
            for route in ("POST /prompt", "GET /view", "GET /history", "GET /queue"):
                if rng.random() < 0.5:
                    lose[route] = rng.randint(1, 2)
        servers.append(
            ServerPlan(
                script=script,
                busy=rng.randint(1, 2) if rng.random() < 0.15 else 0,
                cuts=cuts,
                cut_within_s=rng.uniform(0.05, 1.5),
                cut_probability=rng.uniform(0.2, 0.6),
                view_404=view,
                lose_answer=lose,
                restart=restart,
                restart_after_s=rng.uniform(0.0, 0.03),
                restart_at=rng.choice(("prompt", "download")),
            )
        )
    more = random.Random(f"inputs:{seed}")
    lines = _plan(more, jobs, mode)
    for i, plan in enumerate(servers):
        if any(j.kind != "image" for j in lines) and more.random() < 0.2:
            lose = {**plan.lose_answer, "POST /upload/image": more.randint(1, 2)}
            servers[i] = replace(plan, lose_answer=lose)
    schedule = Schedule(
        seed=seed,
        jobs=jobs,
        servers=tuple(servers),
        mode=mode,
        attempts=rng.randint(4, 6),
        kill_after_runs=rng.randint(0, jobs),
        same_file=rng.random() < 0.5,
        lines=lines,
    )
    schedule = _with_models(schedule, random.Random(f"models{seed}"))
    schedule = _with_sick(schedule, random.Random(f"sick:{seed}"))
    schedule = _with_priorities(schedule, random.Random(f"priorities:{seed}"))
    schedule = _with_hostile(schedule, random.Random(f"hostile:{seed}"))
    return _with_object_store(schedule, random.Random(f"s3:{seed}"))


def _with_object_store(schedule: Schedule, rng: random.Random) -> Schedule:
    """A worker schedule's object store and its faults (``StorePlan``): the two of
    ``STORE_FAULTS`` its rank among the worker schedules names, and each other one with
    a chance of a quarter, from a generator of its own."""
    if schedule.mode != "worker":
        return schedule
    rank = schedule.seed // len(MODES)
    n = len(STORE_FAULTS)
    faults = {STORE_FAULTS[rank % n], STORE_FAULTS[(rank + 1) % n]}
    faults |= {f for f in STORE_FAULTS if rng.random() < 0.25}
    plan = StorePlan(
        down_s=rng.uniform(0.5, 8.0) if "down" in faults else 0.0,
        delay_s=rng.uniform(0.02, 0.3) if "slow" in faults else 0.0,
        cuts=rng.randint(1, 3) if "cut" in faults else 0,
        slowdowns=rng.randint(1, 8) if "503" in faults else 0,
    )
    return replace(schedule, object_store=plan)


def _with_hostile(schedule: Schedule, rng: random.Random) -> Schedule:
    """A quarter of the schedules with job lines: one image line no chained line
    continues from made ``huge``; every worker schedule: a hostile message (see the
    module docstring), from a generator of its own."""
    if schedule.mode == "worker":
        schedule = replace(schedule, hostile=rng.choice(HOSTILE_TEXT))
    if not schedule.lines or rng.random() >= 1 / 4:
        return schedule
    upstreams = {j.upstream for j in schedule.lines if j.kind == "chained"}
    free = [i for i, j in enumerate(schedule.lines) if j.kind == "image" and i not in upstreams]
    if not free:
        return schedule
    lines = list(schedule.lines)
    lines[rng.choice(free)] = JobPlan("huge")
    return replace(schedule, lines=tuple(lines))


def _with_priorities(schedule: Schedule, rng: random.Random) -> Schedule:
    """Two of three concurrent schedules: each run its own ``--priority`` (equal now and
    then), from a generator of its own."""
    if schedule.mode != "concurrent" or rng.random() >= 2 / 3:
        return schedule
    return replace(schedule, priorities=(rng.choice((0, 5, 10)), rng.choice((0, -3, 5))))


def _with_sick(schedule: Schedule, rng: random.Random) -> Schedule:
    """Two thirds of the schedules with two or more servers: one of them sick, failing
    every prompt once its script is used up (``SICK_WORDS``), from a generator of its
    own, so the other draws of a seed stay as they were."""
    if len(schedule.servers) < 2 or rng.random() >= 2 / 3:
        return schedule
    servers = list(schedule.servers)
    i = rng.randrange(len(servers))
    # By the seed, not drawn: the few sick schedules of the CI seeds play every word.
    servers[i] = replace(servers[i], sick=SICK_WORDS[schedule.seed % len(SICK_WORDS)])
    return replace(schedule, servers=tuple(servers))


def _with_models(schedule: Schedule, rng: random.Random) -> Schedule:
    """Half the schedules (every other run of the modes, so each mode has both):
    text-to-image jobs over a mix of checkpoints, the
    servers' lists, load times and resident counts (see the module docstring)."""
    if (schedule.seed // len(MODES)) % 2 == 0:
        return schedule  # every other run of the modes: the pictures and chains of the plan
    names = [f"ckpt{i}.safetensors" for i in range(rng.randint(1, 3))]
    servers = []
    for plan in schedule.servers:
        listed = tuple(n for n in names if rng.random() < 0.6)
        servers.append(
            replace(
                plan,
                models=listed,
                model_load_s=rng.uniform(0.0, 0.05),
                resident=rng.randint(1, 2),
                view_404={_output(k): v for k, v in plan.view_404.items()},
            )
        )
    for name in names:  # every checkpoint on some server
        if not any(name in p.models for p in servers):
            i = rng.randrange(len(servers))
            servers[i] = replace(servers[i], models=(*servers[i].models, name))
    unlisted = ["nowhere.safetensors"] if rng.random() < 0.2 else []
    checkpoints = tuple(rng.choice(names + unlisted) for _ in range(schedule.jobs))
    # Text-to-image jobs only: the job lines' pictures and chains are the other half's.
    return replace(schedule, servers=tuple(servers), checkpoints=checkpoints, lines=())


def _output(pattern: str) -> str:
    """An image job's output name pattern as a text-to-image job's (``ComfyUI_*``)."""
    if pattern.startswith("solid_"):
        return "ComfyUI_" + pattern.removeprefix("solid_")
    return "ComfyUI_*" if pattern == "inverted_*" else pattern
