"""The farm's network: a bridge in the root namespace and, per host, a network namespace
joined to it by a veth pair. Thin wrappers over ``ip``; every call raises
``subprocess.CalledProcessError`` (with ip's stderr) when ip refuses.

Addresses: the farm takes a free ``10.77.X.0/24``; the root namespace holds ``.1`` (the
bridge), ``.2`` (the database host's PostgreSQL) and ``.3`` (its RabbitMQ); hosts get
``.10`` and up. ``.254`` is never given to anyone: a route through it leads nowhere, which
is how one host is cut from one address while the rest of the farm still reaches it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess

DEAD_END = 254  # the host number nobody has (see the module docstring)


def ip(*args: str) -> str:
    """Run ``ip ARGS``; returns its stdout. Raises CalledProcessError on failure."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(
            done.returncode, ["ip", *args], done.stdout, done.stderr
        )
    return done.stdout


def unavailable() -> str | None:
    """Why the farm cannot be built on this machine (not root, no ``ip``/``unshare``/
    ``nsenter``, network namespaces refused), or None when it can."""
    if os.geteuid() != 0:
        return "the farm needs root (network and PID namespaces, a bridge)"
    for tool in ("ip", "unshare", "nsenter", "runuser"):
        if shutil.which(tool) is None:
            return f"the farm needs `{tool}`, not found on PATH"
    name = f"cafprobe{os.getpid() % 100000}"
    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` refused: {e.stderr.strip()}"
    try:
        probe = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "unshare",
                "--pid",
                "--uts",
                "--fork",
                "--mount-proc",
                "true",
            ],
            capture_output=True,
            text=True,
        )
        if probe.returncode != 0:
            return f"`unshare --pid --uts --mount-proc` refused: {probe.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def free_subnet() -> str:
    """A ``10.77.X`` prefix no interface of the root namespace uses (X in 1..250)."""
    used = set(re.findall(r"inet 10\.77\.(\d+)\.", ip("-4", "addr")))
    free = [x for x in range(1, 251) if str(x) not in used]
    if not free:
        raise RuntimeError("every 10.77.X.0/24 is in use by other farms")
    return f"10.77.{random.choice(free)}"


class Bridge:
    """The farm's bridge ``name`` with ``prefix.1``, ``.2`` and ``.3``; ``delete()`` removes
    it (idempotent)."""

    def __init__(self, name: str, prefix: str) -> None:
        self.name = name
        self.prefix = prefix
        ip("link", "add", name, "type", "bridge")
        try:
            for n in (1, 2, 3):
                ip("addr", "add", f"{prefix}.{n}/24", "dev", name)
            ip("link", "set", name, "up")
        except BaseException:
            self.delete()
            raise

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.name], capture_output=True)


class Netns:
    """A network namespace ``name`` joined to ``bridge`` by the veth pair ``outer`` (on the
    bridge) / ``inner`` (in the namespace, address ``address``/24), loopback up."""

    def __init__(self, name: str, bridge: Bridge, outer: str, inner: str, address: str) -> None:
        self.name = name
        self.outer = outer
        self.inner = inner
        self.address = address
        self.bridge = bridge
        ip("netns", "add", name)
        try:
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            ip("link", "set", inner, "netns", name)
            ip("link", "set", outer, "master", bridge.name, "up")
            ip("-n", name, "addr", "add", f"{address}/24", "dev", inner)
            ip("-n", name, "link", "set", inner, "up")
            ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.delete()
            raise

    def link(self, up: bool) -> None:
        """The host's cable: down, nothing reaches it and it reaches nothing (silently: the
        packets are lost, connections hang as in a real partition); up again, as it was."""
        ip("link", "set", self.outer, "up" if up else "down")

    def cut(self, address: str) -> None:
        """Send this namespace's packets for ``address`` into the void (a route through a
        neighbour nobody has): established connections hang, new ones time out; every
        other address is still reached."""
        ip(
            "-n",
            self.name,
            "route",
            "replace",
            f"{address}/32",
            "via",
            f"{self.bridge.prefix}.{DEAD_END}",
        )

    def heal(self, address: str) -> None:
        """Undo ``cut(address)`` (nothing when it was not cut)."""
        subprocess.run(
            ["ip", "-n", self.name, "route", "del", f"{address}/32"], capture_output=True
        )

    def delete(self) -> None:
        """Remove the namespace and the veth pair (idempotent)."""
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
