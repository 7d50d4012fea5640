"""Helpers for tests that run comfy-assets as a process: the command, its log, a PostgreSQL
behind a proxy the test cuts (``TcpProxy``), a small disk that fills (``SmallDisk``; the
fixtures ``db_proxy`` and ``small_disk`` are in conftest)."""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa

from comfy_assets.comfy.servers import ServerSpec
from tests.support import ROOT
from tests.tcp_proxy import TcpProxy

# Tiny delays and polls, so a run ends quickly without sleeping.
FAST = ["--base-delay-s", "0.01", "--max-delay-s", "0.05", "--no-jitter", "--poll-s", "0.05"]


def command(*args: object) -> list[str]:
    """``python -m comfy_assets.cli ARGS`` (paths and numbers as text)."""
    return [sys.executable, "-m", "comfy_assets.cli", *(str(a) for a in args)]


def worker_command(
    rabbitmq: str, queue: str, servers: Sequence[ServerSpec], store: object, *extra: object
) -> list[str]:
    """``comfy-assets worker`` on ``queue`` of the RabbitMQ at ``rabbitmq``, over ``servers``
    (each ``--server name=url``), its store in the folder ``store``; ``extra`` after."""
    each_server = [a for s in servers for a in ("--server", f"{s.name}={s.url}")]
    return command(
        "worker", "--rabbitmq", rabbitmq, "--queue", queue, *each_server, "--store", store, *extra
    )


async def start(args: list[str], log: Path) -> asyncio.subprocess.Process:
    """Start ``args`` with stdout and stderr both in ``log`` (a file: nobody has to read
    it while the process runs)."""
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(*args, cwd=ROOT, stdout=out, stderr=out)


def ended_cleanly(log: Path, code: int, expected: int = 0) -> str:
    """The text of a process's ``log``, once asserted that it exited ``expected`` (its
    ``code``) without a traceback."""
    text = log.read_text()
    assert code == expected, text
    assert "Traceback" not in text
    return text


async def stop(proc: asyncio.subprocess.Process) -> None:
    """Kill ``proc`` if it still runs (a test's cleanup after a failure)."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


def via(proxy: TcpProxy, db_url: str) -> str:
    """``db_url`` reached through ``proxy``."""
    url = sa.make_url(db_url).set(host="127.0.0.1", port=proxy.port)
    return url.render_as_string(hide_password=False)


class SmallDisk:
    """A 2 MiB tmpfs at ``path``. ``fill(leave)`` writes a file that leaves ``leave``
    bytes free; ``free()`` deletes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    def fill(self, leave: int) -> None:
        free = shutil.disk_usage(self.path).free
        with self.filler.open("wb") as f:
            f.write(b"\0" * max(0, free - leave))

    def free(self) -> None:
        self.filler.unlink()
