"""One reliability run: its phases, in order, and the report they add up to.

1. setup: a fresh database, migrated, with token users and staff users (session login),
   and its copy whose default isolation is REPEATABLE READ (for the deployment shapes).
2. cold start: gunicorn starts while the database is down; every request fails with a
   5xx and nothing is stored; once the database is back the same keys execute once.
   Meanwhile the deployment shapes' two servers start.
3. isolation: token, session and anonymous principals against one key; the admin's
   rendering of a stored body that carries markup.
4. contention: hundreds of clients on one key; distinct keys at once against the
   unprotected baseline (no global lock).
5. the attacks of issue 9, once each (``attacks.py``): rolled-back work answered 2xx,
   a waiting-duplicate flood, a forged lock key, an oversized 4xx, multipart bodies.
6. the deployment shapes of issue 22, once each (``shapes.py``): the database's copy whose
   default isolation is REPEATABLE READ, two app servers with different SECRET_KEYs on one
   database, ``@idempotent`` above the view's own authentication.
7. faulted traffic, per server shape: SDK clients under worker kills, database outages,
   connection cuts, crash_once/fail_once/slow/rolled-back/cookie-setting handlers, and
   partition maintenance.
8. recovery: every unanswered request is retried until answered; every faulted key is
   retried once more and must be answered from the store.
9. the invariant (every key answered 2xx has exactly one committed effect: no duplicate
   effect, no 2xx without a commit) and the leak checks over the databases and the logs.
"""

from __future__ import annotations

import dataclasses
import html
import os
import platform
import random
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from typing import Any

import psutil
import requests

from tests.conftest import ROOT, GunicornServer
from tests.reliability import checks
from tests.reliability.app import User, prepare, serve, session_principal
from tests.reliability.attacks import Attacks
from tests.reliability.client import Exchange, Principal, SDKClient
from tests.reliability.faults import (
    Fault,
    Injector,
    Maintenance,
    ServerFaults,
    maintenance_available,
)
from tests.reliability.postgres import Database, provision
from tests.reliability.profiles import Profile, ServerShape
from tests.reliability.report import Check, Report, percentiles
from tests.reliability.shapes import Shapes
from tests.reliability.traffic import DRF_ENDPOINTS, Ledger, Traffic

COUNT_PATH = "/api/charges/count/"


def run(
    profile: Profile,
    *,
    server_url: str | None = None,
    seed: int | None = None,
    traffic_seconds: float | None = None,
    say: Callable[[str], None] | None = None,
) -> Report:
    """Run ``profile`` on a database of its own on ``server_url`` (``None``: a private
    PostgreSQL cluster) and return the report."""
    # Imported here: the chain's runner is a Runner.
    from tests.reliability.chain_run import ChainRunner

    seed = seed if seed is not None else random.randrange(1 << 30)
    kind = ChainRunner if profile.chain else Runner
    runner = kind(profile, seed, say or (lambda line: print(line, file=sys.stderr)))
    with provision(server_url) as database:
        return runner.run(database, traffic_seconds or profile.traffic_seconds)


class Runner:
    def __init__(self, profile: Profile, seed: int, say: Callable[[str], None]) -> None:
        self.profile = profile
        self.seed = seed
        self.rng = random.Random(seed)
        self.say = say
        self.ledger = Ledger(run_tag=uuid.uuid4().hex[:10])
        self.logs: list[str] = []
        self.checks: list[Check] = []
        self.faults: list[Fault] = []
        self.phases: dict[str, float] = {}
        self.contention: dict[str, object] = {}
        self.principals: list[Principal] = []
        self.sessions: list[Principal] = []
        self.session_accepted = False
        self.users: list[User] = []
        self.started = time.monotonic()
        # Exchanges before this index went through a recovery already.
        self.recovered = 0
        # (server shape, logical requests, seconds) of each faulted-traffic phase.
        self.throughput: list[tuple[str, int, float]] = []
        # Attack or deployment shape -> requests it sent.
        self.attacks: Counter[str] = Counter()
        # Databases made beside the run's own (the deployment shapes'), checked with it and
        # dropped when the run ends.
        self.beside = ExitStack()
        self.elsewhere: list[Database] = []
        self.load_at_start = os.getloadavg()
        # gunicorn loads the code at the start: a commit made during the run is not tested.
        self.code_version = _code_version()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.say(f"[{time.monotonic() - self.started:7.1f}s] {name}")
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = round(time.monotonic() - started, 1)

    def client(self, base_url: str, read_timeout: float | None = None) -> SDKClient:
        policy = self.profile.policy
        if read_timeout is not None:
            policy = dataclasses.replace(policy, read_timeout=read_timeout)
        return SDKClient(base_url, policy, random.Random(self.rng.random()))

    def run(self, database: Database, traffic_seconds: float) -> Report:
        with self.beside:
            return self.run_on(database, traffic_seconds)

    def run_on(self, database: Database, traffic_seconds: float) -> Report:
        report = Report(
            profile=self.profile.name,
            started=datetime.now(UTC).isoformat(timespec="seconds"),
            environment={},
        )
        with self.phase("setup"):
            self.users = prepare(database, self.profile)
        try:
            self.phases_in_order(database, traffic_seconds)
        except Exception as exc:
            # Report what was found so far; the failure itself fails the run.
            self.say(traceback.format_exc())
            self.checks.append(Check(
                "every phase ran to its end", False,
                f"{type(exc).__name__}: {exc}"[:2000] + f"\nserver log:\n{database.log_tail()}",
            ))  # fmt: skip
            database.bring_back()
        with self.phase("invariant and leak checks"):
            findings = [
                *self.check_database(database, database),
                *(f for copy in self.elsewhere for f in self.check_database(copy, database)),
                *self.beyond_the_request(database),
                self.scan_logs(),
            ]
            self.no_2xx_without_a_commit(findings)
            report.faults = self.count_faults(database)
        report.environment = self.environment(database, traffic_seconds)
        self.fill(report, findings)
        return report

    def check_database(self, where: Database, database: Database) -> list[checks.Findings]:
        """The invariant over ``where``, for the exchanges its app served (the run's own
        ``database`` or a shape's copy)."""
        name = None if where is database else where.name
        served = [e for e in self.ledger.exchanges if e.database == name]
        return [checks.check_exchanges(where, served), checks.check_records(where, served)]

    # -- phases ---------------------------------------------------------------------------

    def phases_in_order(self, database: Database, traffic_seconds: float) -> None:
        shapes = self.profile.shapes
        for index, shape in enumerate(shapes):
            with ExitStack() as stack:
                if index == 0:
                    server = self.before_traffic(database, shape, stack)
                else:
                    with self.phase(f"start {shape.describe()}"):
                        server = stack.enter_context(serve(database, shape, self.logs))
                with self.phase(f"faulted traffic, {shape.describe()}"):
                    self.faulted_traffic(server, database, shape, traffic_seconds / len(shapes))
                with self.phase(f"recovery, {shape.describe()}"):
                    self.recover(server.url, shape)
                self.say(f"[{time.monotonic() - self.started:7.1f}s] stop {shape.describe()}")

    def before_traffic(
        self, database: Database, shape: ServerShape, stack: ExitStack
    ) -> GunicornServer:
        """What is made once per run, on the first server shape, before its faulted
        traffic. The deployment shapes' servers start during the cold start, and stop
        after the shapes are made."""
        # The copy is made first: nothing may be connected to its template.
        with self.deployment_shapes(database) as deployment:
            server = self.cold_start(database, shape, stack)
            self.log_in(server.url)
            with self.phase("isolation and privacy"):
                self.isolation(server.url)
                self.admin_escapes(server.url, database)
            with self.phase("contention: one hot key"):
                self.hot_key(server.url)
            with self.phase("contention: distinct keys at once"):
                self.scaling(server.url, shape)
            with self.phase("attacks of issue 9"):
                self.attack(server.url, database)
            with self.phase("deployment shapes of issue 22"):
                self.make_shapes(server.url, deployment)
        return server

    def cold_start(
        self, database: Database, shape: ServerShape, stack: ExitStack
    ) -> GunicornServer:
        """gunicorn starts with the database down: requests get a 5xx, never a 2xx, and
        nothing is stored; when it is back, each key executes once (not a replay)."""
        with self.phase("cold start: store unreachable"):
            database.take_down("fast")
            try:
                server = stack.enter_context(serve(database, shape, self.logs))
                alice = self.token_principals()[0]
                client = self.client(server.url)
                cold = [
                    self.ledger.new(alice, path, kind="cold-start")
                    for path in self.paths(self.profile.cold_start_requests)
                ]
                during = [client.attempt(exchange) for exchange in cold]
            finally:
                database.bring_back()
            self.wait_healthy(server.url)
            # At once: a server that never recovers costs one give-up time, not five.
            self.at_once(server.url, cold, lambda c, e: c.send(e), limit=len(cold))
            first = [next((a for a in e.attempts if a.ok), None) for e in cold]
            statuses = Counter(f"{e.path} {a.outcome}" for e, a in zip(cold, during, strict=True))
            self.checks.append(
                Check(
                    "store unreachable at start: 5xx, never a 2xx",
                    all(a.status is not None and a.status >= 500 for a in during),
                    f"{len(during)} requests while down: {_counts(statuses)}",
                )
            )
            # The mixin answers for DRF's authentication too; the plain view's token check
            # is the testproject's own code, run before @idempotent sees the request.
            drf = [a for e, a in zip(cold, during, strict=True) if e.path in DRF_ENDPOINTS]
            self.checks.append(
                Check(
                    "store unreachable at start, DRF views: 503 store-unavailable",
                    bool(drf)
                    and all(a.problem == "store-unavailable" and a.retry_after for a in drf),
                    f"{len(drf)} requests: {_counts(Counter(a.outcome for a in drf))}",
                )
            )
            self.checks.append(
                Check(
                    "store back: the same keys execute once, as first executions",
                    all(a is not None and not a.replayed for a in first),
                    f"{sum(a is not None for a in first)}/{len(cold)} answered 2xx, "
                    f"{sum(a is not None and a.replayed for a in first)} replayed",
                )
            )
        return server

    def log_in(self, base_url: str) -> None:
        """Log the staff users in, and find out whether the payments endpoints take a
        session: only then do session principals join the traffic."""
        self.sessions = [session_principal(base_url, u) for u in self.users if u.password]
        client = self.client(base_url)
        probe = self.ledger.new(self.sessions[0], kind="session probe", expect="none")
        self.session_accepted = client.attempt(probe).ok
        if self.session_accepted:
            probe.expect = "effect"
        self.principals = [*self.token_principals()]
        if self.session_accepted:
            self.principals += self.sessions
        else:
            self.checks.append(Check(
                "session-authenticated principals in the traffic", None,
                f"POST /api/charges/ with a session answered {_final(probe)}: the "
                "payments endpoints take tokens only, so sessions are tested as strangers",
            ))  # fmt: skip

    def isolation(self, base_url: str) -> None:
        alice, bob = self.token_principals()[:2]
        staff = next(u for u in self.users if u.password)
        by_session = next(p for p in self.sessions if p.username == staff.username)
        by_token = staff.token_principal()
        client = self.client(base_url)
        key = str(uuid.uuid4())

        def send(principal: Principal, path: str = "/api/charges/", **kw: Any) -> Exchange:
            return client.send(self.ledger.new(principal, path, key=key, kind="isolation", **kw))

        def fresh(exchange: Exchange) -> bool:
            return exchange.success is not None and not exchange.success.replayed

        sharing = [alice, bob, by_session if self.session_accepted else by_token]
        first, *others = [send(p) for p in sharing]
        replay = client.attempt(first)
        self.checks.append(Check(
            f"one key, {len(sharing)} principals: {len(sharing)} executions",
            fresh(first) and all(fresh(e) for e in others)
            and replay.replayed and replay.body == first.attempts[0].body,
            f"principals by {', '.join(p.auth for p in sharing)}; each got its own 201, "
            "the owner's retry is a replay of its own",
        ))  # fmt: skip

        if self.session_accepted:
            # The same user by session and by token is one principal: the key is theirs.
            session_first = self.ledger.new(by_session, key=str(uuid.uuid4()), kind="isolation")
            client.send(session_first)
            same_user = Exchange(by_token, "/api/charges/", session_first.key,
                                 session_first.body, "isolation")  # fmt: skip
            self.ledger.add(same_user)
            client.send(same_user)
            self.checks.append(Check(
                "the principal is the user, not the credential",
                fresh(session_first) and same_user.success is not None
                and same_user.success.replayed
                and same_user.success.body == session_first.success.body,  # type: ignore[union-attr]
                "a token retry of a session request by the same user is a replay",
            ))  # fmt: skip

        # Without valid credentials for the endpoint, with the owner's key and body: never
        # a replay, and never an execution.
        strangers = {
            "anonymous": Principal("anonymous", "anonymous", {}),
            "wrong token": Principal("intruder", "token", {"Authorization": "Token " + "0" * 40}),
        }
        if not self.session_accepted:
            strangers["session cookie (the payments endpoints take tokens only)"] = by_session
        for name, stranger in strangers.items():
            probe = Exchange(stranger, "/api/charges/", key, first.body, "probe", "none")
            answer = client.attempt(probe)
            self.checks.append(Check(
                f"{name} with another principal's key: refused, never replayed",
                answer.status in (401, 403) and not answer.replayed
                and first.attempts[0].body not in answer.body,
                f"answered {answer.outcome}",
            ))  # fmt: skip

        moved = send(alice, "/api/refunds/", expect="refused")
        self.checks.append(Check(
            "a key is bound to its endpoint: 422 on another",
            moved.final is not None and moved.final.status == 422,
            f"answered {moved.final.outcome if moved.final else '-'}",
        ))  # fmt: skip

        plain_key = str(uuid.uuid4())
        decorated = [
            client.send(self.ledger.new(p, "/api/charges-django/", key=plain_key, kind="isolation"))
            for p in (alice, bob)
        ]
        self.checks.append(Check(
            "@idempotent view: one key, two principals, two executions",
            all(fresh(e) for e in decorated),
            ", ".join(e.final.outcome for e in decorated if e.final),
        ))  # fmt: skip

    def admin_escapes(self, base_url: str, database: Database) -> None:
        """A stored body with markup in it (DRF echoes an invalid choice in its 400) must
        be shown escaped by the admin."""
        alice = self.token_principals()[0]
        marker = f"idem-xss-{self.ledger.run_tag}"
        payload = f'<script>alert("{marker}")</script>'
        client = self.client(base_url)
        exchange = client.send(self.ledger.new(alice, kind="markup", expect="none", fail=payload))
        with database.connect() as conn:
            row = conn.execute(
                "SELECT id FROM django_idempotency_record WHERE key = %s", [exchange.key]
            ).fetchone()
        cookie = {"Cookie": self.sessions[0].headers["Cookie"]}
        changelist = "/admin/django_idempotency/idempotencyrecord/"
        listing = requests.get(base_url + changelist, headers=cookie, timeout=30)
        if listing.status_code == 404:
            self.checks.append(Check(
                "admin escapes stored bodies", None,
                "the admin does not register IdempotencyRecord in this checkout",
            ))  # fmt: skip
            return
        page = requests.get(
            f"{base_url}{changelist}{row[0] if row else 0}/change/", headers=cookie, timeout=30
        )
        text = page.text
        self.checks.append(Check(
            "admin escapes stored bodies",
            row is not None and page.status_code == 200 and "<script>alert(" not in text
            and html.escape("<script>alert(", quote=False) in text and marker in text,
            f"record stored: {row is not None}; change page answered {page.status_code}",
        ))  # fmt: skip

    def hot_key(self, base_url: str) -> None:
        """Hundreds of clients send the same request with the same key at once."""
        alice = self.token_principals()[0]
        results = {}
        for delay_ms in (0, self.profile.hot_key_delay_ms):
            template = self.ledger.new(alice, kind="hot key", delay_ms=delay_ms)
            copies = [template] + [
                self.ledger.add(Exchange(alice, template.path, template.key, template.body, kind))
                for kind in ["hot key"] * (self.profile.hot_key_clients - 1)
            ]
            before = self.executions(base_url)
            started = time.monotonic()
            self.at_once(
                base_url, copies, lambda client, e: client.send(e),
                read_timeout=self.profile.hot_key_read_timeout,
            )  # fmt: skip
            elapsed = time.monotonic() - started
            ran = self.executions(base_url) - before
            answers = [e.success for e in copies]
            bodies = {a.body for a in answers if a is not None}
            outcomes = Counter(a.outcome for e in copies for a in e.attempts)
            fresh = sum(a is not None and not a.replayed for a in answers)
            results[delay_ms] = {
                "clients": len(copies), "seconds": round(elapsed, 1), "handler runs": ran,
                "first executions": fresh, "attempts": dict(outcomes),
            }  # fmt: skip
            self.checks.append(Check(
                f"hot key, {len(copies)} clients, handler {delay_ms} ms: one execution",
                ran == 1 and fresh == 1 and len(bodies) == 1 and None not in answers,
                f"handler ran {ran}x; {sum(a is not None for a in answers)} answered 2xx, "
                f"{len(bodies)} distinct bodies, in {elapsed:.1f}s; attempts {_counts(outcomes)}",
            ))  # fmt: skip
        self.contention["hot_key"] = results

    def scaling(self, base_url: str, shape: ServerShape) -> None:
        """N requests on distinct keys at once, each holding its transaction open for the
        same time, through the idempotent endpoint and through the unprotected baseline."""
        alice = self.token_principals()[0]
        delay = self.profile.scaling_delay_ms
        rows = []
        for n in self.profile.scaling_batches:
            walls = {}
            for label, path, expect in (
                ("idempotent", "/api/charges/", "effect"),
                ("baseline", "/api/charges-plain/", "any"),
            ):
                batch = [
                    self.ledger.new(alice, path, kind="scaling", expect=expect, delay_ms=delay)
                    for _ in range(n)
                ]
                started = time.monotonic()
                self.at_once(base_url, batch, lambda client, e: client.attempt(e))
                walls[label] = round(time.monotonic() - started, 2)
                if label == "idempotent":
                    # Anything the single attempt missed is settled now, outside the timing.
                    for exchange in batch:
                        if exchange.success is None:
                            self.client(base_url).send(exchange)
            rows.append({"n": n, **walls, "serial": round(n * delay / 1000, 2)})
        self.contention["scaling"] = rows
        self.contention["scaling_delay_ms"] = delay
        # Up to the server's concurrency, N requests take one delay, not N: allow a
        # loaded 2-core machine a factor of 2 on top of the baseline's own time.
        parallel = [
            r for r in rows
            if r["n"] >= 4 and r["idempotent"] > max(0.6 * r["serial"], 2 * r["baseline"])
        ]  # fmt: skip
        self.checks.append(Check(
            "distinct keys run in parallel (no global lock)",
            not parallel,
            "; ".join(f"N={r['n']}: {r['idempotent']}s vs baseline {r['baseline']}s, "
                      f"serial {r['serial']}s" for r in rows),
        ))  # fmt: skip

    def attack(self, base_url: str, database: Database) -> None:
        alice, bob = self.token_principals()[:2]
        rng = random.Random(self.rng.random())
        attacks = Attacks(self.profile, database, self.ledger, rng, self.logs, self.say)
        try:
            self.checks += attacks.run(base_url, alice, bob)
        finally:
            self.attacks += attacks.made

    def deployment_shapes(self, database: Database) -> Shapes:
        """The deployment shapes, their copy of the database made and their servers
        starting in the background."""
        with self.phase("setup: the deployment shapes' database"):
            rng = random.Random(self.rng.random())
            shapes = Shapes(self.profile, database, self.ledger, rng, self.logs, self.say)
            self.elsewhere.append(shapes.prepare(self.beside))
            shapes.start()
        return shapes

    def make_shapes(self, base_url: str, shapes: Shapes) -> None:
        alice, bob = self.token_principals()[:2]
        try:
            self.checks += shapes.run(base_url, alice, bob)
        finally:
            self.attacks += shapes.made

    def faulted_traffic(
        self, server: GunicornServer, database: Database, shape: ServerShape, seconds: float
    ) -> None:
        traffic = Traffic(server.url, self.principals, self.profile, self.ledger, self.seed)
        injectors = self.injectors(server, database)
        for injector in injectors:
            injector.start()

        # Faults end with the traffic's time, not after its stragglers: the stragglers
        # then finish while the last fault is being undone.
        def halt_all() -> None:
            for injector in injectors:
                injector.halt()

        halt = threading.Timer(seconds, halt_all)
        halt.start()
        before, started = len(self.ledger.exchanges), time.monotonic()
        try:
            traffic.run(seconds)
        finally:
            halt.cancel()
            for injector in injectors:
                self.faults += injector.stop()
        sent, elapsed = len(self.ledger.exchanges) - before, time.monotonic() - started
        self.throughput.append((shape.describe(), sent, elapsed))
        self.say(f"  {sent} logical requests in {elapsed:.0f}s")

    def injectors(self, server: GunicornServer, database: Database) -> list[Injector]:
        """What injects faults during the faulted traffic."""
        injectors: list[Injector] = [
            ServerFaults(server, database, self.profile, random.Random(self.rng.random()), self.say)
        ]
        if maintenance_available():
            injectors.append(
                Maintenance(database, self.profile, random.Random(self.rng.random()), self.say)
            )
        return injectors

    def beyond_the_request(self, database: Database) -> list[checks.Findings]:
        """The invariant's part beyond the request's own database (the chain profiles)."""
        return []

    def recover(self, base_url: str, shape: ServerShape) -> None:
        """Faults are over: every request still without its final answer is retried until
        it gets one, then every key that saw a fault is retried once more and must be
        answered from the store."""
        self.wait_healthy(base_url)
        exchanges = list(self.ledger.exchanges)[self.recovered :]
        self.recovered += len(exchanges)
        pending = [e for e in exchanges if _unanswered(e)]
        self.at_once(base_url, pending, lambda client, e: client.send(e), limit=8)
        faulted = [e for e in exchanges if e.faulted and e.expect in ("effect", "refused")]
        self.at_once(base_url, faulted, lambda client, e: client.attempt(e), limit=8)
        wrong = [
            e for e in faulted
            if e.final is None
            or (e.expect == "effect" and not (e.final.ok and e.final.replayed))
            or (e.expect == "refused" and e.final.status != 422)
        ]  # fmt: skip
        self.checks.append(Check(
            f"after recovery, faulted keys are answered from the store ({shape.describe()})",
            not wrong,
            f"{len(pending)} requests needed the recovery sweep; {len(faulted)} faulted "
            f"keys retried, {len(wrong)} not answered from the store"
            + (f": {', '.join(e.final.outcome for e in wrong[:10] if e.final)}" if wrong else ""),
        ))  # fmt: skip

    # -- helpers --------------------------------------------------------------------------

    def token_principals(self) -> list[Principal]:
        return [u.token_principal() for u in self.users if u.password is None]

    def paths(self, n: int) -> list[str]:
        endpoints = list(self.profile.endpoints)
        return [endpoints[i % len(endpoints)] for i in range(n)]

    def at_once(
        self,
        base_url: str,
        exchanges: Sequence[Exchange],
        action: Callable[[SDKClient, Exchange], object],
        limit: int | None = None,
        read_timeout: float | None = None,
    ) -> None:
        """Each exchange from its own thread; without ``limit``, released together."""
        if not exchanges:
            return
        barrier = threading.Barrier(len(exchanges)) if limit is None else None

        def one(exchange: Exchange) -> None:
            client = self.client(base_url, read_timeout)
            try:
                if barrier is not None:
                    barrier.wait()
                action(client, exchange)
            finally:
                client.close()

        with ThreadPoolExecutor(limit or len(exchanges)) as pool:
            list(pool.map(one, exchanges))

    def executions(self, base_url: str) -> int:
        response = requests.get(base_url + COUNT_PATH, timeout=30)
        response.raise_for_status()
        return int(response.json()["executions"])

    def wait_healthy(self, base_url: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if requests.get(base_url + COUNT_PATH, timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base_url} did not recover within {timeout:.0f}s")
            time.sleep(0.2)

    def scan_logs(self) -> checks.Findings:
        secrets = [s for p in self.principals for s in p.secrets]
        secrets += [u.token for u in self.users] + [u.password for u in self.users if u.password]
        keys = {e.key for e in self.ledger.exchanges}
        findings = checks.scan_logs(self.logs, keys, secrets, f"canary-{self.ledger.run_tag}")
        self.checks.append(Check(
            "logs carry no whole key, credential or request body",
            not findings.violations,
            f"{findings.checked['log bytes']} bytes of gunicorn and library logs scanned "
            f"for {len(keys)} keys, {len(set(secrets))} credentials and the body canary",
        ))  # fmt: skip
        return findings

    def no_2xx_without_a_commit(self, findings: Sequence[checks.Findings]) -> None:
        found = [v for f in findings for v in f.violations if v.what == checks.NO_COMMIT]
        answered = sum(e.success is not None for e in self.ledger.exchanges)
        rolled_back = sum(e.kind == "rolled back" for e in self.ledger.exchanges)
        self.checks.append(Check(
            "no 2xx without a commit",
            not found,
            f"{answered} logical requests answered 2xx, each checked for its committed row; "
            f"stored successes checked for theirs; {rolled_back} requests that rolled back "
            f"their own work; {len(found)} violations"
            + (": " + "; ".join(v.detail for v in found[:5]) if found else ""),
        ))  # fmt: skip

    def count_faults(self, database: Database) -> dict[str, int]:
        counted = Counter(f.kind for f in self.faults)
        for fault in self.faults:
            if fault.variant:
                counted[f"{fault.kind}: {fault.variant}"] += 1
            if fault.unit:
                counted[f"{fault.kind}: {fault.unit}"] += fault.units
        with database.connect() as conn:
            for prefix, label in (("crash_once:", "crash_once: worker exited after writing"),
                                  ("fail_once:", "fail_once: 500 after writing")):  # fmt: skip
                row = conn.execute(
                    "SELECT count(*) FROM payments_faulttag WHERE tag LIKE %s", [prefix + "%"]
                ).fetchone()
                counted[label] = int(row[0]) if row else 0
        counted.update(self.attacks)
        for kind, label in (
            ("rolled back", "fail=rollback_only: wrote, marked for rollback, returned 201"),
            ("cookie", "set_cookie: the first answer sets a cookie"),
        ):
            if self.profile.share(kind):
                counted[label] = sum(e.kind == kind for e in self.ledger.exchanges)
        slow = [e for e in self.ledger.exchanges if e.kind == "slow"]
        counted["slow handler: client timed out, retried"] = sum(
            any(a.outcome == "timeout" for a in e.attempts) for e in slow
        )
        return dict(counted)

    def environment(self, database: Database, traffic_seconds: float) -> dict[str, str]:
        import django
        import gunicorn
        import rest_framework

        memory = psutil.virtual_memory().total / 2**30
        return {
            "machine": f"{os.cpu_count()} CPU cores, {memory:.0f} GiB RAM, {platform.platform()}",
            "load": "1-minute load average "
            f"{self.load_at_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
            "(the run, its server and database, and anything else on the machine)",
            "software": f"Python {platform.python_version()}, Django {django.__version__}, "
            f"DRF {rest_framework.VERSION}, gunicorn {gunicorn.__version__}",
            "code": self.code_version,
            "database": f"{database.version().split(' on ')[0]}, {database.describe()}",
            "servers": "; ".join(s.describe() for s in self.profile.shapes)
            + " (gunicorn --preload, testproject.settings, PAYMENTS_FAULTS_ENABLED=1)",
            "clients": f"{self.profile.clients} SDK-like client threads, "
            f"{len(self.principals)} principals "
            f"({', '.join(sorted({p.auth for p in self.principals}))})",
            "retry policy": _describe_policy(self.profile),
            "faulted traffic": f"{traffic_seconds / 60:.1f} minutes, seed {self.seed}",
            "partition maintenance": "ran concurrently" if maintenance_available()
            else "not available in this checkout",
        }  # fmt: skip

    def fill(self, report: Report, findings: Sequence[checks.Findings]) -> None:
        exchanges = self.ledger.exchanges
        attempts = [a for e in exchanges for a in e.attempts]
        report.seconds = round(time.monotonic() - self.started, 1)
        report.phases = self.phases
        report.requests = {
            "logical requests": len(exchanges),
            "HTTP attempts": len(attempts),
            "retries (attempts beyond the first)": len(attempts) - len(exchanges),
            "answered 2xx as a replay": sum(a.ok and a.replayed for a in attempts),
            **{
                f"logical requests per second under faults, {shape}": round(sent / seconds)
                for shape, sent, seconds in self.throughput
            },
        }
        report.kinds = dict(Counter(e.kind for e in exchanges))
        report.endpoints = dict(Counter(e.path for e in exchanges))
        report.fault_errors = [f"{f.kind}: {f.detail}" for f in self.faults if not f.ok]
        report.outcomes = dict(Counter(a.outcome for a in attempts))
        report.final_outcomes = dict(Counter(_final(e) for e in exchanges))
        report.latency_ms = {
            "attempt answered 2xx": percentiles([a.latency for a in attempts if a.ok]),
            "attempt, any outcome": percentiles([a.latency for a in attempts]),
            "logical request, first send to first 2xx (retries, recovery sweep)": percentiles([
                s.started + s.latency - e.attempts[0].started
                for e in exchanges if (s := e.success) is not None
            ]),
        }  # fmt: skip
        violations = [v for f in findings for v in f.violations]
        report.duplicates = sum(v.kind == checks.DUPLICATE for v in violations)
        report.leaks = sum(v.kind == checks.LEAK for v in violations)
        report.other_violations = sum(v.kind == checks.OTHER for v in violations)
        report.unresolved = sum(f.unresolved for f in findings)
        report.violations = [v.__dict__ for v in violations[:200]]
        report.checks = self.checks
        report.contention = self.contention
        slowest = sorted((e for e in exchanges if e.attempts), key=lambda e: -e.seconds)[:10]
        report.slowest = [f"{e.seconds:.1f}s: {e.describe()}" for e in slowest]


def _unanswered(exchange: Exchange) -> bool:
    if exchange.expect == "effect":
        return exchange.success is None
    if exchange.expect == "refused":
        return exchange.final is None or exchange.final.status != 422
    return False


def _final(exchange: Exchange) -> str:
    final = exchange.final
    if final is None:
        return "never sent"
    return f"{final.outcome} (replayed)" if final.replayed else final.outcome


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(counter.items()))


def _code_version() -> str:
    """The commit the run tested, and whether the library or the testproject differed."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--", "django_idempotency", "testproject")
    return f"commit {git('rev-parse', '--short', 'HEAD') or '?'}" + (
        " with uncommitted changes to the library or testproject" if dirty else ""
    )


def _describe_policy(profile: Profile) -> str:
    p = profile.policy
    return (
        f"same key on every attempt; retry on connection errors, timeouts, 409, 429 and 5xx; "
        f"full-jitter backoff {p.base_delay}s x 2^n up to {p.max_delay}s (Retry-After as a "
        f"floor); connect/read timeout {p.connect_timeout}/{p.read_timeout}s; slow handlers "
        f"sleep longer than the read timeout; give up after {p.give_up_after:.0f}s"
    )
