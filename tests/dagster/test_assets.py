"""The assets against in-thread fake ComfyUI servers: renders, results CSV, checks, cancel."""

from __future__ import annotations

import _thread
import hashlib
import json
import logging
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pandas as pd
from dagster import (
    AssetKey,
    DagsterInstance,
    DagsterRunStatus,
    ExecuteInProcessResult,
    FloatMetadataValue,
    IntMetadataValue,
    RunsFilter,
    TableMetadataValue,
    evaluate_automation_conditions,
    materialize,
)
from PIL import Image

from comfy_assets.assets import all_results, render_results, renders
from comfy_assets.definitions import defs
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.resources import ComfyPoolResource, ResultStoreResource, ServerConfig
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import FAST_TIMES

REPO = Path(__file__).resolve().parents[2]


def write_job_file(folder: Path, name: str, colors: list[int]) -> Path:
    """A job file of one image job per colour; job ids depend on the file name."""
    lines = [
        json.dumps(
            {
                "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"test-assets/{name}/{i}")),
                "workflow": "../workflows/image.json",
                "set": {"1.color": color, "1.width": 32 + 8 * i},
            }
        )
        for i, color in enumerate(colors)
    ]
    path = folder / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def serving(*fakes: FakeComfy) -> Iterator[ComfyPoolResource]:
    """Serve the fakes in threads; yield a pool resource over them with tiny delays."""
    with ExitStack() as stack:
        urls = [stack.enter_context(fake.serve_in_thread(port=0)) for fake in fakes]
        yield ComfyPoolResource(
            servers=[ServerConfig(name=f"gpu{i}", url=url) for i, url in enumerate(urls)],
            **FAST_TIMES,
        )


def render(
    instance: DagsterInstance,
    partition: str,
    comfy: ComfyPoolResource,
    store_dir: Path,
    store: ResultStoreResource | None = None,
) -> ExecuteInProcessResult:
    if partition not in instance.get_dynamic_partitions("job_files"):
        instance.add_dynamic_partitions("job_files", [partition])
    return materialize(
        [renders, render_results],
        partition_key=partition,
        instance=instance,
        resources={
            "comfy": comfy,
            "result_store": store or ResultStoreResource(folder=str(store_dir)),
        },
        raise_on_error=False,
    )


def counts(fakes: list[FakeComfy], what: str) -> dict[str, int]:
    """posted or executed per prompt_id, summed over the fakes."""
    total: dict[str, int] = {}
    for fake in fakes:
        for prompt_id, entry in fake.stats["prompts"].items():
            total[prompt_id] = total.get(prompt_id, 0) + entry[what]
    return total


def checks(result: ExecuteInProcessResult) -> dict[str, bool]:
    return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}


def read_csv(store_dir: Path, partition: str) -> pd.DataFrame:
    return pd.read_csv(store_dir / partition / "results.csv", dtype=str, keep_default_na=False)


def test_a_four_job_file_renders_every_job_once_and_writes_its_rows(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    path = write_job_file(jobs_dir, "four", [0x110000, 0x002200, 0x000033, 0x444444])
    job_file = load_job_file(path)
    fakes = [FakeComfy(), FakeComfy()]

    with serving(*fakes) as comfy:
        result = render(instance, "four", comfy, tmp_path / "store")

    assert result.success
    prompt_ids = {job.prompt_id for job in job_file.jobs}
    assert counts(fakes, "posted") == dict.fromkeys(prompt_ids, 1)
    assert counts(fakes, "executed") == dict.fromkeys(prompt_ids, 1)
    assert checks(result) == {"no_dead_letters": True, "all_jobs_done": True}
    # A check's numbers would plot every partition's as one series: it carries text.
    for evaluation in result.get_asset_check_evaluations():
        assert evaluation.metadata["partition"].value == "four"
        numbers = [
            name
            for name, value in evaluation.metadata.items()
            if isinstance(value, IntMetadataValue | FloatMetadataValue)
        ]
        assert numbers == [], (evaluation.check_name, numbers)
    (done,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "all_jobs_done"]
    assert done.metadata["done"].value == "4 of 4 jobs"

    frame = read_csv(tmp_path / "store", "four")
    assert frame["job_id"].tolist() == [job.id for job in job_file.jobs]
    assert frame["1.color"].tolist() == [str(c) for c in (0x110000, 0x002200, 0x000033, 0x444444)]
    assert frame["1.width"].tolist() == ["32", "40", "48", "56"]
    assert set(frame["state"]) == {"succeeded"}
    assert set(frame["server"]) <= {"gpu0", "gpu1"}
    for cell in frame["files"]:
        names = sorted(item.split(":")[0] for item in cell.split())
        assert [n.split("_")[0] for n in names] == ["inverted", "solid"]

    (renders_event,) = [
        e for e in result.get_asset_materialization_events() if e.asset_key.path == ["renders"]
    ]
    metadata = renders_event.materialization.metadata
    assert metadata["done"].value == 4
    # The job table is a Dagster table: a row per job in line order, typed columns.
    job_table = metadata["job_table"]
    assert isinstance(job_table, TableMetadataValue)
    # It fits a page: short ids, as in log lines (the full ones are in results.csv).
    assert [r.data["job"] for r in job_table.records] == [job.id[:8] for job in job_file.jobs]
    assert "job_id" not in {c.name for c in job_table.schema.columns}
    assert [r.data["state"] for r in job_table.records] == ["succeeded"] * 4
    assert [r.data["line"] for r in job_table.records] == [1, 2, 3, 4]
    types = {c.name: c.type for c in job_table.schema.columns}
    assert types["attempts"] == "int" and types["seconds"] == "float"
    assert types["state"] == "string"
    # A contact sheet of every output, each tile labelled, small enough for the event log.
    sheet = metadata["contact_sheet"].value
    assert sheet.startswith("![four: 8 outputs of 4 jobs](data:image/png;base64,")
    assert len(sheet) < 100_000  # metadata lives in the event log
    assert list(metadata)[0] == "contact_sheet"  # at the top of the page
    with Image.open(metadata["contact_sheet_path"].value) as image:
        assert image.width == 4 * 140  # four 140 px tiles a row: 2 jobs of 2 outputs
        rgb = image.convert("RGB")
        # The first job's outputs in the workflow's node order: node 3 saves the colour,
        # node 4 its inverse (alphabetically first, "inverted_", is not first).
        assert rgb.getpixel((70, 100)) == (0x11, 0x00, 0x00)
        assert rgb.getpixel((210, 100)) == (0xEE, 0xFF, 0xFF)


def test_with_a_media_url_the_pictures_are_a_short_link_the_ui_shows_inline(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    write_job_file(jobs_dir, "linked", [0x110000, 0x002200])
    store = ResultStoreResource(folder=str(tmp_path / "store"), media_url="http://media.test/s/")

    with serving(FakeComfy()) as comfy:
        result = render(instance, "linked", comfy, tmp_path / "store", store)

    (event,) = [
        e for e in result.get_asset_materialization_events() if e.asset_key.path == ["renders"]
    ]
    sheet = event.materialization.metadata["contact_sheet"].value
    sheet_file = tmp_path / "store" / "linked" / "outputs.contact.png"
    digest = hashlib.sha256(sheet_file.read_bytes()).hexdigest()[:12]
    url = f"http://media.test/s/linked/outputs.contact.png?v={digest}"
    assert sheet == f"[![linked: 4 outputs of 2 jobs]({url})]({url})"
    assert len(sheet) < 1000  # the UI inlines markdown shorter than this


def test_a_changed_file_rerenders_only_the_changed_job(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    colors = [0x010101, 0x020202, 0x030303, 0x040404]
    path = write_job_file(jobs_dir, "batch", colors)
    before = load_job_file(path)
    fakes = [FakeComfy(), FakeComfy()]

    with serving(*fakes) as comfy:
        assert render(instance, "batch", comfy, tmp_path / "store").success
        write_job_file(jobs_dir, "batch", [*colors[:2], 0xFF00FF, colors[3]])
        after = load_job_file(path)
        second = render(instance, "batch", comfy, tmp_path / "store")

    assert second.success
    changed = after.jobs[2].prompt_id
    assert changed != before.jobs[2].prompt_id
    expected = {job.prompt_id: 1 for job in before.jobs} | {changed: 1}
    assert counts(fakes, "executed") == expected
    assert counts(fakes, "posted") == expected
    frame = read_csv(tmp_path / "store", "batch")
    assert frame["1.color"].tolist()[2] == str(0xFF00FF)
    assert set(frame["state"]) == {"succeeded"}


def test_results_of_a_file_changed_after_its_render_are_refused_and_the_csv_kept(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    path = write_job_file(jobs_dir, "moved", [1, 2])
    rendered = load_job_file(path)
    store = ResultStoreResource(folder=str(tmp_path / "store"))
    with serving(FakeComfy()) as comfy:
        first = render(instance, "moved", comfy, tmp_path / "store")
        csv_bytes = (tmp_path / "store/moved/results.csv").read_bytes()
        write_job_file(jobs_dir, "moved", [1, 2, 3])  # a third job nobody rendered
        again = materialize(
            [renders, render_results],
            selection=[render_results],
            partition_key="moved",
            instance=instance,
            resources={"comfy": comfy, "result_store": store},
            raise_on_error=False,
        )

    (results_event,) = [
        e
        for e in first.get_asset_materialization_events()
        if e.asset_key.path == ["render_results"]
    ]
    assert results_event.materialization.metadata["job_file_sha256"].value == rendered.sha256
    assert not again.success
    (failure,) = again.get_step_failure_events()
    message = failure.step_failure_data.user_failure_data.description
    assert "changed after renders rendered it" in message
    assert rendered.sha256[:16] in message
    assert (tmp_path / "store/moved/results.csv").read_bytes() == csv_bytes


def test_a_dead_letter_fails_its_check_but_keeps_the_csv_rows(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    path = write_job_file(jobs_dir, "mixed", [1, 2, 3, 4])
    job_file = load_job_file(path)
    fake = FakeComfy(script=["error"])  # the first prompt posted fails for good

    with serving(fake) as comfy:
        result = render(instance, "mixed", comfy, tmp_path / "store")

    assert result.success  # the CSV step ran
    assert checks(result) == {"no_dead_letters": False, "all_jobs_done": False}
    frame = read_csv(tmp_path / "store", "mixed")
    assert frame["job_id"].tolist() == [job.id for job in job_file.jobs]
    dead = frame[frame["state"] == "failed_fatal"]
    assert len(dead) == 1
    assert "IndexError" in dead["reason"].iloc[0]
    assert dead["files"].iloc[0] == ""
    assert (frame["state"] == "succeeded").sum() == 3
    # The dead letter ran once, and was not retried.
    assert sorted(counts([fake], "executed").values()) == [1, 1, 1, 1]


def test_all_results_gathers_every_partition_with_a_partition_column(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    write_job_file(jobs_dir, "one", [1, 2])
    write_job_file(jobs_dir, "two", [3, 4, 5])
    store = ResultStoreResource(folder=str(tmp_path / "store"))

    with serving(FakeComfy()) as comfy:
        assert render(instance, "one", comfy, tmp_path / "store").success
        assert render(instance, "two", comfy, tmp_path / "store").success
        result = materialize(
            [renders, render_results, all_results],
            selection=[all_results],
            instance=instance,
            resources={"comfy": comfy, "result_store": store},
        )

    assert result.success
    frame = pd.read_csv(tmp_path / "store" / "all_results.csv", dtype=str)
    assert frame["partition"].tolist() == ["one", "one", "two", "two", "two"]
    assert frame.columns[0] == "partition"
    assert set(frame["state"]) == {"succeeded"}
    # The CSVs are read as text; the schema and preview still give numbers as numbers.
    (event,) = result.get_asset_materialization_events()
    metadata = event.materialization.metadata
    types = {c.name: c.type for c in metadata["dagster/column_schema"].schema.columns}
    assert (types["1.color"], types["attempts"], types["seconds"]) == ("int", "int", "float")
    assert (types["partition"], types["state"]) == ("string", "string")
    assert [r.data["1.color"] for r in metadata["preview"].records] == [1, 2, 3, 4, 5]


def test_results_tables_are_dagster_tables_with_a_column_schema(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    path = write_job_file(jobs_dir, "typed", [1, 2, 3])

    with serving(FakeComfy()) as comfy:
        result = render(instance, "typed", comfy, tmp_path / "store")

    (event,) = [
        e
        for e in result.get_asset_materialization_events()
        if e.asset_key.path == ["render_results"]
    ]
    metadata = event.materialization.metadata
    schema = metadata["dagster/column_schema"].schema
    columns = [c.name for c in schema.columns]
    assert columns == list(read_csv(tmp_path / "store", "typed").columns)
    types = {c.name: c.type for c in schema.columns}
    assert (types["job_id"], types["attempts"], types["seconds"]) == ("string", "int", "float")
    assert "output" in next(c.description for c in schema.columns if c.name == "files")
    preview = metadata["preview"]
    assert isinstance(preview, TableMetadataValue)
    assert preview.schema == schema
    assert [r.data["job_id"] for r in preview.records] == [j.id for j in load_job_file(path).jobs]
    assert [r.data["1.color"] for r in preview.records] == [1, 2, 3]
    assert types["1.color"] == "int"  # JSON numbers of the job lines
    assert metadata["dagster/row_count"].value == 3


def test_a_render_lists_its_progress_in_the_log(jobs_dir: Path, tmp_path: Path, instance) -> None:
    write_job_file(jobs_dir, "counted", [1, 2, 3])

    with serving(FakeComfy()) as comfy:
        result = render(instance, "counted", comfy, tmp_path / "store")

    messages = [
        record.user_message
        for record in instance.all_logs(result.run_id)
        if record.step_key == "renders"
    ]
    # The first job's end is logged, then at most one line every few seconds, and the last;
    # each with the time left once a prompt was measured (docs/steering.md).
    assert any(re.fullmatch(r"1/3 done, 2 left, about \d+ s to go", m) for m in messages)
    assert "3/3 done, 0 left" in messages


def all_results_requested(instance, cursor=None):
    """(runs of all_results the automation sensors request now, their cursor)."""
    evaluation = evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
    return evaluation.get_num_requested(AssetKey("all_results")), evaluation.cursor


def two_job_files(jobs_dir: Path, tmp_path: Path) -> ResultStoreResource:
    """Job files "one" (two jobs) and "two" (one job) in ``jobs_dir``; returns a result store
    resource on ``tmp_path/store``."""
    write_job_file(jobs_dir, "one", [1, 2])
    write_job_file(jobs_dir, "two", [3])
    return ResultStoreResource(folder=str(tmp_path / "store"))


def test_all_results_is_requested_after_each_render_and_current_after(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    store = two_job_files(jobs_dir, tmp_path)

    def build_all_results(comfy: ComfyPoolResource) -> None:
        assert materialize(
            [renders, render_results, all_results],
            selection=[all_results],
            instance=instance,
            resources={"comfy": comfy, "result_store": store},
        ).success

    with serving(FakeComfy()) as comfy:
        count, cursor = all_results_requested(instance)
        assert count == 0  # nothing rendered yet: nothing to gather

        assert render(instance, "one", comfy, tmp_path / "store").success
        count, cursor = all_results_requested(instance, cursor)
        assert count == 1
        build_all_results(comfy)
        count, cursor = all_results_requested(instance, cursor)
        assert count == 0  # current: nothing changed since

        assert render(instance, "two", comfy, tmp_path / "store").success
        count, cursor = all_results_requested(instance, cursor)
        assert count == 1
        build_all_results(comfy)

    frame = pd.read_csv(tmp_path / "store" / "all_results.csv", dtype=str)
    assert frame["partition"].tolist() == ["one", "one", "two"]


def test_results_changed_while_all_results_runs_bring_it_again(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    # all_results is requested; before its run ends, another partition's results change
    # (its run read the tables first, say). Its own update is no answer to that change:
    # it is requested again, once, so all_results.csv ends with every partition's rows.
    store = two_job_files(jobs_dir, tmp_path)

    with serving(FakeComfy()) as comfy:
        resources = {"comfy": comfy, "result_store": store}
        _, cursor = all_results_requested(instance)  # the sensor's first tick
        assert render(instance, "one", comfy, tmp_path / "store").success
        count, cursor = all_results_requested(instance, cursor)
        assert count == 1
        assert render(instance, "two", comfy, tmp_path / "store").success  # meanwhile
        assert materialize(
            [renders, render_results, all_results],
            selection=[all_results],
            instance=instance,
            resources=resources,
        ).success  # the requested run ends after two's results
        count, cursor = all_results_requested(instance, cursor)
        assert count == 1
        count, cursor = all_results_requested(instance, cursor)
        assert count == 0  # once


def test_a_render_launched_without_its_results_brings_them_and_all_results_after(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    write_job_file(jobs_dir, "one", [1, 2])
    store = ResultStoreResource(folder=str(tmp_path / "store"))

    def requested(cursor=None):
        evaluation = evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        wanted = {
            key.to_user_string(): evaluation.get_requested_partitions(key)
            for key in (AssetKey("render_results"), AssetKey("all_results"))
        }
        return wanted, evaluation.cursor

    with serving(FakeComfy()) as comfy:
        resources = {"comfy": comfy, "result_store": store}
        assert render(instance, "one", comfy, tmp_path / "store").success
        _, cursor = requested()
        assert materialize(
            [renders, render_results, all_results],
            selection=[all_results],
            instance=instance,
            resources=resources,
        ).success
        wanted, cursor = requested(cursor)
        assert wanted == {"render_results": set(), "all_results": set()}  # current

        # A backfill of renders alone (the UI's Materialize over every partition).
        assert materialize(
            [renders], partition_key="one", instance=instance, resources=resources
        ).success
        wanted, cursor = requested(cursor)
        assert wanted["render_results"] == {"one"}
        assert materialize(
            [renders, render_results],
            selection=[render_results],
            partition_key="one",
            instance=instance,
            resources=resources,
        ).success
        wanted, cursor = requested(cursor)
        assert wanted == {"render_results": set(), "all_results": {None}}


def test_a_partition_that_names_no_job_file_renders_nothing_and_leaves_no_failed_run(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    # A partition added by hand in the UI: a failed run would leave renders red until some
    # later run materialized it, and nothing ever materializes this partition.
    fake = FakeComfy()

    with serving(fake) as comfy:
        result = render(instance, "gone", comfy, tmp_path / "store")

    assert result.success
    assert result.get_asset_materialization_events() == []
    assert [e.step_key for e in result.get_step_skipped_events()] == ["render_results"]
    assert any(
        "partition gone: no job file for partition 'gone'" in record.user_message
        and record.level == logging.ERROR
        for record in instance.all_logs(result.run_id)
    )
    assert fake.stats["prompts"] == {}


class InterruptOnFirstRender(ResultStoreResource):
    """A store that cancels the run as the UI does once the first prompt renders.

    The UI marks the run CANCELING and the run worker gets a signal, which Dagster raises
    in the main thread as DagsterExecutionInterruptedError; ``interrupt_main`` delivers the
    same signal to the main thread from wherever the hook runs.
    """

    def open(self) -> Store:
        return _InterruptingStore(self.root)


class _InterruptingStore(Store):
    instance: DagsterInstance | None = None
    fired = threading.Event()

    def transition(self, job_id: str, to_state: str, **kwargs: object) -> object:
        result = super().transition(job_id, to_state, **kwargs)
        if str(to_state) == "rendering" and not self.fired.is_set():
            self.fired.set()
            assert self.instance is not None
            (run,) = self.instance.get_runs(filters=RunsFilter(statuses=[DagsterRunStatus.STARTED]))
            self.instance.report_run_canceling(run)
            _thread.interrupt_main()
        return result


def test_a_cancelled_run_leaves_no_prompt_of_ours_on_the_servers(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    path = write_job_file(jobs_dir, "long", [1, 2, 3, 4])
    job_file = load_job_file(path)
    fakes = [FakeComfy(script=["hang"]), FakeComfy(script=["hang"])]
    _InterruptingStore.instance = instance
    _InterruptingStore.fired = threading.Event()

    with serving(*fakes) as comfy:
        result = render(
            instance,
            "long",
            comfy,
            tmp_path / "store",
            InterruptOnFirstRender(folder=str(tmp_path / "store")),
        )
        queues = [httpx.get(f"{url}/queue").json() for url in (s.url for s in comfy.server_specs())]

    assert _InterruptingStore.fired.is_set()
    assert result.dagster_run.status == DagsterRunStatus.CANCELED
    ours = {job.prompt_id for job in job_file.jobs}
    for queue in queues:
        listed = {entry[1] for entry in queue["queue_running"] + queue["queue_pending"]}
        assert not listed & ours
    runs = [run for fake in fakes for run in fake.stats["runs"]]
    assert runs and all(run["outcome"] == "interrupted" for run in runs)
    with Store(tmp_path / "store") as store:
        records = store.jobs("long")
    assert not [r for r in records if r.state in ("submitted", "rendering")]
    assert not [r for r in records if r.claimed_by]


def test_with_no_server_reachable_the_render_step_fails_for_a_retry_and_jobs_stay_pending(
    jobs_dir: Path, tmp_path: Path, instance
) -> None:
    write_job_file(jobs_dir, "dark", [1, 2])
    comfy = ComfyPoolResource(
        servers=[ServerConfig(name="gpu0", url="http://127.0.0.1:9")],
        unhealthy_wait_s=0.05,
        unreachable_timeout_s=0.3,
        no_server_retries=0,
    )
    result = render(instance, "dark", comfy, tmp_path / "store")

    assert not result.success
    (failure,) = result.get_step_failure_events()
    assert "no server reachable for" in str(failure.step_failure_data.error)
    assert (
        "gpu0 unreachable: ServerUnreachable: gpu0: GET /system_stats: connection refused"
        in str(failure.step_failure_data.error)
    )
    store = Store(tmp_path / "store")
    assert [(j.state, j.claimed_by) for j in store.jobs("dark")] == [("pending", None)] * 2
