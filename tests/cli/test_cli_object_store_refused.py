"""A real object store (SeaweedFS) that refuses us: a wrong secret, a bucket that does
not exist, an endpoint where nothing answers. ``run``, ``worker`` and ``api`` each say
so in one line naming the store (never the secret) and exit 2 before any prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from fake_comfy import FakeComfy
from tests.api_support import write_tokens
from tests.s3_server import S3Server, unused_port
from tests.support import write_jobs


@pytest.mark.parametrize("command", ["run", "worker", "api"])
@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("secret", "the credentials were refused (403 SignatureDoesNotMatch)"),
        ("bucket", "the bucket does not exist"),
        ("endpoint", "the object store is unavailable (connection failed)"),
    ],
)
def test_a_store_that_refuses_us_is_one_line_and_exit_2_before_any_prompt(
    command: str,
    fault: str,
    why: str,
    s3_endpoint: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    fake: FakeComfy,
    url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    endpoint = f"http://127.0.0.1:{unused_port()}" if fault == "endpoint" else s3_endpoint.endpoint
    secret = "not-the-secret" if fault == "secret" else s3_endpoint.secret_key
    bucket = "no-such-bucket" if fault == "bucket" else s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    location = f"s3://{bucket}/farm"
    jobs = write_jobs(tmp_path / "jobs", 2)
    common = ["--store", location, "--db-url", f"sqlite:///{tmp_path / 'records.db'}"]
    argv = {
        "run": ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", *common],
        "worker": ["worker", "--jobs", str(jobs), "--server", f"gpu0={url}", *common],
        "api": ["api", "--tokens", str(write_tokens(tmp_path / "tokens.json")), *common]
        + ["--rabbitmq", "amqp://guest:guest@127.0.0.1:5672/"],
    }[command]

    assert main(argv) == 2

    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"error: {location}: reaching the bucket: "), line
    assert why in line
    assert secret not in err and s3_endpoint.secret_key not in err
    assert fake.stats["prompts"] == {}


def test_no_credentials_at_all_says_none_were_found_not_only_refused(
    s3_endpoint: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    fake: FakeComfy,
    url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.endpoint)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    location = f"s3://{s3_bucket}/farm"
    jobs = write_jobs(tmp_path / "jobs", 2)
    argv = ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", "--store", location]

    assert main([*argv, "--db-url", f"sqlite:///{tmp_path / 'records.db'}"]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"error: {location}: reaching the bucket: the credentials were refused")
    assert line.endswith(
        "; no credentials were found, so the requests went unsigned (set AWS_ACCESS_KEY_ID "
        "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
    )
    assert fake.stats["prompts"] == {}
