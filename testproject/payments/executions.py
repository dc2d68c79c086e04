"""How many times each payment handler ran, counted by a PostgreSQL sequence per model.

``nextval()`` is never rolled back, so the count includes runs whose transaction rolled back
or whose worker died: the number the exactly-once tests compare with the committed rows.
"""

from __future__ import annotations

from django.db import connection

from testproject.payments.models import Payment


def sequence_name(model: type[Payment]) -> str:
    return f"{model._meta.db_table}_executions"


def record(model: type[Payment]) -> None:
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval(%s)", [sequence_name(model)])


def count(model: type[Payment]) -> int | None:
    """Runs so far, or ``None`` where there is no sequence (not PostgreSQL)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM "
            + connection.ops.quote_name(sequence_name(model))
        )
        (value,) = cursor.fetchone()
    return int(value)
