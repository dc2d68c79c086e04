"""What the chain's redis-server did with each task message, replayed from its append-only file.

The chain's broker logs every write (``appendfsync always``, no rewrites), so its queue can be
replayed command by command: kombu publishes with ``LPUSH``, a worker takes a message with
``BRPOP`` (logged as ``RPOP``) and then records it as unacknowledged (``HSET unacked <tag>``),
and a message given back (visibility timeout, a rejected delivery, a lost worker) is pushed
again with the same delivery tag. kombu's Redis transport pops a message before it records it:
a worker killed in between, or a broker killed before the record arrives, drops the message,
and nothing redelivers it. The replay finds those messages. A worker that took a message and
lived runs it all the same: only a dropped delivery no worker received is lost.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.chain_processes import QUEUE, UNACKED


@dataclass
class BrokerLog:
    # False for a broker with no log to replay (RabbitMQ): the figures below are unknown.
    kept: bool = False
    # delivery tag -> task id (the outbox message id), for every message pushed
    tags: dict[str, str] = field(default_factory=dict)
    # pushes of a tag already seen: messages given back to the queue
    given_back: int = 0
    # delivery tag -> task id, for messages popped by a worker that never recorded them as
    # unacknowledged
    dropped: dict[str, str] = field(default_factory=dict)

    def publishes(self, message: str) -> int:
        return sum(task == message for task in self.tags.values())


def replay(directory: Path) -> BrokerLog:
    """Replay the append-only files in ``directory`` (redis' ``appendonlydir``)."""
    log = BrokerLog(kept=True)
    queue: deque[str] = deque()  # delivery tags, left to right as Redis keeps the list
    popped: dict[str, str] = {}  # tag -> task id, popped and not yet recorded
    for command in _commands(directory):
        name = command[0].upper()
        if name in (b"LPUSH", b"RPUSH") and command[1] == QUEUE.encode():
            for raw in command[2:]:
                message = json.loads(raw)
                tag, task = message["properties"]["delivery_tag"], message["headers"]["id"]
                log.given_back += tag in log.tags
                log.tags[tag] = task
                (queue.appendleft if name == b"LPUSH" else queue.append)(tag)
        elif name == b"RPOP" and command[1] == QUEUE.encode() and queue:
            tag = queue.pop()
            popped[tag] = log.tags[tag]
        elif name == b"HSET" and command[1] == UNACKED.encode():
            popped.pop(command[2].decode(), None)
    log.dropped = popped
    return log


def _commands(directory: Path) -> Iterator[list[bytes]]:
    """The commands of the incremental files, in order."""
    for path in sorted(directory.glob("*.incr.aof"), key=lambda p: int(p.name.split(".")[-3])):
        yield from _parse(path.read_bytes())


def _parse(data: bytes) -> Iterator[list[bytes]]:
    """RESP arrays of bulk strings; a command cut short by a kill ends the file."""
    at = 0

    def line() -> bytes:
        nonlocal at
        end = data.index(b"\r\n", at)
        text, at = data[at:end], end + 2
        return text

    while at < len(data):
        try:
            header = line()
            if not header.startswith(b"*"):
                continue
            command = []
            for _ in range(int(header[1:])):
                size = int(line()[1:])
                if at + size + 2 > len(data):
                    return
                command.append(data[at : at + size])
                at += size + 2
        except ValueError:
            return
        yield command
