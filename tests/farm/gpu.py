"""GPU hosts: a host running fake ComfyUI servers (``python -m fake_comfy``) on its bridge
address, and what the invariants read from them (``/fake/stats``, ``/queue``) over the
bridge from the root namespace."""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.farm.host import Host, Proc

FIRST_PORT = 8200
LISTEN_TIMEOUT_S = 30.0


@dataclass
class Fake:
    """One fake server: ``name`` (as ``--server NAME=URL`` gives it), ``url`` (over the
    bridge), its process and output folder."""

    name: str
    url: str
    proc: Proc
    output_dir: Path

    @property
    def spec(self) -> str:
        """``NAME=URL``, the ``--server`` of ``comfy-assets run`` and ``worker``."""
        return f"{self.name}={self.url}"

    def get(self, path: str, timeout: float = 5.0) -> Any:
        """GET ``path`` of the fake, as JSON. Raises OSError when unreachable."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as answer:
            return json.load(answer)

    def stats(self) -> dict[str, Any]:
        """Its own records (``/fake/stats``: prompts, runs, posts, ...)."""
        return self.get("/fake/stats")

    def queued(self) -> list[str]:
        """prompt_ids running or pending there (``/queue``)."""
        queue = self.get("/queue")
        return [item[1] for key in ("queue_running", "queue_pending") for item in queue[key]]


class GpuHost:
    """A host with ``count`` fakes named ``<host name>s<i>`` on ports 8200, 8201, ...
    (``Farm.add_gpu_host``). ``prompt_seconds`` is per node (the image workflow has four);
    ``script`` is each fake's ``--script``."""

    def __init__(self, host: Host, count: int, *, prompt_seconds: float, script: str = "") -> None:
        self.host = host
        self.fakes: list[Fake] = []
        for i in range(count):
            port = FIRST_PORT + i
            out = host.folder / f"out{i}"
            cmd = [
                sys.executable,
                "-m",
                "fake_comfy",
                "--host",
                host.address,
                "--port",
                str(port),
                "--prompt-seconds",
                str(prompt_seconds),
                "--output-dir",
                str(out),
            ]
            if script:
                cmd += ["--script", script]
            proc = host.start(cmd, name=f"fake{i}")
            self.fakes.append(Fake(f"{host.name}s{i}", f"http://{host.address}:{port}", proc, out))
        for fake in self.fakes:
            fake.proc.wait_for("fake_comfy listening on", LISTEN_TIMEOUT_S)

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def specs(self) -> list[str]:
        return [f.spec for f in self.fakes]

    def link(self, up: bool) -> None:
        self.host.link(up)
