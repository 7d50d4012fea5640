"""One database per store: the first object store to open a database records its
location, and another prefix, or a folder store, opening that database is refused in one
line naming both locations, with nothing of its own recorded (SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from comfy_assets.store import OtherStoresDatabase, Store
from comfy_assets.store.files import FolderFileStore

A = "s3://renders/A"
B = "s3://renders/B"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'records.db'}"
    return str(request.getfixturevalue("own_pg_url"))


def opened(location: str | Path, db_url: str | None, tmp_path: Path) -> Store:
    # The files are a folder's: these tests are about the database, not the bucket.
    return Store(location, db_url, file_store=FolderFileStore(tmp_path / "files"))


def recorded(db_url: str) -> list[tuple[int, str]]:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text("SELECT id, location FROM comfy_store"))]
    finally:
        engine.dispose()


def test_a_second_prefix_on_one_database_is_refused_naming_both(
    db_url: str, tmp_path: Path
) -> None:
    opened(A, db_url, tmp_path).close()

    with pytest.raises(OtherStoresDatabase) as refused:
        opened(B, db_url, tmp_path)

    assert str(refused.value) == (
        f"the database at --db-url holds the records of the store {A}, not {B}: "
        "one database per store"
    )
    assert recorded(db_url) == [(1, A)]


def test_the_same_location_opens_again_with_or_without_a_trailing_slash(
    db_url: str, tmp_path: Path
) -> None:
    opened(A, db_url, tmp_path).close()
    opened(A, db_url, tmp_path).close()
    with opened(A + "/", db_url, tmp_path) as store:
        store.ping()

    assert recorded(db_url) == [(1, A)]


def test_a_folder_store_on_an_object_stores_database_is_refused(
    db_url: str, tmp_path: Path
) -> None:
    opened(A, db_url, tmp_path).close()
    folder = tmp_path / "folder-store"

    with pytest.raises(OtherStoresDatabase, match=f"store {A}, not {folder}: one database"):
        opened(folder, db_url, tmp_path)


def test_folder_stores_record_nothing_and_the_first_object_store_takes_the_database(
    db_url: str, tmp_path: Path
) -> None:
    opened(tmp_path / "here", db_url, tmp_path).close()
    opened(tmp_path / "mounted-elsewhere", db_url, tmp_path).close()
    assert recorded(db_url) == []

    opened(B, db_url, tmp_path).close()

    assert recorded(db_url) == [(1, B)]
    with pytest.raises(OtherStoresDatabase):
        opened(A, db_url, tmp_path)


def test_a_databases_own_folder_refuses_it_once_an_object_store_took_it(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    opened(folder, None, tmp_path).close()
    opened(A, f"sqlite:///{folder / 'store.db'}", tmp_path).close()

    with pytest.raises(OtherStoresDatabase) as refused:
        opened(folder, None, tmp_path)

    assert str(refused.value) == (
        f"the database {folder / 'store.db'} holds the records of the store {A}, not "
        f"{folder}: one database per store"
    )
