"""Django's Tasks framework, wherever it comes from: ``django.tasks`` (Django 6.0+), else the
``django-tasks`` backport (``django_tasks``, for Django 5.2). Typed as ``django.tasks``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django.tasks import (
        Task,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        task,
        task_backends,
    )
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.exceptions import InvalidTask
else:
    try:
        from django.tasks import (
            Task,
            TaskContext,
            TaskResult,
            TaskResultStatus,
            task,
            task_backends,
        )
        from django.tasks.backends.base import BaseTaskBackend
        from django.tasks.exceptions import InvalidTask
    except ImportError:  # Django 5.2: the backport, under its own names
        from django_tasks import task, task_backends
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskContext, TaskResult, TaskResultStatus
        from django_tasks.exceptions import InvalidTaskError as InvalidTask

__all__ = [
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskResult",
    "TaskResultStatus",
    "task",
    "task_backends",
]
