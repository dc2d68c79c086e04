"""How a duplicate waits for the request that holds its key: the pauses between its claims,
and the per-process cap on requests that wait on a thread of their own."""

from __future__ import annotations

import ast
import functools
import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from django_idempotency.conf import conf

# A waiting request tries the claim again after a pause that doubles from the first to the
# longest: a short holder is seen soon, a long one costs a few cheap claims a second.
FIRST_PAUSE = 0.05
LONGEST_PAUSE = 0.5

logger = logging.getLogger("django_idempotency")


class _Waiters:
    """How many requests of this process may wait for a holder on a thread of their own
    right now (sync views, and async views under WSGI): ``count``, capped so that waiting
    duplicates always leave a thread free for other requests. ``waiting``: the requests
    waiting now, async ones included."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.waiting = 0

    def enter(self) -> bool:
        limit = waiter_limit()
        with self._lock:
            if self.count >= limit:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.count -= 1

    def slept(self, started: bool) -> bool:
        """Count a request that goes to sleep for the first time; True from then on."""
        if not started:
            with self._lock:
                self.waiting += 1
        return True

    def woke(self, started: bool) -> None:
        if started:
            with self._lock:
                self.waiting -= 1


def waiter_limit() -> int:
    """How many requests of this process may wait on a thread of their own at once."""
    if threading.current_thread() is threading.main_thread():
        # A process that serves requests on its main thread serves one at a time (gunicorn's
        # sync worker, uWSGI without threads): a waiting request would hold all of it.
        return 0
    limit = conf.MAX_WAITERS
    threads, source = server_threads()
    if threads is not None:
        if limit >= threads:
            _warn_once(limit, threads, source)
        limit = min(limit, threads - 1)
    return max(limit, 0)


@functools.lru_cache(maxsize=4)
def _warn_once(cap: int, threads: int, source: str) -> None:
    # W008 at run time: `manage.py check` cannot see gunicorn's command line, this process can.
    logger.warning(
        "IDEMPOTENCY_MAX_WAITERS is %d, but a server process has %d request thread(s) (%s): "
        "waiting duplicates and the request they wait for could hold every thread "
        "(django_idempotency.W008). Set IDEMPOTENCY_MAX_WAITERS to %d or fewer (leave a thread "
        "for each slow request you expect at once).",
        cap,
        threads,
        source,
        max(threads - 1, 0),
    )


def server_threads() -> tuple[int | None, str]:
    """The request threads of one server process, and where that was learnt:
    IDEMPOTENCY_SERVER_THREADS, else gunicorn's ``threads`` wherever gunicorn takes it (its
    command line when this process is gunicorn's, GUNICORN_CMD_ARGS, its config file); None
    when nothing says."""
    threads = conf.SERVER_THREADS
    if threads is not None:
        return threads, "IDEMPOTENCY_SERVER_THREADS"
    # Cached per input: a waiting request asks on every wait.
    return _gunicorn_threads(tuple(sys.argv), os.environ.get("GUNICORN_CMD_ARGS"), os.getcwd())


def _under_gunicorn(argv: Sequence[str]) -> bool:
    # `gunicorn ...` or `python -m gunicorn ...` (argv[0] is then gunicorn/__main__.py).
    program = Path(argv[0]) if argv else Path()
    return program.name == "gunicorn" or program.parent.name == "gunicorn"


@functools.lru_cache(maxsize=8)
def _gunicorn_threads(
    argv: tuple[str, ...], env_args: str | None, cwd: str
) -> tuple[int | None, str]:
    """gunicorn's ``threads`` in its own order of precedence: the command line, then
    GUNICORN_CMD_ARGS, then the config file (``-c``, else ``gunicorn.conf.py`` in the working
    directory); its default, one thread, when gunicorn is known to serve and none says."""
    command = _options(argv[1:]) if _under_gunicorn(argv) else None
    environment = _options(shlex.split(env_args)) if env_args is not None else None
    for options, source in (
        (command, "gunicorn's command line"),
        (environment, "GUNICORN_CMD_ARGS"),
    ):
        if options is not None and options.threads is not None:
            return options.threads, source
    config = next((o.config for o in (command, environment) if o is not None and o.config), None)
    path = Path(cwd, config.removeprefix("file:")) if config else Path(cwd, "gunicorn.conf.py")
    if not (config or "").startswith("python:") and path.is_file():
        threads = _config_file_threads(path)
        if threads is not None:
            return threads, str(path)
        if "threads" in path.read_text(errors="replace"):
            return None, ""  # set, but not as a number we can read without running the file
        return 1, str(path)
    if command is not None or environment is not None:
        return 1, "gunicorn's command line" if command is not None else "GUNICORN_CMD_ARGS"
    return None, ""


class _Options:
    __slots__ = ("config", "threads")

    def __init__(self, threads: int | None, config: str | None) -> None:
        self.threads, self.config = threads, config


def _options(args: Sequence[str]) -> _Options:
    """``--threads`` and ``-c``/``--config`` of gunicorn arguments, read as gunicorn's argparse
    parser reads them, abbreviations included (``--thread 4``, ``--threads=4``). By hand: the
    package does not depend on gunicorn."""
    threads: int | None = None
    config: str | None = None
    pending = ""
    for arg in args:
        name, eq, value = arg.partition("=")
        if pending:
            name, value, eq, pending = pending, arg, "=", ""
        name = _long_option(name)
        if name in ("--threads", "-c", "--config") and not eq:
            pending = name
            continue
        if name == "--threads" and value.isdigit():
            threads = int(value)
        elif name in ("-c", "--config"):
            config = value
    return _Options(threads, config)


# argparse takes any unambiguous prefix of a long option; among gunicorn's, these are the
# shortest that name only --threads and --config.
_ABBREVIATIONS = {"--threads": "--th", "--config": "--con"}


def _long_option(name: str) -> str:
    for option, shortest in _ABBREVIATIONS.items():
        if name.startswith(shortest) and option.startswith(name):
            return option
    return name


def _config_file_threads(path: Path) -> int | None:
    """``threads = N`` in a gunicorn config file, read without running the file."""
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "threads" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int)
        ):
            return node.value.value
    return None


waiters = _Waiters()


class Patience:
    """One duplicate's wait, from the moment ``open()`` starts: its deadline, the pause
    before its next claim, and the waiter slot it holds, if any."""

    __slots__ = ("_pause", "_slot", "deadline", "started")

    def __init__(self, wait: timedelta) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + wait.total_seconds()
        self._pause = FIRST_PAUSE
        self._slot = False

    def next_pause(self) -> float:
        pause = min(self._pause, max(self.deadline - time.monotonic(), 0.0))
        self._pause = min(self._pause * 2, LONGEST_PAUSE)
        return pause

    def may_wait(self, capped: bool | None) -> bool:
        """Whether a busy claim may be tried again: time is left and, if the request waits
        on a thread of its own (``capped``), it holds a waiter slot. ``capped`` None: never."""
        if capped is None or time.monotonic() >= self.deadline:
            return False
        if capped and not self._slot:
            # Taken at the first busy claim, on the request's thread, and kept until open()
            # ends: a request that never waits never takes one.
            self._slot = waiters.enter()
        return self._slot or not capped

    def leave(self) -> None:
        if self._slot:
            self._slot = False
            waiters.leave()
