"""Fixtures every test module may use.

Database: pytest-django's ``db`` / ``transactional_db`` on a real PostgreSQL, the server of
``DATABASE_URL`` or the embedded one (``testproject.database``).

Live servers: ``live_gunicorn`` (4 sync worker processes) and ``live_gunicorn_threads``
(2 workers x 8 threads) serve ``testproject.wsgi`` from the test database, for
``@pytest.mark.django_db(transaction=True)`` tests (what the test writes must be committed
for the server to see it). ``gunicorn_server(**options)`` starts another one, and
``subprocess_env`` is the environment any other child process (a Celery worker, a script)
needs to reach the test database.

Clients: ``make_token_user()`` makes a user with a DRF token; ``api_client`` is a DRF
``APIClient`` authenticated as ``token_user``, ``anon_client`` one without credentials.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
import requests
from hypothesis import settings as hypothesis_settings

ROOT = Path(__file__).resolve().parent.parent

# The other deployment shapes' servers (uvicorn, PgBouncer) and their fixtures.
pytest_plugins = ["tests.support.servers", "tests.support.partitions", "tests.support.browser"]

# Database round trips make per-example timings meaningless; CI also prints the blob to
# reproduce a failure.
hypothesis_settings.register_profile("dev", deadline=None)
hypothesis_settings.register_profile("ci", deadline=None, print_blob=True)
hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "dev")


# The modules that take the longest (servers, brokers, workers and clusters of their own, a
# docs build): dealt first. pytest-xdist's --dist loadfile hands modules out in collection order,
# so a long one dealt last keeps the run going on one worker while the others sit idle.
LONG_MODULES = (
    "tests/scenarios/",
    "tests/messaging/test_relay.py",
    "tests/messaging/test_nats",
    "tests/messaging/test_builtin_tasks.py",
    "tests/messaging/test_order.py",
    "tests/messaging/test_redrive.py",
    "tests/operators/test_checks.py",
    "tests/project/test_testproject.py",
    "tests/project/test_docs.py",
    "tests/project/test_ledger.py",
    "tests/storage/test_squashed_migration.py",
    "tests/storage/test_secret.py",
    "tests/test_spectacular.py",
)


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle, which it keeps within each part
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def later(item: pytest.Item) -> bool:
        path = Path(str(item.path)).relative_to(ROOT).as_posix()
        return not path.startswith(LONG_MODULES)

    items.sort(key=later)


def pytest_report_header(config: pytest.Config) -> list[str]:
    import psycopg
    import rest_framework
    from django.db import connection
    from pytest_django.plugin import blocking_manager_key

    # pytest-django prints the Django version; tox envs differ in these too.
    lines = [f"djangorestframework {rest_framework.VERSION}, psycopg {psycopg.__version__}"]
    try:
        with config.stash[blocking_manager_key].unblock():
            with connection.cursor() as cursor:
                cursor.execute("SELECT version()")
                (version,) = cursor.fetchone()
            connection.close()
        lines.append(f"database: {version}")
    except Exception as exc:  # the header must not hide the real failure
        lines.append(f"database: unreachable ({exc})")
    lines.append(f"database url: {_without_password(os.environ.get('DATABASE_URL', ''))}")
    with contextlib.suppress(ImportError):
        import celery
        from django.conf import settings

        beat = "with" if "django_celery_beat" in settings.INSTALLED_APPS else "without"
        lines.append(
            f"celery {celery.__version__} {beat} django-celery-beat, "
            f"broker {_without_password(settings.CELERY_BROKER_URL)}"
        )
    return lines


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """pytest-django's test database, minus any connection our child processes left open.

    A live server or worker killed mid-test may leave a backend behind, and DROP DATABASE
    refuses to run while one is connected.
    """
    yield
    from django.db import connection

    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


@pytest.fixture(autouse=True)
def shared_secret_read(request: pytest.FixtureRequest) -> None:
    """The app reads its secret once per process, as a server does before its first request:
    here, before the first test that uses the test database, so that no test that counts a
    request's statements sees that read. (A session that uses no test database, such as the
    reliability module alone, never sets it up, so nothing is read then.)"""
    if request.node.get_closest_marker("django_db") is None:
        return
    from django.db import connection

    from django_idempotency.engine.hashing import current_secret
    from django_idempotency.storage import secret

    request.getfixturevalue("django_db_setup")
    if ("default", str(connection.settings_dict["NAME"])) in secret._found:
        return
    with request.getfixturevalue("django_db_blocker").unblock():
        current_secret("default")


@pytest.fixture
def secret_unread() -> Iterator[None]:
    """The secrets this process has read are forgotten for the test, then put back."""
    from django_idempotency.storage import secret

    kept = dict(secret._found)
    secret.forget()
    yield
    secret.forget()
    secret._found.update(kept)


# Left as migrate made them when a transactional test's database is emptied (see below).
KEPT_BY_FLUSH = frozenset({"django_content_type", "auth_permission"})


def _flush_keeping_migrated_rows(self: Any) -> None:
    """``TransactionTestCase``'s teardown without its redundant part. Django's empties
    every table, content types and permissions too, and then emits ``post_migrate`` to make
    them again: the same rows after every transactional test, some 80 queries. Here those
    two tables keep the rows migrate made (no test writes them) and nothing is emitted
    (the library's own receiver only acts under IDEMPOTENCY_BEAT_REGISTER, which no test
    leaves on); every other table is emptied by the same statement as before."""
    from django.core.management.color import no_style
    from django.db import connections

    for name in self._databases_names(include_mirrors=False):
        connection = connections[name]
        tables = connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        statements = connection.ops.sql_flush(
            no_style(),
            [table for table in tables if table not in KEPT_BY_FLUSH],
            reset_sequences=False,
            allow_cascade=self.available_apps is not None,
        )
        connection.ops.execute_sql_flush(statements)


@pytest.fixture(scope="session", autouse=True)
def flush_keeping_migrated_rows() -> Iterator[None]:
    from django.test import TransactionTestCase

    original = TransactionTestCase._fixture_teardown
    TransactionTestCase._fixture_teardown = _flush_keeping_migrated_rows  # type: ignore[method-assign]
    yield
    TransactionTestCase._fixture_teardown = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def settings_restored() -> Iterator[None]:
    """A test leaves Django's settings as it found them. (pytest-django's ``settings``
    fixture used under an ``@override_settings`` decorator restores the decorator's
    settings at its teardown, so they stayed on for the modules that ran next.)"""
    from django.conf import settings

    before = settings._wrapped
    yield
    assert settings._wrapped is before, "this test left its settings overrides on"


@pytest.fixture(scope="session")
def cleanup_in_background() -> Iterator[Callable[[Callable[[], object]], None]]:
    """``cleanup_in_background(cleanup)`` runs ``cleanup`` in a thread of its own; the
    session waits for it, and raises what it raised, at its end. For a cleanup that only
    waits, such as DROP DATABASE, which waits for a checkpoint (4 s in a full run)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="cleanup")
    running: list[Future[object]] = []
    yield lambda cleanup: running.append(pool.submit(cleanup))
    pool.shutdown(wait=True)
    for cleanup in running:
        cleanup.result()


@pytest.fixture(scope="session")
def test_database_url(django_db_setup: None) -> str:
    """``DATABASE_URL`` of the test database (the server's URL with the test db name)."""
    from django.db import connection

    from testproject.database import database_url

    parts = urlsplit(database_url())
    return urlunsplit(parts._replace(path="/" + quote(connection.settings_dict["NAME"])))


@pytest.fixture(scope="session", autouse=True)
def broker_from_settings_only() -> Iterator[None]:
    """Celery lets ``CELERY_BROKER_URL`` in the environment override the broker of every
    app, the private ones of the tests that start their own Redis included, whose messages
    would then land on the shared broker (and run, crash switches and all, in a later
    test's worker). The settings have read it; this process's Celery apps must not."""
    url = os.environ.pop("CELERY_BROKER_URL", None)
    yield
    if url is not None:
        os.environ["CELERY_BROKER_URL"] = url


@pytest.fixture(autouse=True)
def fresh_error_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test counts its stored 4xx per principal (``IDEMPOTENCY_MAX_STORED_ERRORS_PER_MINUTE``)
    in one minute, whatever the clock does meanwhile (no test depends on a minute's end); the
    counts of a test's transaction roll back with it, so the suite's many anonymous 4xx do not
    carry over from test to test."""
    from django_idempotency.engine import keeping

    minute = time.time()
    monkeypatch.setattr(keeping, "error_budget", keeping._ErrorBudget(clock=lambda: minute))


@pytest.fixture(scope="session")
def subprocess_env(test_database_url: str) -> dict[str, str]:
    """Environment for a child process that must use the test project and test database."""
    from django.conf import settings

    return {
        **os.environ,
        # Taken out of this process's environment (below): children get it back.
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "DATABASE_URL": test_database_url,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }


@dataclass(frozen=True)
class GunicornServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


# coverage.py measures a child process whose environment holds this ([tool.coverage]
# run.patch = ["subprocess"]).
COVERAGE_CHILD = "COVERAGE_PROCESS_CONFIG"


def unmeasured(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a child process that coverage.py must not trace: one whose measurements
    are never saved, so that tracing it only slows it down. gunicorn's and uvicorn's
    workers and Celery's pool children are forked (or spawned) from a parent and save, if
    at all, under their parent's data file name, which the parent overwrites when it stops;
    processes ended with ``kill -9`` save nothing. Their parents only import what every
    test process imports."""
    return {name: value for name, value in env.items() if name != COVERAGE_CHILD}


@contextlib.contextmanager
def serve(
    what: str, command: Callable[[int], list[str]], env: Mapping[str, str], startup_timeout: float
) -> Iterator[GunicornServer]:
    """Run the server ``command(fd)`` on a free 127.0.0.1 port until the block ends (not
    traced by coverage.py: ``unmeasured``)."""
    # The parent binds the socket and hands the server the descriptor: no window in which
    # another process can take the port, and requests queue until a worker accepts.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    log_fd, log_name = tempfile.mkstemp(prefix=f"{what}-", suffix=".log")
    process = subprocess.Popen(
        command(listener.fileno()),
        cwd=ROOT,
        env=unmeasured(env),
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=log_fd,
        pass_fds=(listener.fileno(),),
        preexec_fn=die_with_parent,
    )
    os.close(log_fd)
    listener.close()
    server = GunicornServer(f"http://127.0.0.1:{port}", process, Path(log_name))
    try:
        wait_until_serving(server, what, deadline=time.monotonic() + startup_timeout)
        yield server
    finally:
        # Quick shutdown: the test is over, nothing in flight matters any more.
        stop(process)
        server.log.unlink(missing_ok=True)


@contextlib.contextmanager
def run_gunicorn(
    env: Mapping[str, str],
    *,
    workers: int = 4,
    threads: int = 1,
    # A guard against a server that never comes up, not a claim about speed: four test
    # workers starting servers side by side on a busy 2-core machine take their time.
    startup_timeout: float = 120.0,
    extra_args: tuple[str, ...] = (),
) -> Iterator[GunicornServer]:
    """Serve ``testproject.wsgi`` on a free 127.0.0.1 port until the block ends."""

    def command(fd: int) -> list[str]:
        return [
            sys.executable, "-m", "gunicorn", "testproject.wsgi",
            "--bind", f"fd://{fd}",
            "--workers", str(workers),
            "--worker-class", "gthread" if threads > 1 else "sync",
            "--threads", str(threads),
            # Workers are forked from a master that already imported Django: all of them
            # are ready at once, and one killed by a test is replaced at once.
            "--preload",
            "--timeout", "60",
            # No graceful period on SIGINT: a stopping test server has nothing in flight
            # worth waiting for (otherwise 2 s or more per server).
            "--graceful-timeout", "0",
            *extra_args,
        ]  # fmt: skip

    with serve("gunicorn", command, env, startup_timeout) as server:
        yield server


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def die_with_parent() -> None:
    """``preexec_fn`` for child processes: a test session killed outright (a CI timeout)
    must not leave servers or workers running behind it."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until_serving(server: GunicornServer, what: str, deadline: float) -> None:
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {server.process.returncode}:\n{server.log_text()}"
            )
        try:
            # Any answer will do: it proves a worker loaded Django and took the request.
            requests.get(f"{server.url}/admin/login/", timeout=1)
            return
        except requests.RequestException:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} did not answer at {server.url}:\n{server.log_text()}"
                ) from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def gunicorn_server(
    subprocess_env: dict[str, str],
) -> Callable[..., contextlib.AbstractContextManager[GunicornServer]]:
    """``with gunicorn_server(workers=2, threads=4) as server: server.url``."""

    def start(**options: Any) -> contextlib.AbstractContextManager[GunicornServer]:
        env = {**subprocess_env, **options.pop("env", {})}
        return run_gunicorn(env, **options)

    return start


@pytest.fixture(scope="session")
def live_gunicorn(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
) -> Iterator[str]:
    """Base URL of gunicorn with 4 sync worker processes on the test database."""
    with gunicorn_server(workers=4) as server:
        yield server.url


@pytest.fixture(scope="session")
def live_gunicorn_threads(
    gunicorn_server: Callable[..., contextlib.AbstractContextManager[GunicornServer]],
) -> Iterator[str]:
    """Base URL of gunicorn with 2 worker processes x 8 threads on the test database."""
    with gunicorn_server(workers=2, threads=8) as server:
        yield server.url


@dataclass(frozen=True)
class TokenUser:
    user: Any
    token: str

    @property
    def headers(self) -> dict[str, str]:
        """``Authorization`` header for ``requests`` against a live server."""
        return {"Authorization": f"Token {self.token}"}

    def client(self) -> Any:
        """A DRF ``APIClient`` that authenticates with this user's token."""
        from rest_framework.test import APIClient

        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {self.token}")
        return client


@pytest.fixture
def make_token_user(db: None) -> Callable[..., TokenUser]:
    """``make_token_user(username=None, **fields)``: a new user and their DRF token, made
    by ``tests.factories.TokenFactory``."""
    from tests.factories import TokenFactory

    def make(username: str | None = None, **fields: Any) -> TokenUser:
        if username is not None:
            fields["username"] = username
        token = TokenFactory(**{f"user__{name}": value for name, value in fields.items()})
        return TokenUser(token.user, token.key)

    return make


@pytest.fixture
def token_user(make_token_user: Callable[..., TokenUser]) -> TokenUser:
    return make_token_user()


@pytest.fixture
def api_client(token_user: TokenUser) -> Any:
    return token_user.client()


@pytest.fixture
def anon_client() -> Any:
    from rest_framework.test import APIClient

    return APIClient()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Any]:
    """A redis-server of the test's own on a free port (never the machine's), killed after."""
    from tests.support.chain_processes import RedisServer

    server = RedisServer.on_free_port(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def waiting_on_main_thread(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting on (2 s) for requests that the test client serves on this, the main thread,
    where a waiting request would hold a single-threaded server's only thread and so never
    waits: for tests of what a duplicate that waited reports. The cap has tests of its own
    (test_waiting)."""
    from django_idempotency.engine import waiting

    settings.IDEMPOTENCY_WAIT = timedelta(seconds=2)
    monkeypatch.setattr(waiting, "waiter_limit", lambda: 1)
