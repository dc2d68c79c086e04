"""The RQ job class of the chain profile's ``tasks-rq`` workers (``manage.py rqworker
--job-class tests.reliability.chain_rq.RecordingJob``): django-tasks-rq's, plus one line per
job a work horse takes (``chain_deliveries.py``). The job runs ``task_runner.deliver``, whose
first argument is the outbox message id; its tag is the job id, new at each publish (RQ never
runs a job twice: a lost one comes back through the relay's redrive, as another job)."""

from __future__ import annotations

from typing import Any

from django_tasks_rq import Job

from tests.reliability.chain_deliveries import record


class RecordingJob(Job):
    def perform(self) -> Any:
        record(str(self.args[0]), self.id, False)
        return super().perform()
