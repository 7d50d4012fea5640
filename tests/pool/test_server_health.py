"""Error ownership across servers: a sick server is judged by how its jobs fare elsewhere,
quarantined for every process sharing the store, and never blamed for a bad workflow."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import pytest

from comfy_assets.comfy.infra import infra_cause, prompt_strings
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service.sources import MemorySource
from comfy_assets.service.worker import Worker
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.pool.test_sick_shapes import one_sick_of_three
from tests.support import (
    batch_over_fakes,
    fake_servers,
    fast_config,
    job_id,
    wait_until,
    write_jobs,
)


def prompts(fake: FakeComfy) -> int:
    """How many prompts the fake was posted (every POST /prompt it queued)."""
    return sum(p["posted"] for p in fake.stats["prompts"].values())


def executions(fake: FakeComfy) -> int:
    return sum(p["executed"] for p in fake.stats["prompts"].values())


async def run(tmp_path: Path, store: Store, fakes: list[FakeComfy], jobs: Path, **config: object):
    return await batch_over_fakes(
        load_job_file(jobs), store, *fakes, partition=jobs.stem, config=fast_config(**config)
    )


@pytest.mark.parametrize(
    ("word", "db"), [("error", "sqlite"), ("cuda", "sqlite"), ("disk", "sqlite"), ("error", "pg")]
)
async def test_a_sick_server_of_three_runs_at_most_5_prompts_of_30_and_nothing_is_dead_lettered(
    tmp_path, word, db, request
):
    sick, healthy, store, url = one_sick_of_three(tmp_path, word, db, request)
    lines: list[str] = []
    jobs = write_jobs(tmp_path / "jobs", 30, name="big.jsonl")
    summary = await batch_over_fakes(
        load_job_file(jobs),
        store,
        healthy[0],
        healthy[1],
        sick,
        partition="big",
        on_line=lines.append,
    )
    assert summary.counts.get("failed_fatal", 0) == 0
    assert summary.counts["succeeded"] == 30
    assert prompts(sick) <= 5
    assert executions(healthy[0]) + executions(healthy[1]) == 30
    health = store.server_health()["gpu2"]
    assert health.state == "quarantined"
    said = [line for line in lines if line.startswith("server gpu2 quarantined for 60 s: ")]
    assert len(said) == 1
    noted = [e.detail for e in store.events(partition="big") if e.detail == said[0]]
    assert len(noted) == 1  # the job whose attempt decided it has the line too
    named = said[0].rsplit("; jobs that failed here: ", 1)[1].split(", ")
    assert len(named) >= (3 if word == "error" else 1)
    assert set(named) <= {j for j, _, _ in health.failed_jobs}
    assert all(store.get(j).state == "succeeded" for j in named)  # rendered elsewhere
    kinds = [kind for _, server, kind, _ in store.server_events() if server == "gpu2"]
    assert kinds[:1] == ["quarantined"]

    # A second file on the same store right after (another process: a Store of its
    # own): nothing goes to gpu2 during its cool-down.
    before = prompts(sick)
    second = write_jobs(tmp_path / "jobs", 6, name="next.jsonl")
    other = Store(tmp_path / "store", url)
    summary = await batch_over_fakes(
        load_job_file(second), other, healthy[0], healthy[1], sick, partition="next"
    )
    assert summary.counts["succeeded"] == 6
    assert prompts(sick) == before


async def test_a_bad_workflow_is_learned_and_no_server_is_blamed(tmp_path):
    fakes = [FakeComfy(default_word="error", prompt_seconds=0.002) for _ in range(3)]
    store = Store(tmp_path / "store")
    jobs = write_jobs(tmp_path / "jobs", 30, name="bad.jsonl")
    summary = await run(tmp_path, store, fakes, jobs)
    assert summary.counts["failed_fatal"] == 30
    # About one attempt a job once the workflow is known to fail: never two for most.
    assert sum(prompts(f) for f in fakes) <= 30 + 6
    health = store.server_health()
    assert all(h.state == "ok" and h.failures_server == 0 for h in health.values())
    assert sum(h.failures_job for h in health.values()) >= 30
    reasons = [store.get(job_id(i, "bad.jsonl")).reason for i in range(30)]
    assert any(r.startswith("failed on gpu") and " and gpu" in r for r in reasons)
    assert any("this workflow failed so on" in r for r in reasons)
    assert all(": IndexError: index 3 is out of bounds" in r for r in reasons)


async def test_a_job_that_fails_on_the_only_server_that_can_run_it_is_a_dead_letter_at_once(
    tmp_path,
):
    fake = FakeComfy(script=["error"], prompt_seconds=0.002)
    store = Store(tmp_path / "store")
    jobs = write_jobs(tmp_path / "jobs", 1, name="one.jsonl")
    await run(tmp_path, store, [fake], jobs)
    rec = store.get(job_id(0, "one.jsonl"))
    assert rec.state == "failed_fatal"
    assert rec.reason.startswith("failed on gpu0, the only server that can run it: ")
    assert prompts(fake) == 1
    assert store.server_health()["gpu0"].failures_server == 0


async def test_an_error_on_one_server_renders_on_another_and_counts_against_the_first(tmp_path):
    first = FakeComfy(script=["error"], prompt_seconds=0.002)
    second = FakeComfy(prompt_seconds=0.002)
    store = Store(tmp_path / "store")
    jobs = write_jobs(tmp_path / "jobs", 1, name="one.jsonl")
    # Both are free: the first in configuration order, gpu0, takes the first attempt.
    summary = await run(tmp_path, store, [first, second], jobs)
    assert summary.counts["succeeded"] == 1
    assert prompts(first) == 1 and executions(first) == 1 and prompts(second) == 1
    gpu0 = store.server_health()["gpu0"]
    assert gpu0.failures_server == 1 and gpu0.strikes == 1 and gpu0.state == "ok"
    assert gpu0.failed_jobs[0][:2] == (job_id(0, "one.jsonl"), "gpu1")


async def test_a_quarantined_server_gets_one_job_after_its_cool_down_and_success_readmits_it(
    tmp_path,
):
    store = Store(tmp_path / "store")
    fake = FakeComfy(prompt_seconds=0.002)
    store.server_failed("gpu0", job_id(99), "0" * 64, "cuda", "CUDA error", infrastructure=True)
    health = store.server_health()["gpu0"]
    assert health.state == "quarantined" and health.until is not None
    # Its cool-down over (the database's clock moved past it), one job re-admits it.
    later = health.until + 1
    assert store.server_health(now=later)["gpu0"].state == "trial"
    changes = store.job_rendered("gpu0", job_id(0), now=later)
    assert [c.kind for c in changes] == ["readmitted"]
    assert store.server_health(now=later)["gpu0"].state == "ok"
    jobs = write_jobs(tmp_path / "jobs", 2, name="two.jsonl")
    summary = await run(tmp_path, store, [fake], jobs)
    assert summary.counts["succeeded"] == 2 and prompts(fake) == 2


async def test_every_server_quarantined_stops_the_batch_with_its_jobs_pending(tmp_path):
    store = Store(tmp_path / "store")
    fake = FakeComfy(prompt_seconds=0.002)
    store.server_failed("gpu0", job_id(99), "0" * 64, "disk", "disk full", infrastructure=True)
    jobs = write_jobs(tmp_path / "jobs", 2, name="two.jsonl")
    summary = await run(tmp_path, store, [fake], jobs, unreachable_timeout_s=0.2)
    assert prompts(fake) == 0
    assert summary.counts.get("pending", 0) == 2
    assert "no server usable" in (summary.stopped or "")
    assert "gpu0 quarantined until" in (summary.stopped or "")


def test_readmit_by_hand_clears_a_quarantine(tmp_path):
    store = Store(tmp_path / "store")
    store.server_failed("gpu2", job_id(1), "0" * 64, "cuda", "CUDA error", infrastructure=True)
    change = store.readmit_server("gpu2", "root@host")
    assert change is not None and change.kind == "readmitted"
    assert store.server_health()["gpu2"].state == "ok"
    assert store.readmit_server("gpu2", "root@host") is None


def test_a_quarantine_after_one_lifted_by_hand_lists_only_its_own_jobs(tmp_path):
    store = Store(tmp_path / "store")
    store.server_failed("gpu2", job_id(1), "0" * 64, "cuda", "CUDA error", infrastructure=True)
    store.readmit_server("gpu2", "root@host")

    change = store.server_failed(
        "gpu2", job_id(2), "0" * 64, "cuda", "CUDA error", infrastructure=True
    )

    assert change is not None and change.kind == "quarantined"
    assert change.detail.endswith(f"; jobs that failed here: {job_id(2)}")
    assert [job for job, _, _ in store.server_health()["gpu2"].failed_jobs] == [job_id(2)]


def test_a_quarantine_says_until_when_with_its_date_and_zone(tmp_path):
    store = Store(tmp_path / "store")
    store.server_failed(
        "gpu2", job_id(1), "0" * 64, "cuda", "CUDA error", infrastructure=True, now=1_796_000_000
    )
    record = store.server_health(now=1_796_000_001)["gpu2"]
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(record.until))
    assert record.line() == f"gpu2 quarantined until {when}: CUDA error"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+", when)


@pytest.mark.parametrize(
    ("exception_type", "message", "cause"),
    [
        (
            "torch.AcceleratorError",
            "CUDA error: an illegal memory access was encountered\n",
            "CUDA error",
        ),
        ("RuntimeError", "CUDA error: an illegal memory access was encountered", "CUDA error"),
        ("RuntimeError", "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED", "cuDNN error"),
        ("RuntimeError", "CUDA error: device-side assert triggered", "CUDA error"),
        ("OSError", "[Errno 28] No space left on device\n", "output disk full"),
        ("OSError", "[Errno 30] Read-only file system: '/out/x.png'", "output disk read-only"),
        ("PermissionError", "[Errno 13] Permission denied: '/out/x.png'", "output not writable"),
        ("ModuleNotFoundError", "No module named 'insightface'", "node pack fails to import"),
    ],
)
def test_infrastructure_errors_are_recognised(exception_type, message, cause):
    found = infra_cause(exception_type, message)
    assert found is not None and found.name == cause


@pytest.mark.parametrize(
    ("exception_type", "message"),
    [
        ("IndexError", "index 3 is out of bounds for dimension 0 with size 3"),
        ("RuntimeError", "mat1 and mat2 shapes cannot be multiplied (77x768 and 1024x320)"),
        ("FileNotFoundError", "[Errno 2] No such file or directory: 'input/x.png'"),
    ],
)
def test_errors_of_the_job_are_not_infrastructure(exception_type, message):
    assert infra_cause(exception_type, message) is None


def test_a_fault_named_by_the_prompts_own_inputs_is_no_evidence() -> None:
    message = (
        "**** ERROR: Saving image outside the output folder is not allowed.\n full_output_folder:"
        " /out/CUDA error: an illegal memory access was encountered"
    )
    strings = prompt_strings(
        {
            "9": {
                "class_type": "SaveImage",
                "inputs": {
                    "filename_prefix": "../CUDA ERROR: an illegal memory access was encountered/x"
                },
            }
        }
    )
    assert strings == ["../cuda error: an illegal memory access was encountered/x"]
    # A save node's variable becomes a number: "[Errno 2%height%]" reads "[Errno 28]".
    expanded = "[Errno 36] File name too long: '/out/[Errno 28] yyy_00001_.png'"
    saved = prompt_strings({"9": {"inputs": {"filename_prefix": "[Errno 2%height%] yyy"}}})
    assert infra_cause("OSError", expanded, saved) is None
    assert infra_cause("OSError", "[Errno 28] No space left on device", []) is not None
    assert infra_cause("SaveOutsideOutput", message, strings) is None
    # The same words the prompt does not carry still say the GPU is sick.
    assert (
        infra_cause(
            "RuntimeError", "CUDA error: an illegal memory access was encountered", ["a red fox"]
        ).name
        == "CUDA error"
    )


@pytest.mark.parametrize(
    "prefix",
    [
        "../../../CUDA error: an illegal memory access was encountered/x",
        "No space left on device " + "a" * 260,  # [Errno 36] File name too long: '...'
        "[Errno 2%height%] " + "y" * 300,  # its height is 8: the name says [Errno 28]
    ],
)
async def test_a_job_naming_a_gpu_fault_in_its_inputs_quarantines_no_server(tmp_path, prefix):
    store = Store(tmp_path / "store")
    poison = {"set": {"1.color": 999, "1.height": 8, "3.filename_prefix": prefix}}
    jobs = write_jobs(tmp_path / "jobs", 4, extra=[poison, {}, {}, {}])
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    await run(tmp_path, store, fakes, jobs)
    loaded = load_job_file(jobs).jobs
    states = [store.get(j.id).state for j in loaded]
    assert states == ["failed_fatal", "succeeded", "succeeded", "succeeded"]
    reason = store.get(loaded[0].id).reason or ""
    assert "infrastructure" not in reason and "failed on gpu" in reason
    health = store.server_health()
    assert not [h for h in health.values() if h.state in ("quarantined", "trial")]
    # Tried once on each server, then a dead letter: its own failure.
    assert sum(f.stats["prompts"].get(loaded[0].prompt_id, {}).get("posted", 0) for f in fakes) == 2


async def test_a_worker_whose_every_server_is_quarantined_takes_no_message_and_says_why(
    tmp_path, caplog
):
    store = Store(tmp_path / "store")
    store.server_failed("gpu0", job_id(99), "0" * 64, "disk", "disk full", infrastructure=True)
    jobs = write_jobs(tmp_path / "jobs", 1)
    source = MemorySource("images")
    source.put(jobs.read_text().splitlines()[0])
    source.end()
    fake = FakeComfy(prompt_seconds=0.002)
    caplog.set_level(logging.WARNING, logger="comfy_assets.service.worker")
    async with fake_servers(fake) as specs:
        worker = Worker(
            source, servers=specs, store=store, config=fast_config(), workflows_dir=jobs.parent
        )
        task = asyncio.create_task(worker.run())
        said = "every server is quarantined (gpu0 quarantined until "
        await wait_until(lambda: said in caplog.text, 30, "the worker's quarantine line")
        assert source.acked == [] and prompts(fake) == 0
        assert source._deliveries == {}  # not one message taken
        # Re-admitted by hand: the worker takes the message and renders it.
        store.readmit_server("gpu0", "test")
        await asyncio.wait_for(task, 60)
    assert len(source.acked) == 1 and prompts(fake) == 1


def test_health_shows_a_quarantine_and_readmit_ends_it(tmp_path, capsys):
    from comfy_assets.cli.main import main

    store = Store(tmp_path / "store")
    reason = "execution_error in node 2 (SaveImage): OSError: [Errno 28] No space left on device"
    store.server_failed("gpu2", job_id(1), "0" * 64, "disk", reason, infrastructure=True)
    store.close()
    assert main(["health", "--store", str(tmp_path / "store")]) == 1  # none usable
    out = capsys.readouterr().out
    assert out.startswith("gpu2 quarantined until ")
    assert out.rstrip().endswith(f": {reason}")
    assert main(["health", "--store", str(tmp_path / "store"), "--readmit", "gpu2"]) == 0
    assert capsys.readouterr().out.startswith("gpu2 re-admitted by hand (")
    assert main(["health", "--store", str(tmp_path / "store")]) == 0
    assert capsys.readouterr().out == "gpu2 ok\n"
    # Again: it is usable already, which is what --readmit asks for.
    assert main(["health", "--store", str(tmp_path / "store"), "--readmit", "gpu2"]) == 0
    assert capsys.readouterr().out == "gpu2 ok: not quarantined, no strikes now\n"
    assert main(["health", "--readmit", "gpu2"]) == 2
    assert "--readmit needs --store DIR" in capsys.readouterr().err


async def test_two_sick_servers_failing_alike_do_not_make_a_good_workflow_known_to_fail(tmp_path):
    healthy = [FakeComfy(prompt_seconds=0.002) for _ in range(2)]
    sick = [FakeComfy(default_word="error", prompt_seconds=0.002) for _ in range(2)]
    fakes = [*healthy, *sick]
    store = Store(tmp_path / "store")
    first = await run(tmp_path, store, fakes, write_jobs(tmp_path / "jobs", 30, name="a.jsonl"))
    # Only jobs that both sick servers failed before the workflow rendered anywhere may
    # be dead letters; once it rendered, it is not known to fail any more.
    assert first.counts["succeeded"] >= 25
    health = store.server_health()
    assert {health["gpu2"].state, health["gpu3"].state} == {"quarantined"}
    before = [prompts(f) for f in sick]
    second = await run(tmp_path, store, fakes, write_jobs(tmp_path / "jobs", 30, name="b.jsonl"))
    assert second.counts["succeeded"] == 30
    assert [prompts(f) for f in sick] == before  # in their cool-down: nothing posted there


async def test_a_failure_that_goes_elsewhere_does_not_use_up_the_jobs_attempts(tmp_path):
    sick = FakeComfy(default_word="error", prompt_seconds=0.001)
    healthy = [FakeComfy(prompt_seconds=0.01) for _ in range(2)]
    store = Store(tmp_path / "store")
    jobs = write_jobs(tmp_path / "jobs", 12, name="one_try.jsonl")
    summary = await run(tmp_path, store, [sick, *healthy], jobs, attempts=1)
    assert summary.counts["succeeded"] == 12
    assert store.server_health()["gpu0"].failures_server >= 1
    # The job whose attempt quarantined gpu0 (if one did) says so among its events.
    noted = [
        e.detail
        for i in range(12)
        for e in store.events(job_id(i, "one_try.jsonl"))
        if (e.detail or "").startswith("server gpu0 quarantined for ")
    ]
    assert len(noted) == store.server_health()["gpu0"].quarantines


def test_readmit_of_a_server_the_store_does_not_know_writes_nothing(tmp_path, capsys):
    from comfy_assets.cli.main import main

    store = Store(tmp_path / "store")
    store.server_failed("gpu0", job_id(1), "0" * 64, "cuda", "CUDA error", infrastructure=True)
    assert main(["health", "--store", str(tmp_path / "store"), "--readmit", "gpu7"]) == 2
    assert "unknown server 'gpu7' (the store knows: gpu0)" in capsys.readouterr().err
    assert sorted(store.server_health()) == ["gpu0"]
    # A server that rendered and never failed has no health record: health lists it ok,
    # and so does a readmit of it; an unknown one's error names it among those known.
    assert store.acquire_server("gpu1", "worker-1", 600)
    assert main(["health", "--store", str(tmp_path / "store"), "--readmit", "gpu1"]) == 0
    assert "gpu1 ok: not quarantined, no strikes now" in capsys.readouterr().out
    assert main(["health", "--store", str(tmp_path / "store"), "--readmit", "gpu7"]) == 2
    assert "unknown server 'gpu7' (the store knows: gpu0, gpu1)" in capsys.readouterr().err
    assert sorted(store.server_health()) == ["gpu0"]


def test_a_quarantine_for_jobs_failing_in_a_row_names_every_one_of_them(tmp_path):
    # Two 5xx failures left open (nothing rendered to judge them), then a third job's
    # that makes it 3 in a row: the quarantine is said at once, and names all three.
    store = Store(tmp_path / "store")
    for n in (1, 2):
        opened = store.server_failed(
            "gpu2", job_id(n), "0" * 64, "5xx", "POST /prompt 500", infrastructure=False
        )
        assert opened is None
    change = store.server_failed(
        "gpu2", job_id(3), "0" * 64, "5xx", "3 jobs in a row failed here", infrastructure=True
    )
    assert change is not None and change.kind == "quarantined"
    named = change.detail.rsplit("; jobs that failed here: ", 1)[1].split(", ")
    assert sorted(named) == sorted(job_id(n) for n in (1, 2, 3))
