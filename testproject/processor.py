"""A fake card processor: a separate HTTP service that the payments API captures charges at.

Like a real one (Stripe, Adyen), it deduplicates on its own ``Idempotency-Key`` header: a
capture sent again with the same key is answered with the first answer and captures
nothing. It counts what it captured, which is how the demo and the tests see that a charge
was captured once. State is in memory, behind a lock.

    python -m testproject.processor --port 8010

``POST /v1/captures`` ``{"amount", "currency", "reference"}`` with an ``Idempotency-Key``
captures; ``GET /v1/stats`` counts captures, keys, requests, replayed answers and webhook
deliveries; ``GET /v1/captures`` lists every capture (how a test counts them per charge).

With ``--webhook-url`` and ``--webhook-secret`` it then tells the shop, like a real processor:
a ``charge.settled`` event per capture, identified by ``webhook-id``, delivered until it is
answered 2xx, and then once more (``--extra-deliveries``), as real senders do now and then.
Each attempt is signed by the ``standardwebhooks`` package, as Standard Webhooks senders sign
theirs (``webhook-id``, ``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256>``
of ``<id>.<timestamp>.<body>`` under the ``whsec_`` secret), so the delivery id, by which the
shop deduplicates, and the time, by which it refuses an old capture replayed, are both
covered by the signature.
``POST /v1/webhook`` ``{"url", "secret"}`` sets both after the start; ``GET /v1/deliveries``
lists the attempts sent (headers and body), as someone who captured them would have them;
``GET /v1/webhooks`` says, per capture id, whether its event is ``pending`` (not yet answered
2xx), ``acknowledged`` or ``abandoned`` (never answered 2xx, no longer sent).

The module also holds the payments API's client: ``capture()``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks import Webhook

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
# Standard Webhooks' headers (the receiver: django_idempotency.contrib.standard_webhooks).
DELIVERY_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"


def signed_headers(
    secret: str, delivery: str, body: bytes, at: float | None = None
) -> dict[str, str]:
    """The headers of one attempt to deliver ``body`` as ``delivery``, signed now (or ``at``)
    with the ``whsec_`` ``secret``."""
    signed_at = datetime.fromtimestamp(int(time.time() if at is None else at), tz=UTC)
    return {
        "Content-Type": "application/json",
        DELIVERY_HEADER: delivery,
        TIMESTAMP_HEADER: str(int(signed_at.timestamp())),
        SIGNATURE_HEADER: Webhook(secret).sign(delivery, signed_at, body.decode()),
    }


@dataclass
class Ledger:
    """What the processor has seen: captures, and the first answer per key."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    captures: list[dict[str, Any]] = field(default_factory=list)
    # key -> (request body, status, answer)
    answers: dict[str, tuple[dict[str, Any], int, dict[str, Any]]] = field(default_factory=dict)
    requests: int = 0
    replays: int = 0
    deliveries: int = 0
    acknowledged: int = 0
    # Every attempt sent: {"headers", "body"}.
    sent: list[dict[str, Any]] = field(default_factory=list)
    # capture id -> its charge.settled event's state: pending, acknowledged or abandoned.
    webhooks: dict[str, str] = field(default_factory=dict)

    def capture(self, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], bool]:
        """(status, answer, replayed) for a capture request."""
        with self.lock:
            self.requests += 1
            seen = self.answers.get(key)
            if seen is not None:
                first, status, answer = seen
                if first != body:
                    return 422, {"error": "Idempotency-Key reused with other parameters"}, False
                self.replays += 1
                return status, answer, True
            answer = {
                "id": f"cap_{uuid.uuid4().hex[:16]}",
                "amount": body.get("amount"),
                "currency": body.get("currency"),
                "reference": body.get("reference"),
            }
            self.captures.append(answer)
            self.answers[key] = (body, 201, answer)
            return 201, answer, False

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "captures": len(self.captures),
                "keys": len(self.answers),
                "requests": self.requests,
                "replays": self.replays,
                "webhook_deliveries": self.deliveries,
                "webhooks_acknowledged": self.acknowledged,
            }


class Handler(BaseHTTPRequestHandler):
    server: ProcessorServer

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, body: dict[str, Any], replayed: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if replayed:
            self.send_header(REPLAYED_HEADER, "true")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/stats":
            self._send(200, self.server.ledger.stats())
        elif self.path == "/v1/captures":
            with self.server.ledger.lock:
                captures = list(self.server.ledger.captures)
            self._send(200, {"captures": captures})
        elif self.path == "/v1/deliveries":
            with self.server.ledger.lock:
                sent = list(self.server.ledger.sent)
            self._send(200, {"deliveries": sent})
        elif self.path == "/v1/webhooks":
            with self.server.ledger.lock:
                webhooks = dict(self.server.ledger.webhooks)
            self._send(200, {"webhooks": webhooks})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path == "/v1/webhook":
            # Where to send events, set after start (a test learns its server's port late).
            config = json.loads(raw)
            self.server.webhook_url = str(config["url"])
            self.server.webhook_secret = str(config["secret"])
            self._send(200, {"url": self.server.webhook_url})
            return
        if self.path != "/v1/captures":
            self._send(404, {"error": "not found"})
            return
        key = self.headers.get(KEY_HEADER)
        if not key:
            self._send(400, {"error": f"{KEY_HEADER} is required"})
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._send(400, {"error": "the body must be JSON"})
            return
        status, answer, replayed = self.server.ledger.capture(key, body)
        self._send(status, answer, replayed)
        if status == 201 and not replayed and self.server.webhook_url:
            threading.Thread(target=self.server.settle, args=(answer["id"],), daemon=True).start()


class ProcessorServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        verbose: bool = False,
        webhook_url: str = "",
        webhook_secret: str = "",
        extra_deliveries: int = 1,
    ) -> None:
        super().__init__(address, Handler)
        self.ledger = Ledger()
        self.verbose = verbose
        self.webhook_url = webhook_url
        self.webhook_secret = webhook_secret
        self.extra_deliveries = extra_deliveries

    def settle(self, capture_id: str) -> None:
        """Deliver ``charge.settled`` until it is answered 2xx (the shop may not have
        committed the charge yet), then ``extra_deliveries`` times more."""
        body = json.dumps({"type": "charge.settled", "data": {"capture": capture_id}}).encode()
        # One delivery id for every attempt; each attempt is signed at its own time.
        delivery = str(uuid.uuid4())
        pause, extra = 0.2, self.extra_deliveries
        with self.ledger.lock:
            self.ledger.webhooks[capture_id] = "pending"
        for _ in range(30):
            headers = signed_headers(self.webhook_secret, delivery, body)
            with self.ledger.lock:
                self.ledger.deliveries += 1
                self.ledger.sent.append({"headers": headers, "body": body.decode()})
            request = urllib.request.Request(
                self.webhook_url, data=body, method="POST", headers=headers
            )
            try:
                with urllib.request.urlopen(request, timeout=10):
                    pass
            except (urllib.error.URLError, OSError):
                time.sleep(pause)
                pause = min(pause * 2, 2.0)
                continue
            with self.ledger.lock:
                self.ledger.acknowledged += 1
                self.ledger.webhooks[capture_id] = "acknowledged"
            if extra <= 0:
                return
            extra -= 1
        with self.ledger.lock:
            if self.ledger.webhooks[capture_id] == "pending":
                self.ledger.webhooks[capture_id] = "abandoned"


class ProcessorError(Exception):
    """The processor refused a capture or could not be reached."""


def capture(
    url: str, *, key: str, amount: int, currency: str, reference: str = "", timeout: float = 10
) -> dict[str, Any]:
    """Capture at the processor at ``url``; the same ``key`` never captures twice."""
    data = json.dumps({"amount": amount, "currency": currency, "reference": reference})
    request = urllib.request.Request(
        f"{url.rstrip('/')}/v1/captures",
        data=data.encode(),
        method="POST",
        headers={"Content-Type": "application/json", KEY_HEADER: key},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ProcessorError(f"The processor did not capture: {exc}") from exc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--webhook-url", default="", help="where to send charge.settled")
    parser.add_argument("--webhook-secret", default="", help="the shared signing secret")
    parser.add_argument("--extra-deliveries", type=int, default=1)
    options = parser.parse_args(argv)
    server = ProcessorServer(
        (options.host, options.port),
        verbose=options.verbose,
        webhook_url=options.webhook_url,
        webhook_secret=options.webhook_secret,
        extra_deliveries=options.extra_deliveries,
    )
    print(f"processor listening on http://{options.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
