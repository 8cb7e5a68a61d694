"""A real PostgreSQL server on loopback for the lake's catalog (collector/store/lake.py): Debian's
`postgresql` package (`make test` installs it where it is missing), its server started from a fresh
data directory by initdb and pg_ctl, as the `postgres` user when the tests run as root (the server
refuses to run as root), stopped at the end. Each lake gets a database of its own (`createdb`)."""

import glob
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest


def binaries() -> Path | None:
    """The directory of the newest installed PostgreSQL's programs, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


@dataclass
class Server:
    bin: Path
    socket_dir: Path
    port: int
    user: str

    def _run(self, program: str, *args: str) -> None:
        command = [str(self.bin / program), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def database(self, name: str) -> str:
        """A new, empty database: its libpq connection string."""
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, name)
        return f"host=127.0.0.1 port={self.port} dbname={name} user={self.user}"

    def execute(self, database: str, sql: str) -> None:
        """Run `sql` in `database` as its owner (psql, stopping at the first error)."""
        self._run(
            "psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-d", database,
            "-v", "ON_ERROR_STOP=1", "-c", sql,
        )  # fmt: skip


def start(port: int) -> Server:
    """A PostgreSQL server of its own in a new directory (outside pytest's, which the `postgres` user
    may not enter), listening on 127.0.0.1:`port` alone; skips the test where PostgreSQL is not
    installed."""
    bin_dir = binaries()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (Debian's postgresql package; `make test` installs it as root)")
    user = "postgres" if os.geteuid() == 0 else os.environ.get("USER", "postgres")
    directory = Path(tempfile.mkdtemp(prefix="rankwatch-postgres-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres")
    server = Server(bin_dir, directory, port, user)
    server._run("initdb", "-D", str(directory / "data"), "--auth=trust", "-U", user, "--no-sync")
    server._run(
        "pg_ctl",
        "-D",
        str(directory / "data"),
        "-w",
        "-l",
        str(directory / "server.log"),
        "-o",
        f"-k {directory} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
        "start",
    )
    return server


def stop(server: Server) -> None:
    server._run("pg_ctl", "-D", str(server.socket_dir / "data"), "-m", "immediate", "stop")
    shutil.rmtree(server.socket_dir, ignore_errors=True)
