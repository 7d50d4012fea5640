"""The demo's child processes (fake servers, the Dagster daemon and UI): started in
process groups of their own, waited for, stopped whole, remembered for ``--stop``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project (data/, dagster_home/)

LISTENING = re.compile(r"fake_comfy listening on (http://\S+)")

PIDS_FILE = "pids.json"


class DemoFailed(Exception):
    """The demo could not show a complete, correct render; the message says why."""


def announce(text: str) -> None:
    """One progress line, flushed at once (the demo is watched live)."""
    print(f"[demo] {text}", flush=True)


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, indented, for failure reports."""
    if not path.exists():
        return "    (no log)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in text)


@dataclass
class Child:
    """A process the demo started (in its own session, so its whole group can be ended)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None


class Children:
    """Every process the demo started; stops them in reverse order."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.items: list[Child] = []

    def start(self, name: str, args: Sequence[str], env: dict[str, str]) -> Child:
        """Start ``args`` with stdout and stderr in ``logs/<name>.log``."""
        log = self.logs / f"{name}.log"
        with log.open("w") as handle:
            proc = subprocess.Popen(
                list(args),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        child = Child(name, proc, log)
        self.items.append(child)
        return child

    def stop(self) -> None:
        """SIGTERM each process group, then SIGKILL what is still there after 20 s."""
        for child in reversed(self.items):
            if child.alive():
                announce(f"stopping {child.name} (pid {child.proc.pid})")
                signal_group(child.proc.pid, signal.SIGTERM)
        for child in reversed(self.items):
            try:
                child.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                announce(f"{child.name} did not stop in 20 s; killing it")
                signal_group(child.proc.pid, signal.SIGKILL)
                child.proc.wait(timeout=10)
        self.items.clear()


def signal_group(pid: int, sig: signal.Signals) -> None:
    # Each child leads its own session: its group id is its pid. Gone already is fine.
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return


def wait_for_listening(child: Child, timeout_s: float = 60.0) -> str:
    """The URL a fake server prints when it is ready (read from its log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = LISTENING.search(child.log.read_text(errors="replace"))
        if match:
            return match.group(1)
        if not child.alive():
            raise DemoFailed(
                f"{child.name} exited with {child.proc.returncode}:\n{tail(child.log)}"
            )
        time.sleep(0.05)
    raise DemoFailed(
        f"{child.name} did not announce it was listening in {timeout_s:.0f} s:\n{tail(child.log)}"
    )


def port_free(port: int) -> bool:
    """True if nothing listens on 127.0.0.1:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on now on 127.0.0.1 (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_ui(
    url: str,
    child: Child,
    timeout_s: float = 90.0,
    *,
    what: str = "the web UI",
    path: str = "/server_info",
) -> None:
    """Wait until ``what`` answers at ``url + path`` (so the printed URL works)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise DemoFailed(f"{what} exited with {child.proc.returncode}:\n{tail(child.log)}")
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise DemoFailed(f"{what} did not answer at {url} in {timeout_s:.0f} s:\n{tail(child.log)}")


def save_pids(demo_dir: Path, children: Children) -> None:
    """Remember the kept processes so ``--stop`` can end them."""
    pids = {child.name: child.proc.pid for child in children.items}
    (demo_dir / PIDS_FILE).write_text(json.dumps(pids, indent=2) + "\n")


def stop_kept(demo_dir: Path) -> int:
    """End the process groups a ``--keep`` demo left running."""
    pids_file = demo_dir / PIDS_FILE
    if not pids_file.exists():
        announce(f"nothing to stop ({pids_file} does not exist)")
        return 0
    for name, pid in json.loads(pids_file.read_text()).items():
        announce(f"stopping {name} (process group {pid})")
        signal_group(int(pid), signal.SIGTERM)
    pids_file.unlink()
    return 0
