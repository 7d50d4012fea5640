"""``S3FileStore.open_object``: a job line's ``s3://BUCKET/KEY`` input read from the
store's endpoint with its credentials, against a real SeaweedFS."""

from __future__ import annotations

import pytest

from comfy_assets.store.files import FileStoreRefused, S3FileStore
from tests.s3_server import S3Server


def test_an_object_of_any_bucket_of_the_endpoint_is_read_whole(
    s3_store: S3FileStore, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    data = bytes(range(256)) * 5000  # more than the reader's first chunk
    status, _ = s3_endpoint.request("PUT", s3_bucket, "inputs/face.png", body=data)
    assert status == 200

    with s3_store.open_object(f"s3://{s3_bucket}/inputs/face.png") as f:
        assert f.read() == data


def test_a_missing_object_is_not_found_and_a_bucket_alone_refused(
    s3_store: S3FileStore, s3_bucket: str
) -> None:
    with pytest.raises(FileNotFoundError, match="no object s3://"):
        s3_store.open_object(f"s3://{s3_bucket}/inputs/none.png")
    with pytest.raises(FileStoreRefused, match="names a bucket, not an object"):
        s3_store.open_object(f"s3://{s3_bucket}")
    with pytest.raises(FileStoreRefused):
        s3_store.open_object("http://example.invalid/a.png")
