"""Tasks of Django's Tasks framework for ``tests/messaging/test_django_tasks.py``, run by a real RQ
worker: each writes its effect (an outbox event, so in the consumer's transaction) and, when
told to, dies (SIGKILL) once before or after that transaction commits."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from django.db import transaction

from django_idempotency.messaging import enqueue_event
from django_idempotency.messaging.tasks_framework import TaskContext, task, task_backends

EFFECT = "tests.tasks.effect"


def _die_once(marks: str | None, n: int, when: str) -> None:
    """SIGKILL this process the first time it runs ``n`` (the work horse: mid-task, or once
    the transaction committed and before the backend hears of it)."""
    if marks is None:
        return
    mark = Path(marks) / f"{when}-{n}"
    if mark.exists():
        return
    mark.touch()
    if when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))


@task
def record(n: int, die: str | None = None, marks: str | None = None) -> dict[str, int]:
    enqueue_event(EFFECT, {"n": n})
    if die is not None:
        _die_once(marks, n, die)
    return {"n": n}


@task(takes_context=True)
def record_with_context(context: TaskContext[..., Any], n: int) -> dict[str, Any]:
    enqueue_event(EFFECT, {"n": n, "attempt": context.attempt})
    return {"n": n}


# Through the outbox to django-tasks-db, where it is installed (tests.support.tasks_settings).
if "outbox_db" in task_backends.settings:

    @task(backend="outbox_db")
    def record_db(n: int) -> dict[str, int]:
        enqueue_event(EFFECT, {"n": n, "via": "db"})
        return {"n": n}
