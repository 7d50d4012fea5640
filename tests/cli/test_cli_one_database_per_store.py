"""One database per store, on a real object store (SeaweedFS) and PostgreSQL: after a
run into ``s3://BUCKET/A``, every command on ``s3://BUCKET/B`` (or on a folder store)
with the same ``--db-url`` says so in one line naming both and exits 2, posting no
prompt and writing nothing under B; ``A`` opens again as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from fake_comfy import FakeComfy
from tests.s3_server import S3Server
from tests.support import write_jobs


@pytest.fixture
def on_s3(s3_endpoint: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.secret_key)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("COMFY_ASSETS_DB_URL", raising=False)
    return s3_endpoint


def posted(fake: FakeComfy) -> int:
    return sum(p["posted"] for p in fake.stats["prompts"].values())


def test_a_second_prefix_on_one_database_is_refused_before_anything_is_posted_or_written(
    on_s3: S3Server,
    s3_bucket: str,
    own_pg_url: str,
    tmp_path: Path,
    fake: FakeComfy,
    url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = f"s3://{s3_bucket}/A", f"s3://{s3_bucket}/B"
    jobs = write_jobs(tmp_path / "jobs", 2)
    run = ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", "--db-url", own_pg_url]
    assert main([*run, "--store", a]) == 0
    sent = posted(fake)
    assert sent == 2
    capsys.readouterr()
    refusal = (
        f"error: the database at --db-url holds the records of the store {a}, not {b}: "
        "one database per store\n"
    )
    commands = {
        "run": [*run, "--store", b],
        "status": ["status", "--store", b, "--db-url", own_pg_url],
        "sync": ["sync", "--store", b, "--db-url", own_pg_url, "--partition", "jobs"]
        + ["--to", str(tmp_path / "desk")],
    }

    for name, argv in commands.items():
        assert main(argv) == 2, name
        assert capsys.readouterr() == ("", refusal), name

    assert posted(fake) == sent
    assert on_s3.objects(s3_bucket, "B/") == {}
    assert on_s3.objects(s3_bucket, "A/") != {}
    assert not (tmp_path / "desk").exists()
    assert on_s3.secret_key not in refusal
    # The store the database belongs to opens as before, its jobs done.
    assert main([*run, "--store", a]) == 0
    assert posted(fake) == sent
    assert main(["status", "--store", a, "--db-url", own_pg_url]) == 0


def test_a_folder_store_on_an_object_stores_database_is_refused(
    on_s3: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    fake: FakeComfy,
    url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = f"s3://{s3_bucket}/A"
    db = ["--db-url", f"sqlite:///{tmp_path / 'records.db'}"]
    jobs = write_jobs(tmp_path / "jobs", 1)
    run = ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", *db]
    assert main([*run, "--store", a]) == 0
    capsys.readouterr()
    folder = tmp_path / "folder-store"

    assert main([*run, "--store", str(folder)]) == 2

    assert capsys.readouterr() == (
        "",
        f"error: the database at --db-url holds the records of the store {a}, not "
        f"{folder}: one database per store\n",
    )
    assert posted(fake) == 1
    assert not folder.exists()
