from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from argparse import ArgumentParser
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

import testproject
from testproject.payments import demo_chain
from testproject.payments.management.commands.seed_demo import DEMO_ADMIN, DEMO_TOKENS

REPO_ROOT = Path(testproject.__file__).resolve().parent.parent
STARTUP_TIMEOUT = 30.0
ADMIN_CSS = "/static/admin/css/base.css"


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed") == "true"

    def describe(self) -> str:
        replayed = ", Idempotent-Replayed: true" if self.replayed else ""
        return f"HTTP {self.status}{replayed}\n  {self.body.decode(errors='replace')}"


@dataclass(frozen=True)
class Call:
    """One request of the demo, printed as a curl line and sent by ``--smoke``."""

    title: str
    method: str
    path: str
    body: dict[str, Any] | None = None
    key: str | None = None
    token: str | None = DEMO_TOKENS["alice"]
    headers: dict[str, str] = field(default_factory=dict)

    def request_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.token is not None:
            headers["Authorization"] = f"Token {self.token}"
        if self.body is not None:
            headers["Content-Type"] = "application/json"
        if self.key is not None:
            headers["Idempotency-Key"] = self.key
        return headers

    def curl(self, base_url: str) -> str:
        words = ["curl", "-i", base_url + self.path]
        if self.method != "GET":
            words[2:2] = ["-X", self.method]
        for name, value in self.request_headers().items():
            words += ["-H", f"{name}: {value}"]
        if self.body is not None:
            words += ["-d", json.dumps(self.body)]
        return shlex.join(words)

    def send(self, base_url: str) -> Answer:
        data = None if self.body is None else json.dumps(self.body).encode()
        request = urllib.request.Request(
            base_url + self.path, data=data, method=self.method, headers=self.request_headers()
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return Answer(response.status, _lower(response.headers.items()), response.read())
        except urllib.error.HTTPError as error:
            return Answer(error.code, _lower(error.headers.items()), error.read())


def admin_login(base_url: str) -> str:
    username, password = DEMO_ADMIN
    return (
        f"Admin: {base_url}/admin/ (user {username}, password {password}; "
        "demo only, like the tokens)"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _lower(items: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in items}


def demo_calls(key: str) -> list[Call]:
    charge = {"amount": 2499, "currency": "inr"}
    return [
        Call("Charge 24.99 INR as alice", "POST", "/api/charges/", charge, key),
        Call(
            "Retry it with the same key: the first answer, replayed",
            "POST",
            "/api/charges/",
            charge,
            key,
        ),
        Call(
            "Reuse the key for another amount: 422 key-reused, nothing runs",
            "POST",
            "/api/charges/",
            {**charge, "amount": 999},
            key,
        ),
        Call("Count: handler runs and committed charges", "GET", "/api/charges/count/", token=None),
    ]


class Command(BaseCommand):
    help = (
        "Migrate, seed the demo users, serve the payments API with gunicorn and print curl "
        "lines that show a retry being replayed. --smoke sends them itself, then stops."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--workers", type=int, default=4)
        parser.add_argument(
            "--smoke",
            action="store_true",
            help="Send the demo requests, check the answers, stop the server and exit.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        port: int = options["port"]
        base_url = f"http://127.0.0.1:{port}"
        # Bound here, before anything else, and handed to gunicorn: a taken port fails at
        # once, and whatever answers on it afterwards can only be our own gunicorn.
        listener = self.listen(port)
        chain = demo_chain.Chain()
        try:
            call_command("migrate", interactive=False, verbosity=0)
            call_command("seed_demo", stdout=self.stdout)
            self.show_partitions()
            # The processor, a broker, a Celery worker and the relay, for the chain.
            chain = demo_chain.start(
                quiet=options["smoke"],
                webhook_url=f"{base_url}/api/webhooks/processor/",
                say=self.say,
            )
            os.environ.update(chain.env)
            self.stdout.write(chain.note)
            server = self.start_gunicorn(listener, options["workers"], quiet=options["smoke"])
        except BaseException:
            chain.stop()
            raise
        finally:
            listener.close()
        # Stop gunicorn with us on SIGTERM too, not only on Ctrl-C.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            self.wait_until_serving(server, base_url)
            calls = demo_calls(str(uuid.uuid4()))
            if options["smoke"]:
                self.smoke(calls, base_url, chain)
            else:
                self.show(calls, base_url)
                code = server.wait()
                if code != 0:
                    raise CommandError(f"gunicorn exited with code {code}.")
        except KeyboardInterrupt:
            pass
        finally:
            chain.unsupervise()
            if server.poll() is None:
                server.terminate()
                server.wait(timeout=60)
            chain.stop()

    def say(self, line: str) -> None:
        # From the chain's supervisor thread: one line at once, shown at once.
        self.stdout.write(self.style.WARNING(line))
        self.stdout.flush()

    def listen(self, port: int) -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Lets a restarted demo reuse its port at once; a port another socket listens on
        # still refuses (on Linux SO_REUSEADDR only reclaims TIME_WAIT connections).
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", port))
            listener.listen(128)
        except OSError as exc:
            listener.close()
            reason = "is taken by another program" if exc.errno == errno.EADDRINUSE else exc
            raise CommandError(
                f"Cannot serve on 127.0.0.1:{port}: port {port} {reason}. Stop what uses it, "
                f"or choose another port: python manage.py demo --port {port + 1}"
            ) from exc
        return listener

    def show_partitions(self) -> None:
        self.stdout.write("\n$ python manage.py idempotency_partitions --dry-run")
        call_command("idempotency_partitions", dry_run=True, stdout=self.stdout)
        self.stdout.write(
            "Partition maintenance: `python manage.py idempotency_partitions` hourly (cron), or "
            "the Celery task django_idempotency.maintain_partitions (see docs/partitions.md).\n"
        )

    def start_gunicorn(
        self, listener: socket.socket, workers: int, *, quiet: bool
    ) -> subprocess.Popen[bytes]:
        # DATABASE_URL is in the environment by now (the settings set it when they start the
        # embedded server), so every worker uses the database that was just migrated.
        env = {**os.environ, **demo_chain.fault_env()}
        host, port = listener.getsockname()
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            "testproject.wsgi",
            "--workers",
            str(workers),
            "--bind",
            f"fd://{listener.fileno()}",
        ]
        if not quiet:
            command += ["--access-logfile", "-"]
        shown = ["gunicorn", "testproject.wsgi", "--workers", str(workers)]
        self.stdout.write("$ " + shlex.join([*shown, "--bind", f"{host}:{port}"]))
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, pass_fds=(listener.fileno(),))

    def wait_until_serving(self, server: subprocess.Popen[bytes], base_url: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise CommandError(f"gunicorn exited with code {server.returncode}.")
            try:
                with urllib.request.urlopen(base_url + "/api/charges/count/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # an answer, if not a good one: the calls below will show it
            except OSError:
                time.sleep(0.1)
        raise CommandError(f"gunicorn did not answer on {base_url} within {STARTUP_TIMEOUT:.0f} s")

    def show(self, calls: list[Call], base_url: str) -> None:
        self.stdout.write(self.style.SUCCESS(f"\nServing the payments API on {base_url}/api/"))
        self.stdout.write(admin_login(base_url))
        for call in calls:
            self.stdout.write(f"\n# {call.title}\n{call.curl(base_url)}")
        self.stdout.write(
            "\n# The chain: captures at the processor, ledger rows, outbox backlog and dead "
            "letters, the relay's last heartbeat\n"
            f"curl -i {base_url}/api/charges/chain/"
        )
        self.stdout.write("\nCtrl-C stops the server.\n")

    def smoke(self, calls: list[Call], base_url: str, chain: demo_chain.Chain) -> None:
        count = calls[-1]
        before = json.loads(count.send(base_url).body)
        start = demo_chain.wait_for_chain(base_url) if chain.running else {}
        answers = []
        for call in calls:
            self.stdout.write(f"\n# {call.title}\n{call.curl(base_url)}")
            answer = call.send(base_url)
            answers.append(answer)
            self.stdout.write(answer.describe())
        first, retry, reuse, counted = answers
        after = json.loads(counted.body)
        executions = after["executions"]
        stylesheet = Call("The admin's stylesheet", "GET", ADMIN_CSS, token=None).send(base_url)
        checks = {
            f"the charge answered {first.status}, not 201": first.status == 201,
            "the first charge was marked replayed": not first.replayed,
            "the retry was not replayed": retry.replayed,
            "the replay differs from the first answer": retry.body == first.body,
            f"the reused key answered {reuse.status}, not 422": reuse.status == 422,
            # executions is None where nothing counts them (not PostgreSQL).
            "the handler did not run exactly once": executions is None
            or executions - before["executions"] == 1,
            "not exactly one charge was committed": after["rows"] - before["rows"] == 1,
            f"the admin's stylesheet answered {stylesheet.status}, not 200": stylesheet.status
            == 200,
        }
        if chain.running:
            # The charge was captured at the processor once (with a key derived from the
            # request's), the relay and the exactly-once task posted it to the ledger once, and
            # the processor's webhook, delivered twice, settled it once.
            ledger, settled = start["ledger_rows"], start["settlements"]
            counts = demo_chain.wait_for_chain(base_url, ledger + 1, settled + 1)
            self.stdout.write(
                "\n# The chain: captures at the processor, ledger rows, settlements by the "
                "processor's webhook, outbox backlog and dead letters, the relay's last heartbeat\n"
                f"curl -i {base_url}/api/charges/chain/\n  {json.dumps(counts)}"
            )
            checks["the processor did not capture exactly once"] = counts["captures"] == 1
            checks["not exactly one ledger row was posted"] = counts["ledger_rows"] == ledger + 1
            checks["the charge was not settled exactly once"] = counts["settlements"] == settled + 1
            checks["the chain reported no relay heartbeat"] = counts["relay_owner"] is not None
        problems = [problem for problem, passed in checks.items() if not passed]
        if problems:
            raise CommandError("Smoke test failed: " + "; ".join(problems))
        self.stdout.write(self.style.SUCCESS(smoke_passed(after["rows"])))
        self.stdout.write(admin_login(base_url))


def smoke_passed(rows: int) -> str:
    """The smoke run's last line: its own charge, and the table's (a second run finds more)."""
    earlier = rows - 1
    table = f" ({earlier} from earlier runs, {rows} in all)" if earlier else ""
    return f"\nSmoke test passed: one new charge{table}, executed once, replayed on retry."
