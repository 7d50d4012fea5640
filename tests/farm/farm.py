"""``Farm``: the bridge, the database host (PostgreSQL of its own, RabbitMQ behind a
forwarder), and the hosts a scenario adds; everything removed on exit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.farm.database import PrivatePostgres
from tests.farm.gpu import Fake, GpuHost
from tests.farm.host import Host, Proc
from tests.farm.net import Bridge, Netns, free_subnet
from tests.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[2]
RABBITMQ = ("127.0.0.1", 5672)  # the machine's broker, reached through the forwarder


class Farm:
    """Hosts on one machine (see ``tests/farm/__init__``). Use as a context manager::

        with Farm(tmp_path) as farm:
            gpu = farm.add_gpu_host("gpu1", fakes=2, prompt_seconds=0.1)
            orch = farm.add_host("orch", hostname="vm")
            run = orch.start(farm.python("comfy_assets.cli", "run", ...))

    ``folder``: logs and outputs (per host ``folder/<host name>/``). ``db_url`` /
    ``amqp_url``: as hosts reach PostgreSQL and RabbitMQ (over the bridge only);
    ``local_db_url`` / ``local_amqp_url``: the same from the test process. ``db_address``
    and ``amqp_address``: what ``Host.cut`` takes to cut a host from either. Every farm
    has its own bridge, subnet, names (``caf<id>...``) and PostgreSQL cluster, so farms
    may run side by side.
    """

    def __init__(self, folder: Path, *, durable_db: bool = False) -> None:
        self.folder = Path(folder)
        self.id = uuid.uuid4().hex[:4]
        self.durable_db = durable_db
        self.hosts: dict[str, Host] = {}
        self.gpu_hosts: list[GpuHost] = []
        self.queues: list[str] = []
        self._stack = contextlib.ExitStack()
        self._count = 0

    def __enter__(self) -> Farm:
        try:
            prefix = free_subnet()
            self.bridge = Bridge(f"caf{self.id}", prefix)
            self._stack.callback(self.bridge.delete)
            self.db_address = f"{prefix}.2"
            self.amqp_address = f"{prefix}.3"
            self.db = PrivatePostgres(self.db_address, durable=self.durable_db)
            self._stack.callback(self.db.close)
            self._amqp = TcpProxy(*RABBITMQ, listen_host=self.amqp_address)
            self._stack.enter_context(self._amqp.running())
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every host, delete namespaces, links, the queues, the database cluster and
        the bridge (idempotent; runs every step even when one fails)."""
        with contextlib.ExitStack() as stack:
            stack.push(lambda *e: self._stack.close())
            stack.callback(self._delete_queues)
            for host in list(self.hosts.values()):
                stack.callback(host.close)
            self.hosts.clear()

    @property
    def db_url(self) -> str:
        return self.db.url

    @property
    def local_db_url(self) -> str:
        return self.db.local_url

    @property
    def amqp_url(self) -> str:
        return f"amqp://guest:guest@{self.amqp_address}:{self._amqp.port}/"

    @property
    def local_amqp_url(self) -> str:
        return f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}/"

    def add_host(
        self, name: str, *, hostname: str | None = None, clock_offset_s: float = 0.0
    ) -> Host:
        """A new host ``name`` (its host name ``hostname``, by default ``name``; its clock
        ``clock_offset_s`` seconds off through faketime) on the bridge; see ``Host``."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists already")
        self._count += 1
        n = self._count
        if n > 200:
            raise ValueError("a farm has at most 200 hosts")
        netns = Netns(
            f"caf{self.id}-{name}",
            self.bridge,
            outer=f"caf{self.id}h{n}a",
            inner=f"caf{self.id}h{n}b",
            address=f"{self.bridge.prefix}.{9 + n}",
        )
        try:
            host = Host(
                name,
                netns,
                self.folder / name,
                hostname=hostname or name,
                clock_offset_s=clock_offset_s,
                cwd=ROOT,
                env=self._env(),
            )
        except BaseException:
            netns.delete()
            raise
        self.hosts[name] = host
        return host

    def add_gpu_host(
        self, name: str, *, fakes: int = 2, prompt_seconds: float = 0.1, script: str = ""
    ) -> GpuHost:
        """A host running ``fakes`` fake ComfyUI servers (``GpuHost``), once they listen."""
        gpu = GpuHost(self.add_host(name), fakes, prompt_seconds=prompt_seconds, script=script)
        self.gpu_hosts.append(gpu)
        return gpu

    @property
    def fakes(self) -> list[Fake]:
        return [f for g in self.gpu_hosts for f in g.fakes]

    def server_args(self) -> list[str]:
        """``--server NAME=URL`` for every fake of the farm."""
        return [a for f in self.fakes for a in ("--server", f.spec)]

    def queue(self, name: str) -> str:
        """A RabbitMQ queue name of this farm's own (``farm-<id>-<name>``), deleted with
        its dead-letter queue when the farm closes."""
        queue = f"farm-{self.id}-{name}"
        self.queues.append(queue)
        return queue

    def _delete_queues(self) -> None:
        if not self.queues:
            return
        from comfy_assets.service import broker

        async def delete() -> None:
            import aio_pika

            async with await aio_pika.connect(self.local_amqp_url, timeout=5) as connection:
                channel = await connection.channel()
                for q in self.queues:
                    for name in (q, broker.dead_queue_name(q)):
                        await channel.queue_delete(name)

        asyncio.run(delete())

    @staticmethod
    def python(module: str, *args: str) -> list[str]:
        """``python -m module args`` with this interpreter (the project's venv)."""
        return [sys.executable, "-m", module, *args]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("COMFY_ASSETS_")}
        env["PYTHONPATH"] = str(ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def restart_database(self) -> None:
        """Restart the database host's PostgreSQL (``PrivatePostgres.restart``)."""
        self.db.restart()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Every fake's ``/fake/stats``, by server name."""
        return {f.name: f.stats() for f in self.fakes}

    def queued(self) -> dict[str, list[str]]:
        """Every fake's prompts running or pending, by server name."""
        return {f.name: f.queued() for f in self.fakes}

    def wait(
        self,
        what: str,
        predicate: Any,
        timeout: float,
        poll_s: float = 0.05,
        watch: Sequence[Proc] = (),
    ) -> None:
        """Return once ``predicate()`` is true: a poll of what the farm shows, never a fixed
        sleep. TimeoutError naming ``what`` after ``timeout`` seconds, or as soon as a
        process of ``watch`` has exited (with its output)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            for proc in watch:
                if proc.returncode is not None:
                    raise TimeoutError(
                        f"{what}: {proc.name} exited {proc.returncode} first:\n"
                        f"{proc.text()[-3000:]}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout} s")
            time.sleep(poll_s)
