"""A host of the farm: its own network namespace (``net.Netns``), and its own PID, UTS and
mount namespaces held by an init process (``sleep``, pid 1 in there) whose host name is
the host's. Processes start inside all four with ``nsenter``; killing the init kills
every process of the host at once, as a power cut would.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.farm.net import Netns

START_TIMEOUT_S = 10.0


NO_FAKETIME = "libfaketime (apt-get install faketime)"


def libfaketime() -> str | None:
    """The path of libfaketime (its multithreaded build), or None when not installed."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    return found[0] if found else None


def clock_env(offset_s: float) -> dict[str, str]:
    """The environment that sets a process's wall clock ``offset_s`` seconds off:
    libfaketime preloaded (not the ``faketime`` wrapper, whose shared semaphore is named
    by its pid, and pids repeat across the hosts' PID namespaces). Only the wall clock is
    off, as on a host whose clock was set wrong: its monotonic clock (timeouts, the
    waits of threads) runs as any other's."""
    return {
        "LD_PRELOAD": libfaketime() or "",
        "FAKETIME": f"{offset_s:+g}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


class HostError(RuntimeError):
    """A host or one of its processes did not start."""


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ns_pid(pid: int) -> int | None:
    """``pid``'s number inside its innermost PID namespace (the last NSpid of its status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except OSError:
        return None
    return None


class Proc:
    """A process of a host: ``nsenter`` (``popen``, in the root namespaces) and its child,
    the command, inside the host. Its stdout and stderr go to ``log`` (a file)."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int | None:
        """The command's pid in the root namespace (None once it is gone)."""
        children = _children(self.popen.pid)
        return children[0] if children else None

    @property
    def ns_pid(self) -> int | None:
        """The command's pid as its host sees it (2, 3, ... : its init is 1)."""
        pid = self.pid
        return None if pid is None else _ns_pid(pid)

    def text(self) -> str:
        """Everything it printed so far (stdout and stderr, interleaved)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command (not to nsenter, which passes nothing on)."""
        pid = self.pid
        if pid is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status (nsenter's, which is the command's; 128+N for signal N).
        Raises subprocess.TimeoutExpired."""
        code = self.popen.wait(timeout)
        return code

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait_for(self, text: str, timeout: float) -> None:
        """Return once ``text`` is in its output; HostError when it exits first or after
        ``timeout`` seconds (a polling loop: the output is a file)."""
        deadline = time.monotonic() + timeout
        while text not in self.text():
            if self.popen.poll() is not None:
                raise HostError(
                    f"{self.name} exited {self.popen.returncode} before printing "
                    f"{text!r}:\n{self.text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise HostError(
                    f"{self.name} did not print {text!r} within {timeout} s:\n{self.text()[-3000:]}"
                )
            time.sleep(0.05)


class Host:
    """One machine of the farm (see the module docstring). Built by ``Farm.add_host``.

    ``name``: the farm's name for it; ``hostname``: what ``socket.gethostname()`` says in
    it (two hosts may share one); ``address``: its IP on the bridge; ``clock_offset_s``:
    its processes run under ``faketime`` that many seconds ahead (negative: behind).
    """

    def __init__(
        self,
        name: str,
        netns: Netns,
        folder: Path,
        *,
        hostname: str,
        clock_offset_s: float = 0.0,
        cwd: Path,
        env: Mapping[str, str],
    ) -> None:
        self.name = name
        self.netns = netns
        self.address = netns.address
        self.hostname = hostname
        self.folder = folder
        self.clock_offset_s = clock_offset_s
        self.cwd = cwd
        self.env = dict(env)
        self.procs: list[Proc] = []
        self.alive = False
        folder.mkdir(parents=True, exist_ok=True)
        if clock_offset_s and libfaketime() is None:
            raise HostError(f"a host with its clock off needs {NO_FAKETIME}")
        self._init = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                netns.name,
                "unshare",
                "--pid",
                "--uts",
                "--fork",
                "--mount-proc",
                "sh",
                "-c",
                'hostname "$0" && exec sleep infinity',
                hostname,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.init_pid = self._wait_init()
        self.alive = True

    def _wait_init(self) -> int:
        """The root-namespace pid of the host's init, once it runs ``sleep`` (its host name
        is set by then)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for child in _children(self._init.pid):
                if _comm(child) == "sleep":
                    return child
            if self._init.poll() is not None:
                err = self._init.stderr.read().decode() if self._init.stderr else ""
                raise HostError(f"host {self.name} did not start: {err.strip()}")
            time.sleep(0.01)
        raise HostError(f"host {self.name} did not start within {START_TIMEOUT_S} s")

    def start(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        name: str | None = None,
    ) -> Proc:
        """Start ``cmd`` inside the host (its network, PID, UTS and mount namespaces; under
        faketime when the host's clock is off), in ``cwd`` with the farm's environment plus
        ``env``; its output goes to ``<host folder>/<name>.log``. Returns at once."""
        if not self.alive:
            raise HostError(f"host {self.name} is down (killed)")
        name = name or f"{Path(cmd[0]).name}-{len(self.procs)}"
        log = self.folder / f"{name}.log"
        clock = clock_env(self.clock_offset_s) if self.clock_offset_s else {}
        argv = [
            "nsenter",
            "--target",
            str(self.init_pid),
            "--net",
            "--pid",
            "--uts",
            "--mount",
            f"--wd={self.cwd}",
            *cmd,
        ]
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                env={**self.env, **clock, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(f"{self.name}/{name}", popen, log)
        self.procs.append(proc)
        return proc

    def link(self, up: bool) -> None:
        """Plug (``True``) or unplug (``False``) the host's cable (``Netns.link``)."""
        self.netns.link(up)

    def cut(self, address: str) -> None:
        """Lose every packet this host sends to ``address``; the rest of the network stays
        (``Netns.cut``). ``heal(address)`` undoes it."""
        self.netns.cut(address)

    def heal(self, address: str) -> None:
        self.netns.heal(address)

    def kill(self) -> None:
        """SIGKILL every process of the host at once (its PID namespace's init: the kernel
        kills everything inside), as a power cut; waits until they are gone. The network
        namespace stays (a new host takes a new one)."""
        if not self.alive:
            return
        self.alive = False
        try:
            os.kill(self.init_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._init.wait(START_TIMEOUT_S)
        for proc in self.procs:
            try:
                proc.popen.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def close(self) -> None:
        """Kill the host (if alive) and remove its network namespace and veth (idempotent)."""
        try:
            self.kill()
        finally:
            self.netns.delete()
