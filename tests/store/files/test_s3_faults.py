"""What the S3 store makes of a server's failures, from an HTTP server that answers
every request with one S3 error: throttling and 5xx retried a bounded number of times
then FileStoreUnavailable, no room FileStoreFull, refusals FileStoreRefused; and the
settings read from the environment and the AWS profile files."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from comfy_assets.store.files import (
    FileStoreFull,
    FileStoreRefused,
    FileStoreUnavailable,
    S3FileStore,
    S3Settings,
)
from comfy_assets.store.files import s3 as s3_module
from comfy_assets.store.files.s3_config import parse_location
from comfy_assets.store.files.s3_errors import store_error


async def one(data: bytes) -> AsyncIterator[bytes]:
    yield data


class FailingS3:
    """Answers every request ``status`` with the S3 error ``code``; counts them."""

    def __init__(self, status: int, code: str) -> None:
        self.status, self.code, self.requests = status, code, 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        await request.read()
        body = f"<?xml version='1.0'?><Error><Code>{self.code}</Code></Error>"
        return web.Response(status=self.status, text=body, content_type="application/xml")


@pytest.fixture
async def failing(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FailingS3, str]]:
    server = FailingS3(*request.param)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def store_for(endpoint: str, tmp_path: Path) -> S3FileStore:
    settings = S3Settings(endpoint=endpoint, access_key_id="k", secret_access_key="s3cr3t")
    return S3FileStore("s3://studio/x", settings, spool_dir=tmp_path, max_retries=2)


@pytest.mark.parametrize(
    ("failing", "error", "message"),
    [
        ((503, "SlowDown"), FileStoreUnavailable, "the object store is unavailable (503 SlowDown)"),
        ((500, "InternalError"), FileStoreUnavailable, "is unavailable (500 InternalError)"),
        ((507, "InsufficientStorage"), FileStoreFull, "the object store is full (507 Insuf"),
        ((403, "QuotaExceeded"), FileStoreFull, "the object store is full (403 QuotaExceeded)"),
        (
            (403, "AccessDenied"),
            FileStoreRefused,
            "the credentials were refused (403 AccessDenied)",
        ),
    ],
    indirect=["failing"],
)
async def test_a_failing_server_is_retried_a_bounded_number_of_times_then_named(
    failing: tuple[FailingS3, str], tmp_path: Path, error: type[Exception], message: str
) -> None:
    server, endpoint = failing
    store = store_for(endpoint, tmp_path)
    with pytest.raises(error) as raised:
        await store.write_output("p", "j", "a.png", one(b"bytes"))
    assert str(raised.value).startswith("s3://studio/x: storing the output a.png: ")
    assert message in str(raised.value)
    assert "s3cr3t" not in str(raised.value)
    # 5xx: the first request and max_retries more; 4xx: not retried.
    assert server.requests == (3 if server.status >= 500 else 1)


@pytest.mark.parametrize("failing", [(503, "SlowDown")], indirect=True)
async def test_check_refuses_a_store_that_does_not_answer_well(
    failing: tuple[FailingS3, str], tmp_path: Path
) -> None:
    store = store_for(failing[1], tmp_path)
    with pytest.raises(FileStoreRefused, match=r"^s3://studio/x: reaching the bucket: .*503"):
        await asyncio.to_thread(store.check)


def test_errors_not_the_clients_are_left_as_they_are() -> None:
    assert store_error(ConnectionResetError("ComfyUI went away"), "s3://farm", "x") is None


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_settings_come_from_the_variables_before_the_profile(tmp_path: Path) -> None:
    write(
        tmp_path / ".aws/credentials",
        "[default]\naws_access_key_id = P\naws_secret_access_key = PS%\n",
    )
    write(
        tmp_path / ".aws/config",
        "[default]\nregion = eu-west-3\nendpoint_url = http://127.0.0.1:9\n",
    )

    from_profile = S3Settings.from_environment({}, tmp_path)
    assert (from_profile.access_key_id, from_profile.secret_access_key) == ("P", "PS%")
    assert (from_profile.region, from_profile.endpoint) == ("eu-west-3", "http://127.0.0.1:9")
    assert "PS%" not in repr(from_profile)

    env = {
        "AWS_ACCESS_KEY_ID": "E",
        "AWS_SECRET_ACCESS_KEY": "ES",
        "AWS_REGION": "ap-south-1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:10",
    }
    from_env = S3Settings.from_environment(env, tmp_path)
    assert (from_env.access_key_id, from_env.secret_access_key) == ("E", "ES")
    assert (from_env.region, from_env.endpoint) == ("ap-south-1", "http://127.0.0.1:10")
    s3_endpoint = S3Settings.from_environment(
        {**env, "AWS_ENDPOINT_URL_S3": "http://h:1"}, tmp_path
    )
    assert s3_endpoint.endpoint == "http://h:1"


def test_a_named_profile_is_read_and_a_missing_one_refused(tmp_path: Path) -> None:
    credentials = write(
        tmp_path / "creds", "[render]\naws_access_key_id = R\naws_secret_access_key = RS\n"
    )
    config = write(tmp_path / "conf", "[profile render]\nregion = us-west-2\n")
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_CONFIG_FILE": str(config)}

    render = S3Settings.from_environment({**env, "AWS_PROFILE": "render"}, tmp_path)
    assert (render.access_key_id, render.secret_access_key, render.region) == (
        "R",
        "RS",
        "us-west-2",
    )
    assert S3Settings.from_environment(env, tmp_path) == S3Settings()
    with pytest.raises(ValueError, match=f"AWS_PROFILE=film: no such profile in {credentials}"):
        S3Settings.from_environment({**env, "AWS_PROFILE": "film"}, tmp_path)
    broken = write(
        tmp_path / "bad", "[render]\naws_secret_access_key = X\nnot a line with a secret\n"
    )
    with pytest.raises(ValueError, match=r"cannot be read as an AWS profile file \(line 3\)") as e:
        S3Settings.from_environment({"AWS_SHARED_CREDENTIALS_FILE": str(broken)}, tmp_path)
    assert "secret" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "bucket", "prefix"),
    [
        ("s3://studio/renders/", "studio", "renders"),
        ("s3://my.farm-1", "my.farm-1", ""),
        ("s3://studio/a/b", "studio", "a/b"),
    ],
)
def test_locations_parse(text: str, bucket: str, prefix: str) -> None:
    where = parse_location(text)
    assert (where.bucket, where.prefix) == (bucket, prefix)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("s3://ab/x", "is not a bucket name"),
        ("s3://Farm/x", "is not a bucket name"),
        ("s3://studio/a//b", "empty, '.' or '..' part"),
        ("s3://studio/a/../b", "empty, '.' or '..' part"),
        ("gs://studio/x", "is not an S3 store"),
    ],
)
def test_bad_locations_are_named(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_location(text)


def test_an_endpoint_that_accepts_but_never_answers_is_named_as_timed_out_at_first_contact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server stopped (kill -STOP) or hung: the connection is made, no answer comes.
    # The first contact waits CHECK_TIMEOUT_S, not a whole upload's REQUEST_TIMEOUT_S
    # (were it the latter, this test would wait an hour).
    monkeypatch.setattr(s3_module, "CHECK_TIMEOUT_S", 1)
    monkeypatch.setattr(s3_module, "REQUEST_TIMEOUT_S", 3600)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        store = S3FileStore(
            "s3://studio/x",
            S3Settings(
                endpoint=f"http://127.0.0.1:{port}", access_key_id="k", secret_access_key="s"
            ),
            spool_dir=tmp_path,
            max_retries=0,
        )
        with pytest.raises(FileStoreRefused) as raised:
            store.check()
    assert str(raised.value) == (
        "s3://studio/x: reaching the bucket: the object store is unavailable (timed out)"
    )
