"""Private servers for the deployment-shape tests, and the fixtures that start them.

- ``live_uvicorn``: ``testproject.asgi`` under uvicorn (2 worker processes) on the test database.
- ``live_gunicorn_waiting`` / ``live_uvicorn_waiting``: the same with waiting on, as the docs
  show it (``tests/support/waiting_settings.py``), for the tests of waiting duplicates.
- ``asgi_live_server``: Django's ASGI handler under uvicorn in a thread of the test process,
  the ASGI counterpart of pytest-django's ``live_server``.
- ``live_user``: a committed user with a token, for tests that only talk to live servers;
  their module's database is flushed once at its end (``flush_after_module``).
- ``pgbouncer`` / ``live_pgbouncer``: a private PgBouncer in transaction pooling mode in front
  of the test database's server, and gunicorn whose ``DATABASE_URL`` goes through it.
- ``PostgresCluster``: a throw-away PostgreSQL cluster (Debian's binaries) and its streaming
  replica, for ``tests/scenarios/test_replica.py``.

Everything binds 127.0.0.1 on a free port and lives in a temporary directory, so nothing
here touches the machine's own services or another session's.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tests.conftest import ROOT, GunicornServer, TokenUser, die_with_parent, serve, stop

# apt-get may wait for the package lists and a mirror; a test session must not hang on it.
APT_TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def free_port_in(ports: range) -> int:
    """A free port of ``ports``: a session's own range, for a server it restarts."""
    return free_ports_in(ports, 1)[0]


def free_ports_in(ports: range, count: int) -> list[int]:
    """``count`` distinct free ports of ``ports``."""
    found: list[int] = []
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise AssertionError(f"no {count} free ports in {ports}")


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + quote(name)))


def database_name(url: str) -> str:
    return unquote(urlsplit(url).path.lstrip("/"))


def with_options(url: str, options: str) -> str:
    """``url`` with libpq ``options`` (``-c name=value``), which dj-database-url puts in
    ``OPTIONS``."""
    parts = urlsplit(url)
    query = "&".join(filter(None, [parts.query, "options=" + quote(options, safe="")]))
    return urlunsplit(parts._replace(query=query))


@contextlib.contextmanager
def private_database(
    test_database_url: str,
    suffix: str,
    migrate_env: Callable[[str], Mapping[str, str]],
    cleanup_in_background: Callable[[Callable[[], object]], None],
    *migrate_args: str,
) -> Iterator[str]:
    """A database of the test's own on the test database's server, migrated with the
    environment ``migrate_env(url)`` gives; its URL. Dropped in the background after the
    block (the drop waits for a checkpoint)."""
    name = database_name(test_database_url) + suffix
    server_url = with_database(test_database_url, "postgres")
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = with_database(test_database_url, name)
    try:
        migrate(migrate_env(url), *migrate_args)
        yield url
    finally:
        cleanup_in_background(partial(_execute, server_url, drop))


def count(url: str, query: str, *params: Any) -> int:
    """The number that ``query`` answers on the database at ``url``."""
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def _execute(url: str, statement: sql.Composable) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement)


def insert_token_user(url: str, username: str | None = None) -> tuple[int, str]:
    """A user with a DRF token, committed on the database at ``url``: (its id, the token)."""
    token = secrets.token_hex(20)
    # Its own connection: a test's transaction would hide the user from the servers.
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, "
            "email, is_staff, is_active, date_joined) "
            "VALUES ('!', false, %s, '', '', '', false, true, now()) RETURNING id",
            [username or f"live-{uuid.uuid4().hex[:12]}"],
        ).fetchone()
        assert row is not None
        conn.execute(
            "INSERT INTO authtoken_token (key, created, user_id) VALUES (%s, now(), %s)",
            [token, row[0]],
        )
    return row[0], token


def run_uvicorn(
    env: Mapping[str, str], *, workers: int = 2, startup_timeout: float = 120.0
) -> contextlib.AbstractContextManager[GunicornServer]:
    """Serve ``testproject.asgi`` with uvicorn's own process manager until the block ends
    (uvicorn restarts a worker that dies)."""

    def command(fd: int) -> list[str]:
        return [
            sys.executable, "-m", "uvicorn", "testproject.asgi:application",
            "--fd", str(fd),
            "--workers", str(workers),
            "--no-access-log",
            "--timeout-graceful-shutdown", "2",
        ]  # fmt: skip

    return serve("uvicorn", command, env, startup_timeout)


@pytest.fixture(scope="session")
def live_uvicorn(subprocess_env: dict[str, str]) -> Iterator[str]:
    """Base URL of ``testproject.asgi`` under uvicorn, 2 worker processes, on the test database."""
    with run_uvicorn(subprocess_env) as server:
        yield server.url


# The documented waiting setup (tests/support/waiting_settings.py) for a server of the given shape.
WAITING_SETTINGS = "tests.support.waiting_settings"


def waiting_env(*, max_waiters: int, threads: int | None = None) -> dict[str, str]:
    env = {"DJANGO_SETTINGS_MODULE": WAITING_SETTINGS, "WAITING_MAX_WAITERS": str(max_waiters)}
    if threads is not None:
        env["WAITING_SERVER_THREADS"] = str(threads)
    return env


@pytest.fixture(scope="module")
def live_gunicorn_waiting(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
) -> Iterator[str]:
    """Base URL of gunicorn, 2 workers x 4 threads, with waiting on as the docs show it (at
    most 2 requests of a process wait)."""
    with gunicorn_server(workers=2, threads=4, env=waiting_env(max_waiters=2, threads=4)) as server:
        yield server.url


@pytest.fixture(scope="module")
def live_uvicorn_waiting(subprocess_env: dict[str, str]) -> Iterator[str]:
    """Base URL of ``testproject.asgi`` under uvicorn (1 worker) with waiting on."""
    with run_uvicorn({**subprocess_env, **waiting_env(max_waiters=8)}, workers=1) as server:
        yield server.url


@dataclass(frozen=True)
class InProcessServer:
    url: str


@pytest.fixture(scope="session")
def asgi_live_server(django_db_setup: None) -> Iterator[InProcessServer]:
    """Django's ASGI handler under uvicorn in a thread of the test process: pytest-django's
    ``live_server`` for ASGI, for tests that coordinate with the views in-process (gates,
    call counters) and change settings with the ``settings`` fixture.

    Like ``live_server``, it reaches the database only while a test that allows it runs.
    """
    import uvicorn
    from django.core.asgi import get_asgi_application
    from django.db import connections

    # Each request runs its sync parts on a thread of its own, whose connection a
    # CONN_MAX_AGE would keep open after the thread is gone: 20 racing requests a test
    # then exhaust the server's max_connections (and get 503). Close them at request end.
    database = connections.settings["default"]
    kept_for = database.get("CONN_MAX_AGE")
    database["CONN_MAX_AGE"] = 0
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    config = uvicorn.Config(
        get_asgi_application(), lifespan="off", log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    # Outside the main thread uvicorn installs no signal handlers.
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name="asgi-live-server", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process uvicorn did not start")
        time.sleep(0.05)
    try:
        yield InProcessServer(f"http://127.0.0.1:{listener.getsockname()[1]}")
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()
        database["CONN_MAX_AGE"] = kept_for


@pytest.fixture(scope="module")
def flush_after_module(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Empty the test database once after the module, as a transactional test would."""
    yield
    from django.core.management import call_command

    with django_db_blocker.unblock():
        call_command("flush", verbosity=0, interactive=False)


@pytest.fixture
def live_user(db: None, flush_after_module: None, test_database_url: str) -> TokenUser:
    """A user with a DRF token, committed, for tests that only talk to live servers.

    The test itself runs in a transaction that is rolled back, like any ``db`` test, and
    reads what the servers commit (READ COMMITTED). What they commit stays until the end of
    the module (``flush_after_module``): the tests judge by fresh keys and fresh users, never
    by an empty table, and a flush after each test would cost about a second.
    """
    from django.contrib.auth.models import User

    user_id, token = insert_token_user(test_database_url)
    return TokenUser(User.objects.get(pk=user_id), token)


# ---------------------------------------------------------------------------------------
# PgBouncer


def find_pgbouncer() -> str:
    """Path of the ``pgbouncer`` binary, installing Debian's package when root can.

    Raises ``LookupError`` with the reason when there is none and none can be had.
    """
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/sbin")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise LookupError("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "pgbouncer"]
    deadline = time.monotonic() + APT_TIMEOUT
    # The package lists may be missing (a fresh image) or stale: update once, then retry.
    for step in (install, ["apt-get", "update", "-q"], install):
        try:
            done = subprocess.run(
                step, env=apt_env, capture_output=True, text=True, check=False,
                timeout=max(1.0, deadline - time.monotonic()),
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise LookupError(f"`{' '.join(step)}` took over {APT_TIMEOUT}s") from None
        if step is install and done.returncode == 0:
            break
    found = shutil.which("pgbouncer", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if not found:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise LookupError("apt-get install pgbouncer failed: " + " / ".join(tail))
    return found


def system_user_for(directory: Path | None) -> str | None:
    """Who a server we start should run as: nobody special unless we are root (PostgreSQL
    and PgBouncer refuse to run as root). Then the owner of the unix socket directory it
    must reach, or ``postgres``."""
    if os.geteuid() != 0:
        return None
    if directory is not None:
        owner = pwd.getpwuid(directory.stat().st_uid).pw_name
        if owner != "root":
            return owner
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise LookupError("running as root and there is no 'postgres' user to run as") from None
    return "postgres"


@dataclass(frozen=True)
class PgBouncer:
    """A running private PgBouncer: ``url(database)`` goes through it."""

    port: int
    process: subprocess.Popen[bytes]
    directory: Path

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{quote(database)}"

    def log_text(self) -> str:
        return (self.directory / "pgbouncer.log").read_text(errors="replace")

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console, as dicts."""
        # The admin console speaks only the simple query protocol.
        with psycopg.connect(
            self.url("pgbouncer"), autocommit=True, prepare_threshold=None, connect_timeout=5
        ) as conn:
            cursor = conn.cursor()
            cursor.execute(f"SHOW {what}".encode(), prepare=False)
            names = [column.name for column in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


@contextlib.contextmanager
def run_pgbouncer(
    server_url: str, *, pool_size: int = 4, **settings: str | float
) -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling mode in front of ``server_url``'s server.

    Every database name is passed through (``*``), as user ``postgres``, without a password:
    the machine's server and the embedded one trust local connections. ``settings`` are
    more lines of the ``[pgbouncer]`` section, such as ``query_wait_timeout=2``.
    """
    binary = find_pgbouncer()
    parts = urlsplit(server_url)
    # The embedded server's URL has its percent-encoded socket directory as the host, which
    # urlsplit's ``hostname`` would lower-case.
    netloc_host = unquote(parts.netloc.rpartition("@")[2])
    if netloc_host.startswith("/"):
        host, port, socket_dir = netloc_host, 5432, Path(netloc_host)
    else:
        host, port, socket_dir = parts.hostname or "127.0.0.1", parts.port or 5432, None
    user = system_user_for(socket_dir)
    directory = Path(tempfile.mkdtemp(prefix="idem-bouncer-"))
    listen = free_port()
    (directory / "userlist.txt").write_text('"postgres" ""\n')
    (directory / "pgbouncer.ini").write_text(
        "\n".join(
            [
                "[databases]",
                f"* = host={host} port={port} user=postgres",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {listen}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {directory / 'userlist.txt'}",
                "admin_users = postgres",
                "pool_mode = transaction",
                # Fewer server connections than clients: transactions from different
                # clients really do share server connections.
                f"default_pool_size = {pool_size}",
                "max_client_conn = 200",
                "ignore_startup_parameters = extra_float_digits,options",
                f"logfile = {directory / 'pgbouncer.log'}",
                f"pidfile = {directory / 'pgbouncer.pid'}",
                *(f"{name} = {value}" for name, value in settings.items()),
                "",
            ]
        )
    )
    if user is not None:
        shutil.chown(directory, user)
        for path in directory.iterdir():
            shutil.chown(path, user)
    process = subprocess.Popen(
        [binary, str(directory / "pgbouncer.ini")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        user=user,
        preexec_fn=die_with_parent,
    )
    bouncer = PgBouncer(listen, process, directory)
    try:
        deadline = time.monotonic() + 20
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"pgbouncer exited with {process.returncode}:\n{bouncer.log_text()}"
                )
            try:
                bouncer.show("VERSION")
                break
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not answer:\n{bouncer.log_text()}") from None
                time.sleep(0.1)
        yield bouncer
    finally:
        stop(process, signal.SIGTERM)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def pgbouncer(test_database_url: str) -> Iterator[PgBouncer]:
    """A private PgBouncer (transaction pooling) in front of the test database's server."""
    try:
        find_pgbouncer()
    except LookupError as exc:
        pytest.skip(f"no PgBouncer: {exc}")
    with run_pgbouncer(test_database_url) as bouncer:
        yield bouncer


@pytest.fixture(scope="session")
def live_pgbouncer(
    pgbouncer: PgBouncer,
    test_database_url: str,
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
) -> Iterator[str]:
    """Base URL of gunicorn (2 workers x 4 threads) whose database connections go through
    ``pgbouncer`` in transaction pooling mode, with waiting on as the docs show it (a waiting
    duplicate tries its claim again through the pool)."""
    env = {
        "DATABASE_URL": pgbouncer.url(database_name(test_database_url)),
        "DATABASE_POOLING": "transaction",
        **waiting_env(max_waiters=2, threads=4),
    }
    with gunicorn_server(workers=2, threads=4, env=env) as server:
        yield server.url


# ---------------------------------------------------------------------------------------
# PostgreSQL clusters of our own: a primary and its streaming replica


def postgres_bin() -> Path:
    """Directory of Debian's PostgreSQL server binaries (the newest installed)."""
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parent.parent.name),
    )
    if not candidates:
        raise LookupError("no PostgreSQL server binaries in /usr/lib/postgresql/*/bin")
    return Path(candidates[-1]).parent


@dataclass
class PostgresCluster:
    """A private cluster: its data directory, port and unix socket directory."""

    bin: Path
    pgdata: Path
    port: int
    user: str | None

    @property
    def socket_dir(self) -> Path:
        return self.pgdata.parent / f"{self.pgdata.name}-socket"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{quote(database)}"

    def connect(self, database: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(self.url(database), autocommit=True, connect_timeout=5)

    def run(self, program: str, *args: str, timeout: float = 120) -> None:
        """Run one of the cluster's binaries as its owner; RuntimeError carries the output."""
        with tempfile.TemporaryFile() as output:
            # A file, not a pipe: a server started by pg_ctl would inherit a pipe.
            done = subprocess.run(
                [str(self.bin / program), *args], user=self.user, stdout=output,
                stderr=output, stdin=subprocess.DEVNULL, timeout=timeout, check=False,
            )  # fmt: skip
            if done.returncode:
                output.seek(0)
                raise RuntimeError(f"{program} {' '.join(args)} failed:\n{output.read().decode()}")

    def start(self) -> None:
        self.socket_dir.mkdir(exist_ok=True)
        if self.user is not None:
            shutil.chown(self.socket_dir, self.user)
        self._drop_stale_socket_locks()
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.socket_dir}"
        try:
            # A standby is ready once it is consistent: on a busy machine that can take a
            # while; the wait guards against a hang, it is not a claim about speed.
            self.run("pg_ctl", "-w", "-t", "180", "-D", str(self.pgdata), "-o", options,
                     "-l", str(self.pgdata / "server.log"), "start", timeout=240)  # fmt: skip
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\nserver.log:\n{self.log_tail()}") from None

    def _drop_stale_socket_locks(self) -> None:
        """A killed server's socket lock names its PID, which stays taken while the process is
        a zombie no one has reaped yet (or once the PID is reused): PostgreSQL then refuses to
        start on that socket ("lock file ... already exists"), as a failover profile's new
        standby did. A lock whose PID is no running postgres is left over: removed."""
        import psutil

        for lock in self.socket_dir.glob(".s.PGSQL.*.lock"):
            try:
                pid = int(lock.read_text().split()[0])
                process = psutil.Process(pid)
                running = process.status() != psutil.STATUS_ZOMBIE and "postgres" in process.name()
            except (OSError, ValueError, IndexError, psutil.Error):
                running = False
            if not running:
                lock.unlink(missing_ok=True)

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.SubprocessError, OSError):
            self.run("pg_ctl", "-w", "-t", "30", "-D", str(self.pgdata), "-m", "immediate", "stop")

    def kill(self) -> None:
        """``kill -9`` of the server and every process of it at once: the machine died, so
        no backend answers after its postmaster, and nothing is shut down cleanly."""
        import psutil

        pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        postmaster = psutil.Process(pid)
        processes = [postmaster, *postmaster.children(recursive=True)]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(processes, timeout=10)

    def promote(self) -> None:
        """Promote a standby to primary, waiting until it accepts writes."""
        self.run("pg_ctl", "-w", "-t", "60", "-D", str(self.pgdata), "promote")

    @contextlib.contextmanager
    def django_connection(self, database: str, user: str = "postgres") -> Iterator[Any]:
        """A Django connection (the test database's settings) to ``database`` here as
        ``user``, for what takes one (the probe's facts); closed afterwards."""
        from django.db import connections
        from django.db.backends.postgresql.base import DatabaseWrapper

        settings = {
            **connections["default"].settings_dict,
            "NAME": database, "HOST": "127.0.0.1", "PORT": str(self.port),
            "USER": user, "PASSWORD": "", "OPTIONS": {},
        }  # fmt: skip
        wrapper = DatabaseWrapper(settings, alias=f"cluster-{self.port}")
        try:
            yield wrapper
        finally:
            wrapper.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = (self.pgdata / "server.log").read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


# Throw-away clusters: durability buys nothing and costs seconds.
FAST_CONF = "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"


@contextlib.contextmanager
def private_clusters(*ports: int | None) -> Iterator[list[PostgresCluster]]:
    """As many unstarted private clusters as ports given (None: a free one), in one
    temporary directory, stopped and removed afterwards."""
    bin_dir = postgres_bin()
    user = system_user_for(None)
    # Short paths: the unix socket lives next to the data directory.
    root = Path(tempfile.mkdtemp(prefix="idem-pg-"))
    if user is not None:
        shutil.chown(root, user)
    clusters = [
        PostgresCluster(bin_dir, root / f"pg{n}", port or free_port(), user)
        for n, port in enumerate(ports)
    ]
    try:
        yield clusters
    finally:
        for cluster in reversed(clusters):
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def initdb(cluster: PostgresCluster, conf: str) -> None:
    """Make ``cluster``'s data directory, with ``conf`` appended to its postgresql.conf
    (after ``FAST_CONF``, which it may override)."""
    cluster.run("initdb", "-D", str(cluster.pgdata), "-U", "postgres", "-A", "trust",
                "--no-sync", "-E", "UTF8", "--locale=C")  # fmt: skip
    with (cluster.pgdata / "postgresql.conf").open("a") as file:
        file.write(FAST_CONF + conf)


@contextlib.contextmanager
def logical_cluster(port: int | None = None) -> Iterator[PostgresCluster]:
    """A private running cluster with ``wal_level = logical``; removed afterwards."""
    with private_clusters(port) as (cluster,):
        # Commits flushed at once (cheap with fsync off): a slot decodes only flushed WAL,
        # and a test reads it right after its commits.
        initdb(
            cluster,
            "wal_level = logical\nmax_replication_slots = 4\nmax_wal_senders = 4\n"
            "synchronous_commit = on\n",
        )
        cluster.start()
        yield cluster


# A primary that streams to replicas. Commits are flushed locally before they are answered,
# as in production: what a failover can lose is then only what the replica had not received.
REPLICATION_CONF = (
    "wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\nsynchronous_commit = on\n"
)


def start_primary(cluster: PostgresCluster) -> None:
    initdb(cluster, REPLICATION_CONF)
    cluster.start()


def make_standby(
    primary: PostgresCluster,
    standby: PostgresCluster,
    synchronous: bool = False,
    through: int | None = None,
) -> None:
    """A streaming replica of ``primary`` in ``standby``'s (empty) data directory, made with
    ``pg_basebackup -R`` and started. ``synchronous``: from now on the primary answers a
    commit only once a standby has flushed it. Promoted, the standby waits for none.
    ``through``: the port it streams from (a proxy in front of the primary's)."""
    standby.run("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U",
                "postgres", "-D", str(standby.pgdata), "-R", "-X", "stream",
                "-c", "fast", "--no-sync")  # fmt: skip
    with (standby.pgdata / "postgresql.auto.conf").open("a") as file:
        file.write("synchronous_standby_names = ''\n")
        if through is not None:
            file.write(f"primary_conninfo = 'host=127.0.0.1 port={through} user=postgres'\n")
    standby.start()
    if synchronous:
        with primary.connect() as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("SELECT pg_reload_conf()")


@contextlib.contextmanager
def primary_and_replica() -> Iterator[tuple[PostgresCluster, PostgresCluster]]:
    """A private primary (``wal_level = replica``) and a streaming replica made from it with
    ``pg_basebackup -R``, each on its own free port; both removed afterwards."""
    with private_clusters(None, None) as (primary, replica):
        start_primary(primary)
        make_standby(primary, replica)
        yield primary, replica


def either_url(first: PostgresCluster, second: PostgresCluster, database: str) -> str:
    """A ``DATABASE_URL`` naming both servers in libpq's multi-host form: each connection
    goes to whichever of them accepts writes (``target_session_attrs=read-write``)."""
    hosts = "127.0.0.1,127.0.0.1"
    ports = f"{first.port},{second.port}"
    return (
        f"postgresql://postgres@/{quote(database)}?host={hosts}&port={ports}"
        "&target_session_attrs=read-write&connect_timeout=2"
    )


def token_user(cluster: PostgresCluster, database: str) -> tuple[str, int]:
    """A user ``alice`` with a DRF token, written straight into ``database`` (migrated);
    the token and the user's id."""
    token = secrets.token_hex(20)
    with cluster.connect(database) as conn:
        row = conn.execute(
            "INSERT INTO auth_user (password, is_superuser, username, first_name, "
            "last_name, email, is_staff, is_active, date_joined) "
            "VALUES ('!', false, 'alice', '', '', '', false, true, now()) RETURNING id"
        ).fetchone()
        assert row is not None
        conn.execute(
            "INSERT INTO authtoken_token (key, created, user_id) VALUES (%s, now(), %s)",
            [token, row[0]],
        )
    return token, int(row[0])


def migrate(env: Mapping[str, str], *args: str) -> None:
    """``manage.py migrate`` with the test settings in a child process."""
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v0", "--no-input", *args],
        cwd=ROOT, env={**env, "DJANGO_SETTINGS_MODULE": "tests.settings"},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"migrate {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
