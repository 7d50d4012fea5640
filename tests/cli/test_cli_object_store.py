"""``--store s3://BUCKET/PREFIX`` on every command that takes a store: without a database
URL it is one clear line and exit 2, nothing created and nothing posted; a store whose
files refuse us (a wrong endpoint, bucket or credential) likewise, before any prompt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from comfy_assets.cli import run as cli_run
from comfy_assets.cli.main import main
from comfy_assets.store.files import FileStoreRefused, FolderFileStore
from comfy_assets.store.files.base import FileStore
from fake_comfy import FakeComfy
from tests.support import job_id, write_jobs

S3 = "s3://farm-bucket/renders"
NEEDS_DB = (
    f"error: --store {S3}: an object store keeps files, not the store's records: give "
    "--db-url postgresql+psycopg://... (or COMFY_ASSETS_DB_URL), a database every host of "
    "the farm reaches\n"
)


def argvs(jobs: Path) -> dict[str, list[str]]:
    """Each command that takes a store, with ``--store S3`` and what else it requires."""
    server = "gpu0=http://127.0.0.1:9"  # nothing listens there: nothing may be posted
    return {
        "run": ["run", "--jobs", str(jobs), "--server", server, "--store", S3],
        "worker": ["worker", "--jobs", str(jobs), "--server", server, "--store", S3],
        "api": ["api", "--store", S3, "--tokens", str(jobs.parent / "tokens.json")],
        "film": ["film", "--jobs", str(jobs), "--store", S3],
        "status": ["status", "--store", S3],
        "events": ["events", "--store", S3, "--partition", "p"],
        "requeue": ["requeue", job_id(0), "--store", S3],
        "health": ["health", "--store", S3],
    }


@pytest.mark.parametrize(
    "command", ["run", "worker", "api", "film", "status", "events", "requeue", "health"]
)
def test_an_object_store_without_a_database_url_is_exit_2_with_one_clear_line(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("COMFY_ASSETS_DB_URL", raising=False)
    jobs = write_jobs(tmp_path / "jobs", 1)
    monkeypatch.chdir(tmp_path)

    assert main(argvs(jobs)[command]) == 2

    out, err = capsys.readouterr()
    assert (out, err) == ("", NEEDS_DB)
    assert sorted(os.listdir(tmp_path)) == ["jobs"]  # no folder named after the URL


def test_another_url_scheme_is_an_argparse_error_naming_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["status", "--store", "http://example.invalid/store"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --store: a folder or s3://BUCKET/PREFIX, not a http:// URL" in err


class RefusingFileStore(FolderFileStore):
    """Files whose ``check`` refuses, as a wrong bucket or secret makes an object store."""

    def check(self) -> None:
        raise FileStoreRefused(f"--store {S3}: NoSuchBucket: the bucket farm-bucket does not exist")


def test_files_that_refuse_us_are_one_line_and_exit_2_before_any_prompt(
    tmp_path: Path,
    fake: FakeComfy,
    url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    chosen: list[str | Path] = []

    def refusing(location: str | Path) -> FileStore:
        chosen.append(location)
        return RefusingFileStore(tmp_path / "files")

    monkeypatch.setattr(cli_run, "file_store_for", refusing)
    jobs = write_jobs(tmp_path / "jobs", 2)
    db_url = f"sqlite:///{tmp_path / 'records.db'}"
    argv = ["run", "--jobs", str(jobs), "--store", S3, "--db-url", db_url]

    assert main([*argv, "--server", f"gpu0={url}"]) == 2

    out, err = capsys.readouterr()
    assert err == f"error: --store {S3}: NoSuchBucket: the bucket farm-bucket does not exist\n"
    assert chosen == [S3]  # the s3:// text as given, not a path that folded its //
    assert fake.stats["prompts"] == {}
