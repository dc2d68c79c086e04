from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
import requests
from django.contrib.auth.models import User
from django.db import connection

from tests.conftest import ROOT


@pytest.mark.django_db
def test_tests_run_on_a_real_postgresql_test_database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('server_version_num')::int, current_database()")
        version, name = cursor.fetchone()
    assert connection.vendor == "postgresql"
    assert version >= 150000
    assert name.startswith("test_")


@pytest.mark.django_db
def test_records_table_is_partitioned_with_future_partitions_after_migrate() -> None:
    tomorrow = datetime.now(UTC).date() + timedelta(days=1)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT p.relkind, count(*) FILTER (WHERE c.relname >= %s) "
            "FROM pg_class p "
            "LEFT JOIN pg_inherits i ON i.inhparent = p.oid "
            "LEFT JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE p.relname = 'django_idempotency_record' AND pg_table_is_visible(p.oid) "
            "GROUP BY p.relkind",
            [f"django_idempotency_record_p{tomorrow:%Y%m%d}"],
        )
        relkind, future_partitions = cursor.fetchone()
    assert relkind == "p"
    assert future_partitions >= 2


CLUSTER_AND_DATABASE = "SELECT system_identifier::text, current_database() FROM pg_control_system()"


@pytest.mark.django_db
def test_child_processes_use_the_same_server_and_the_test_database(
    subprocess_env: dict[str, str],
) -> None:
    script = (
        "import django; django.setup()\n"
        "from django.db import connection\n"
        "with connection.cursor() as cursor:\n"
        f"    cursor.execute({CLUSTER_AND_DATABASE!r})\n"
        "    print(*cursor.fetchone())\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=subprocess_env,
        capture_output=True,
        text=True,
        check=True,
    )
    with connection.cursor() as cursor:
        cursor.execute(CLUSTER_AND_DATABASE)
        parent = cursor.fetchone()
    assert tuple(child.stdout.split()) == parent


@pytest.mark.django_db(transaction=True)
def test_live_gunicorn_serves_what_the_test_committed(
    live_gunicorn: str,
) -> None:
    User.objects.create_user("admin", password="pw", is_staff=True, is_superuser=True)
    session = requests.Session()
    session.get(f"{live_gunicorn}/admin/login/", timeout=10)
    response = session.post(
        f"{live_gunicorn}/admin/login/",
        data={
            "username": "admin",
            "password": "pw",
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
            "next": "/admin/",
        },
        headers={"Referer": f"{live_gunicorn}/admin/login/"},
        timeout=10,
    )
    # The login succeeds only if gunicorn reads the user this test committed.
    assert response.status_code == 200
    assert response.url == f"{live_gunicorn}/admin/"
