"""The database host's PostgreSQL: a cluster of the farm's own (``initdb`` in a temporary
folder), so that restarting it, as a database host reboots, touches no other test or
process of the machine. It listens on 127.0.0.1 (the test's own reads) and on the farm's
database address on the bridge (the hosts'), never elsewhere.
"""

from __future__ import annotations

import glob
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa


class DatabaseError(RuntimeError):
    """PostgreSQL's tools failed (their output is in the message)."""


def _bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` with ``initdb``, or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            float(Path(p).parent.parent.name)
            if Path(p).parent.parent.name.replace(".", "").isdigit()
            else 0.0
        ),
    )
    return Path(found[-1]).parent if found else None


def unavailable() -> str | None:
    """Why no private PostgreSQL cluster can be made here, or None."""
    if _bin_dir() is None:
        return "PostgreSQL's server binaries (initdb, pg_ctl) are not installed"
    if shutil.which("runuser") is None:
        return "runuser is missing (PostgreSQL refuses to run as root)"
    try:
        subprocess.run(["id", "postgres"], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        return "no `postgres` user to run PostgreSQL as"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PrivatePostgres:
    """A PostgreSQL cluster of the farm's own (see the module docstring).

    ``PrivatePostgres(address)`` makes and starts it (listening on 127.0.0.1 and
    ``address``, port ``port``), with one database, ``farm``. ``local_url``: the URL the
    test process uses; ``url``: the one hosts use (over the bridge). ``restart()`` is a
    fast restart (every connection dropped, the server back once it accepts connections);
    ``close()`` stops it at once and removes its folder. ``durable=False`` (the default)
    runs it with fsync off: its data does not have to survive the machine. ``database``:
    the name of its one database; ``preload``: server libraries to preload (such as
    ``pg_stat_statements``, for a bench that counts statements).
    """

    def __init__(
        self,
        address: str,
        *,
        durable: bool = False,
        database: str = "farm",
        preload: Sequence[str] = (),
    ) -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise DatabaseError(unavailable() or "no PostgreSQL")
        self.bin_dir = bin_dir
        self.address = address
        self.database = database
        self.port = _free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="cafarm-pg-"))
        shutil.chown(self.folder, "postgres", "postgres")
        self.data = self.folder / "data"
        options = [
            f"-c listen_addresses=127.0.0.1,{address}",
            f"-p {self.port}",
            f"-k {self.folder}",
            "-c max_connections=300",
        ]
        if preload:
            options.append(f"-c shared_preload_libraries={','.join(preload)}")
        if not durable:
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        self._options = " ".join(options)
        try:
            self._pg(
                "initdb",
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "--locale=C",
                "-E",
                "UTF8",
            )
            # Hosts come over the bridge (its /24), as trusted as the loopback.
            subnet = address.rsplit(".", 1)[0] + ".0/24"
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {subnet} trust\n")
            self._ctl("start", "-l", str(self.folder / "server.log"))
            engine = sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{database}"'))
            engine.dispose()
        except BaseException:
            self.close()
            raise

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def local_url(self) -> str:
        """Its database from the root namespace (the test process)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.database}"

    @property
    def url(self) -> str:
        """Its database from a host of the farm (over the bridge)."""
        return f"postgresql+psycopg://postgres@{self.address}:{self.port}/{self.database}"

    def _pg(self, tool: str, *args: str) -> str:
        done = subprocess.run(
            ["runuser", "-u", "postgres", "--", str(self.bin_dir / tool), *args],
            capture_output=True,
            text=True,
            cwd=self.folder,
        )
        if done.returncode != 0:
            raise DatabaseError(
                f"{tool} {' '.join(args)}: exit {done.returncode}\n"
                f"{done.stdout}{done.stderr}{self.server_log()}"
            )
        return done.stdout

    def _ctl(self, action: str, *args: str) -> None:
        self._pg(
            "pg_ctl", "-D", str(self.data), "-o", self._options, "-w", "-t", "60", *args, action
        )

    def server_log(self) -> str:
        """The server's own log so far (empty when there is none)."""
        try:
            return (self.folder / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def restart(self) -> None:
        """Restart the server (fast: sessions are ended, then it starts again); returns
        once it accepts connections."""
        self._ctl("restart", "-m", "fast", "-l", str(self.folder / "server.log"))

    def stop(self) -> None:
        """Stop it (fast): the database host is down until ``start()``."""
        self._ctl("stop", "-m", "fast")

    def start(self) -> None:
        self._ctl("start", "-l", str(self.folder / "server.log"))

    def close(self) -> None:
        """Stop it at once (if running) and remove its folder (idempotent)."""
        if (self.data / "postmaster.pid").exists():
            subprocess.run(
                [
                    "runuser",
                    "-u",
                    "postgres",
                    "--",
                    str(self.bin_dir / "pg_ctl"),
                    "-D",
                    str(self.data),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
                capture_output=True,
            )
        shutil.rmtree(self.folder, ignore_errors=True)
