"""The testproject as the run serves it: migrated, with principals, under gunicorn."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import requests

from tests.conftest import ROOT, GunicornServer, run_gunicorn, unmeasured
from tests.reliability.client import Principal
from tests.reliability.postgres import APP_NAME, MAINTENANCE_NAME, Database
from tests.reliability.profiles import Profile, ServerShape
from tests.support.servers import run_pgbouncer

# The demo users' public tokens (``manage.py seed_demo``), used as two of the principals.
DEMO_USERS = {"alice": "a" * 40, "bob": "b" * 40}

CREATE_USERS = """
import io, json, os
from django.contrib.auth import get_user_model
from django.core.management import call_command
from rest_framework.authtoken.models import Token

call_command("migrate", interactive=False, verbosity=0)
call_command("seed_demo", stdout=io.StringIO())
User = get_user_model()
for spec in json.loads(os.environ["RELIABILITY_USERS"]):
    staff = spec["password"] is not None
    user = User.objects.create_user(
        spec["username"], password=spec["password"], is_staff=staff, is_superuser=staff
    )
    Token.objects.create(user=user, key=spec["token"])
"""


@dataclass(frozen=True)
class User:
    username: str
    token: str
    password: str | None = None

    def token_principal(self) -> Principal:
        return Principal(
            self.username, "token", {"Authorization": f"Token {self.token}"}, (self.token,)
        )


def django_env(
    database: Database, app_name: str = APP_NAME, settings: str = "testproject.settings"
) -> dict[str, str]:
    """The environment of every process that runs the testproject for the run."""
    env = {
        **os.environ,
        "DATABASE_URL": database.url,
        "DJANGO_SETTINGS_MODULE": settings,
        "PAYMENTS_FAULTS_ENABLED": "1",
        # Everything the library logs, so the leak check sees all of it.
        "IDEMPOTENCY_LOG_LEVEL": "DEBUG",
        # libpq reads it: the app's backends are the ones a connection cut targets.
        "PGAPPNAME": app_name,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DJANGO_DEBUG", None)
    return env


def manage(
    database: Database, *args: str, env: dict[str, str] | None = None, traced: bool = True
) -> str:
    """``manage.py *args`` on the run's database; ``traced=False``: not traced by
    coverage.py (``unmeasured``), for a command the test processes cover already."""
    env = {**django_env(database, MAINTENANCE_NAME), **(env or {})}
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env if traced else unmeasured(env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def prepare(database: Database, profile: Profile) -> list[User]:
    """Migrate, and create the token users and the staff users who log in by session (in
    one process: each Django start costs a second or two)."""
    users = [User(name, token) for name, token in DEMO_USERS.items()]
    users += [
        User(f"token-user-{n}", secrets.token_hex(20))
        for n in range(max(0, profile.token_principals - len(users)))
    ]
    users += [
        User(f"session-user-{n}", secrets.token_hex(20), secrets.token_urlsafe(16))
        for n in range(profile.session_principals)
    ]
    specs = [u.__dict__ for u in users if u.username not in DEMO_USERS]
    # The migrations and seed_demo run in the test processes too: not traced here.
    users_env = {"RELIABILITY_USERS": json.dumps(specs)}
    manage(database, "shell", "-c", CREATE_USERS, env=users_env, traced=False)
    return users


def session_principal(base_url: str, user: User) -> Principal:
    """Log in through the admin's login form, as a browser would; API calls then carry the
    session cookie and the CSRF token that DRF's SessionAuthentication demands."""
    assert user.password is not None
    with requests.Session() as session:
        session.get(f"{base_url}/admin/login/", timeout=10).raise_for_status()
        response = session.post(
            f"{base_url}/admin/login/?next=/admin/",
            data={
                "username": user.username,
                "password": user.password,
                "csrfmiddlewaretoken": session.cookies["csrftoken"],
                "next": "/admin/",
            },
            timeout=10,
        )
        response.raise_for_status()
        session_id, csrf = session.cookies.get("sessionid"), session.cookies.get("csrftoken")
    if not session_id or not csrf:
        raise RuntimeError(f"logging in {user.username} through /admin/login/ failed")
    headers = {"Cookie": f"sessionid={session_id}; csrftoken={csrf}", "X-CSRFToken": csrf}
    return Principal(user.username, "session", headers, (session_id, user.password))


@contextlib.contextmanager
def serve(
    database: Database,
    shape: ServerShape,
    logs: list[str],
    settings: str = "testproject.settings",
    env: dict[str, str] | None = None,
) -> Iterator[GunicornServer]:
    """gunicorn on the run's database; its log is appended to ``logs`` when it stops."""
    env = {**django_env(database, settings=settings), **(env or {})}
    with contextlib.ExitStack() as stack:
        if shape.pgbouncer:
            # Only the app goes through it: maintenance and the checks connect directly
            # (maintenance holds a session-level advisory lock). While PostgreSQL is down,
            # PgBouncer holds queries for query_wait_timeout (120 s by default): 2 s makes
            # an outage a quick 503, and server_login_retry a quick recovery.
            bouncer = stack.enter_context(
                run_pgbouncer(
                    database.server_url,
                    pool_size=8,
                    query_wait_timeout=2,
                    server_login_retry=0.5,
                    server_connect_timeout=2,
                )
            )
            env["DATABASE_URL"] = bouncer.url(database.name)
            env["DATABASE_POOLING"] = "transaction"
        server = stack.enter_context(
            run_gunicorn(env, workers=shape.workers, threads=shape.threads)
        )
        try:
            yield server
        finally:
            # Nothing in flight matters any more, and a worker busy in a slow handler or a
            # dead connection would hold up the server's shutdown for seconds.
            for worker in workers(server):
                with contextlib.suppress(psutil.Error):
                    worker.kill()
            logs.append(server.log_text())


def workers(server: GunicornServer) -> list[psutil.Process]:
    try:
        children: list[psutil.Process] = psutil.Process(server.process.pid).children()
    except psutil.Error:
        return []
    return children
