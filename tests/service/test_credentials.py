"""A user and password in a server URL: sent as basic auth (HTTP and /ws), shown nowhere.

The end-to-end tests put a password in the URL of a server on a dead port and of a live
fake beside it (behind an authenticating proxy, ``BasicAuthGate``), and in the store's
database URL, then look for them in every text the project writes: stdout, stderr, log
records (DEBUG, websockets' handshake lines included), every store table, results.csv,
events, Dagster's event log and metadata, and the messages of ``<queue>.dead``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import pytest
import sqlalchemy as sa
from dagster import instance_for_test, materialize

from comfy_assets.assets import render_results, renders
from comfy_assets.cli.main import main
from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import UnexpectedAnswer
from comfy_assets.comfy.health import probe
from comfy_assets.comfy.servers import Credentials, ServerSpec, parse_servers
from comfy_assets.jobs.model import Job
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.owners import new_owner
from comfy_assets.resources import ComfyPoolResource, ResultStoreResource
from comfy_assets.service import broker
from comfy_assets.service.sources import RabbitSource
from comfy_assets.service.worker import Worker, job_messages
from comfy_assets.store import Store, Via, metadata
from fake_comfy import FakeComfy
from tests.comfy.test_client import free_port
from tests.service.test_worker_rabbitmq import URL as AMQP_URL
from tests.service.test_worker_rabbitmq import drain, queue  # noqa: F401 (a fixture)
from tests.support import (
    BasicAuthGate,
    executed,
    fast_config,
    posted,
    wait_until,
    write_jobs,
)

DEAD_PW = "dead-Pa55-7f3a"
LIVE_PW = "live-Pa55-91c2"
DB_PW = "db-Pa55-44d0"
FAST = ["--base-delay-s", "0.01", "--max-delay-s", "0.05", "--no-jitter", "--poll-s", "0.05"]


def secrets(user: str = "admin") -> list[str]:
    """Every form a password could leak in: as is, and inside a basic auth token."""
    tokens = [base64.b64encode(f"{user}:{pw}".encode()).decode() for pw in (DEAD_PW, LIVE_PW)]
    return [DEAD_PW, LIVE_PW, DB_PW, *tokens]


def leaks(text: str) -> list[str]:
    return [s for s in secrets() if s in text]


def servers_with_passwords(dead_port: int, live_url: str) -> list[str]:
    host = live_url.split("://", 1)[1]
    return [
        f"gpu0=http://admin:{DEAD_PW}@127.0.0.1:{dead_port}",
        f"gpu1=http://admin:{LIVE_PW}@{host}",
    ]


def db_url_with_password(pg_url: str) -> str:
    # The machine's PostgreSQL trusts local connections: the password is never asked for,
    # so it only has to stay out of what we write.
    return sa.make_url(pg_url).set(password=DB_PW).render_as_string(hide_password=False)


def every_row(db_url: str) -> str:
    """Every row of every table of the store's database, as text."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            return "\n".join(
                repr(row)
                for table in metadata.sorted_tables
                for row in conn.execute(table.select())
            )
    finally:
        engine.dispose()


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    lines = []
    for record in caplog.records:
        lines.append(record.getMessage())
        if record.exc_info:
            lines.append(logging.Formatter().formatException(record.exc_info))
    return "\n".join(lines)


def seed_catch_up(store: Store, partition: str, job: Job, server: str) -> None:
    """Leave ``job`` as a run cancelled while its prompt was on ``server`` leaves it, so
    the next attempt first asks ``server`` (dead in these tests) for the prompt."""
    store.register_jobs(partition, [job])
    store.claim_job(job.id, "ghost", 60.0)
    store.transition(
        job.id,
        "submitted",
        owner="ghost",
        via=Via(server=server, attempt=1),
        prompt_id=job.prompt_id,
    )
    store.transition(job.id, "failed_retryable", via=Via(server=server), detail="run cancelled")
    store.release_claim(job.id, "ghost")


# -- parsing -----------------------------------------------------------------------------


def test_a_server_urls_user_and_password_are_taken_out_and_percent_decoded():
    (spec,) = parse_servers(["gpu0=http://ad%40min:p%3Ass%2Fw%20x@127.0.0.1:8188/"])
    assert spec.url == "http://127.0.0.1:8188"
    assert spec.credentials == Credentials("ad@min", "p:ss/w x")
    for text in (repr(spec), str(spec), repr(spec.credentials), str(spec.credentials)):
        assert "p:ss" not in text and "ad@min" not in text and "%3A" not in text
    # A spec built directly (tests, Dagster's server list) is split the same way.
    built = ServerSpec("gpu0", "http://admin:pw@10.0.0.2:8188")
    assert (built.url, built.credentials) == ("http://10.0.0.2:8188", Credentials("admin", "pw"))
    assert parse_servers("http://token@h:1")[0].credentials == Credentials("token", "")
    # The same server with other credentials is still the same server.
    with pytest.raises(ValueError, match="given twice"):
        parse_servers(["a=http://u:x@h:1", "b=http://u:y@h:1"])


@pytest.mark.parametrize(
    "item",
    [
        "gpu0=http://admin:SECRET@h:port",
        "gpu0=http://admin:SECRET@h:1/api",
        "bad name=http://admin:SECRET@h:1",
        "gpu0=ftp://admin:SECRET@h:1",
        "gpu0=http://admin:SEC#RET@h:1",
        "gpu0=http://admin:SECRET@[::1",
    ],
)
def test_a_bad_server_item_is_named_without_its_password(item):
    with pytest.raises(ValueError) as info:
        parse_servers([item, "other=http://h:2"])
    assert "SEC" not in str(info.value) and "RET" not in str(info.value)
    assert "***@" in str(info.value)


# -- the client ----------------------------------------------------------------------------


async def test_credentials_go_as_basic_auth_on_every_request_and_the_socket(monkeypatch):
    gate = BasicAuthGate(monkeypatch)
    fake = gate.protect(FakeComfy(), "admin", LIVE_PW)
    async with fake.serve(port=0) as url:
        host = url.split("://", 1)[1]
        async with ComfyClient(f"http://admin:{LIVE_PW}@{host}") as client:
            assert client.base_url == url and LIVE_PW not in client.name
            await client.system_stats()
            await client.queue()
            ws = await client.connect_ws("comfy-assets-test")
            await ws.close()
        assert (gate.allowed, gate.refused) == (3, 0)

        async with ComfyClient(url) as anonymous:
            with pytest.raises(UnexpectedAnswer, match="401.*wants a user and password"):
                await anonymous.system_stats()
            with pytest.raises(UnexpectedAnswer, match="401.*wants a user and password"):
                await anonymous.connect_ws("comfy-assets-test")
        wrong = ComfyClient(url, credentials=Credentials("admin", "wrong"))
        async with wrong:
            with pytest.raises(UnexpectedAnswer, match="user and password .* were refused"):
                await wrong.queue()
        spec = ServerSpec("gpu1", f"http://admin:{LIVE_PW}@{host}")
        health = await asyncio.to_thread(probe, spec)
    assert health.healthy
    assert gate.refused == 3


async def test_websockets_debug_lines_show_no_authorization_value(monkeypatch, caplog):
    gate = BasicAuthGate(monkeypatch)
    fake = gate.protect(FakeComfy(), "admin", LIVE_PW)
    caplog.set_level(logging.DEBUG)
    async with fake.serve(port=0) as url:
        client = ComfyClient(url, credentials=Credentials("admin", LIVE_PW))
        async with client:
            ws = await client.connect_ws("comfy-assets-test")
            await ws.close()
    text = log_text(caplog)
    assert "> Authorization: ***" in text  # websockets logged the handshake
    assert leaks(text) == []


# -- end to end ------------------------------------------------------------------------------


@pytest.mark.postgres
def test_passwords_in_server_and_database_urls_show_in_no_output_log_row_csv_or_event(
    tmp_path, monkeypatch, capsys, caplog, pg_url
):
    gate = BasicAuthGate(monkeypatch)
    fake = gate.protect(FakeComfy(script=["ok", "invalid"], prompt_seconds=0.005), "admin", LIVE_PW)
    db_url = db_url_with_password(pg_url)
    monkeypatch.setenv("COMFY_ASSETS_DB_URL", db_url)
    caplog.set_level(logging.DEBUG)
    partition = f"creds{time.time_ns()}"
    jobs = write_jobs(tmp_path / "jobs", 4, name=f"{partition}.jsonl")
    job_file = load_job_file(jobs)
    store = tmp_path / "store"
    dead_port = free_port()

    with fake.serve_in_thread(port=0) as live:
        servers = servers_with_passwords(dead_port, live)
        assert main(["health", *(a for s in servers for a in ("--server", s))]) == 0
        code = main(
            ["run", "--jobs", str(jobs), "--store", str(store)]
            + [a for s in servers for a in ("--server", s)]
            + FAST
        )
    assert code == 1  # the "invalid" prompt is a dead letter
    with Store(store, db_url) as opened:
        dead = [r.job_id for r in opened.dead_letters(partition)]
        events = opened.events(partition=partition)
    assert len(dead) == 1
    assert main(["events", "--store", str(store), "--partition", partition]) == 0
    assert main(["events", "--store", str(store), "--job", dead[0], "--json"]) == 0
    assert main(["requeue", dead[0], "--store", str(store)]) == 0

    out, err = capsys.readouterr()
    # The URLs are printed (health, the run's unreachable server), without the password.
    assert f"gpu0 unreachable: connection refused (http://127.0.0.1:{dead_port})" in out
    assert f"(http://127.0.0.1:{dead_port})" in out.split("summary:")[0]
    assert "POST /prompt 400" in out
    assert leaks(out + err) == []
    assert leaks(log_text(caplog)) == []
    assert leaks(every_row(db_url)) == []
    assert leaks((store / partition / "results.csv").read_text()) == []
    assert leaks("\n".join(repr(e) for e in events)) == []
    assert not (store / "store.db").exists()  # the database came from COMFY_ASSETS_DB_URL
    # Every request and socket to the live server carried the credentials.
    assert gate.refused == 0 and gate.allowed > 0
    assert [posted(fake, j.prompt_id) for j in job_file.jobs] == [1, 1, 1, 1]
    assert sum(executed(fake, j.prompt_id) for j in job_file.jobs) == 3  # one was invalid


@pytest.mark.postgres
def test_passwords_show_in_no_dagster_event_metadata_or_store_row(
    tmp_path, monkeypatch, caplog, pg_url
):
    gate = BasicAuthGate(monkeypatch)
    fake = gate.protect(FakeComfy(prompt_seconds=0.005), "admin", LIVE_PW)
    db_url = db_url_with_password(pg_url)
    caplog.set_level(logging.DEBUG)
    partition = f"creds{time.time_ns()}"
    jobs = write_jobs(tmp_path / "jobs", 3, name=f"{partition}.jsonl")
    job_file = load_job_file(jobs)
    dead_port = free_port()
    with Store(tmp_path / "store", db_url) as store:
        seed_catch_up(store, partition, job_file.jobs[0], "gpu0")

    with fake.serve_in_thread(port=0) as live, instance_for_test() as instance:
        monkeypatch.setenv("COMFY_ASSETS_JOB_DIRS", str(jobs.parent))
        instance.add_dynamic_partitions("job_files", [partition])
        result = materialize(
            [renders, render_results],
            partition_key=partition,
            instance=instance,
            resources={
                "comfy": ComfyPoolResource(
                    servers_spec=",".join(servers_with_passwords(dead_port, live)),
                    base_delay_s=0.01,
                    max_delay_s=0.05,
                    poll_s=0.05,
                    unhealthy_wait_s=0.05,
                    catch_up_s=0.2,
                ),
                "result_store": ResultStoreResource(folder=str(tmp_path / "store"), db_url=db_url),
            },
        )
        records = instance.all_logs(result.run_id)
    assert result.success
    dagster_text = "\n".join(
        f"{r.message} {r.dagster_event!r}" if r.dagster_event else r.message for r in records
    )
    metadata_text = "\n".join(
        repr(e.materialization.metadata) for e in result.get_asset_materialization_events()
    )
    rows = every_row(db_url)
    # The dead server's URL is written (the unreachable warning, the catch-up's detail)...
    assert f"http://127.0.0.1:{dead_port}" in dagster_text
    assert "catch-up on gpu0 not possible" in rows and f"127.0.0.1:{dead_port}" in rows
    # ... and no password anywhere.
    assert leaks(dagster_text) == []
    assert leaks(metadata_text) == []
    assert leaks(rows) == []
    assert leaks(log_text(caplog)) == []
    assert leaks((tmp_path / "store" / partition / "results.csv").read_text()) == []
    assert gate.refused == 0
    assert [executed(fake, j.prompt_id) for j in job_file.jobs] == [1, 1, 1]


@pytest.mark.rabbitmq
async def test_passwords_show_in_no_dead_letter_header_body_or_worker_log(
    tmp_path,
    monkeypatch,
    caplog,
    queue,  # noqa: F811
):
    gate = BasicAuthGate(monkeypatch)
    fake = gate.protect(FakeComfy(script=["ok", "error"], prompt_seconds=0.005), "admin", LIVE_PW)
    caplog.set_level(logging.DEBUG)
    jobs = write_jobs(tmp_path / "jobs", 3, salt=f"credentials-worker-{time.time_ns()}")
    job_file = load_job_file(jobs)
    store = Store(tmp_path / "store")
    seed_catch_up(store, jobs.stem, job_file.jobs[0], "gpu0")  # messages name their file's
    dead_port = free_port()
    messages = job_messages(jobs)
    await broker.enqueue(AMQP_URL, queue, messages)
    async with fake.serve(port=0) as live:
        worker = Worker(
            RabbitSource(AMQP_URL, queue),
            servers=parse_servers(servers_with_passwords(dead_port, live)),
            store=store,
            config=fast_config(attempts=1, catch_up_s=0.2),
            owner=new_owner(),
        )
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: worker.counts["acked"] == 3, 60, "3 acks")
        worker.request_stop("test over")
        await asyncio.wait_for(task, 60)
    dead = await drain(f"{queue}.dead")
    assert worker.counts["dead_lettered"] == 1 and len(dead) == 1
    headers_text = "\n".join(repr(m.headers) + m.body.decode() for m in dead)
    assert "x-worker-reason" in headers_text
    rows = "\n".join(repr(e) for e in store.events(partition=jobs.stem))
    assert f"127.0.0.1:{dead_port}" in rows  # the catch-up on gpu0 names its URL
    assert leaks(headers_text) == []
    assert leaks(rows) == []
    assert leaks(log_text(caplog)) == []
    assert gate.refused == 0
    store.close()
    assert json.loads(dead[0].body)["id"] in {j.id for j in job_file.jobs}


@pytest.mark.parametrize(
    "url, said",
    [
        (f"amqp://guest:{LIVE_PW}@127.0.0.1:99999/", "not a RabbitMQ URL: amqp://guest:***@"),
        (f"amqp://guest:{LIVE_PW}@127.0.0.1:1/", "cannot connect to RabbitMQ at amqp://guest:***@"),
    ],
)
def test_a_rabbitmq_url_is_named_without_its_password(tmp_path, capsys, url, said):
    jobs = write_jobs(tmp_path / "jobs", 1)
    assert main(["enqueue", "--rabbitmq", url, "--queue", "q", "--jobs", str(jobs)]) == 1
    err = capsys.readouterr().err
    assert said in err
    assert leaks(err) == []


@pytest.mark.rabbitmq
def test_a_refused_rabbitmq_login_is_named_without_its_password(tmp_path, capsys):
    jobs = write_jobs(tmp_path / "jobs", 1)
    url = AMQP_URL.replace("guest:guest@", f"guest:{LIVE_PW}@")
    assert main(["enqueue", "--rabbitmq", url, "--queue", "q", "--jobs", str(jobs)]) == 1
    err = capsys.readouterr().err
    assert "ACCESS_REFUSED" in err and "amqp://guest:***@" in err
    assert leaks(err) == []
