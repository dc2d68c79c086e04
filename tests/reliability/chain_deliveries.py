"""One line per delivery a chain consumer takes, in ``$RELIABILITY_DELIVERIES`` (a file per
process): the message id, the broker's tag for this copy of it, and whether the broker had
handed that copy out before. ``Chain.read_deliveries`` reads them back."""

from __future__ import annotations

import json
import os
import time

DELIVERIES = "RELIABILITY_DELIVERIES"


def record(message_id: str, tag: str, redelivered: bool) -> None:
    folder = os.environ.get(DELIVERIES)
    if not folder:
        return
    line = json.dumps({"id": message_id, "tag": tag, "redelivered": redelivered, "at": time.time()})
    # A file per process and a write per line, flushed at once: a kill -9 loses at most the
    # delivery it was recording, which the broker then delivers again.
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as out:
        out.write(line + "\n")
