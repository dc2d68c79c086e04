"""The request benchmark's floors: what this design's round trips cost with no engine at all.

Three views beside the testproject's charges (``bench/floor_views.py``, served only by the
benchmark's gunicorn through ``bench.settings``) send the round trips of a protected request
with ``SELECT 'claim'`` and ``SELECT 'store'`` in place of the claim and the store. A mode's
distance from its floor is then the engine's own cost (its Python, the functions' work in the
database), and the floor's distance from the plain request what the round trips alone cost.

- ``POST /bench/floor/fresh/``: ``SELECT 'lookup'`` (the lookup that finds nothing), then the
  plain charge handler in a transaction opened by ``BEGIN; SELECT 'claim'`` in one message and
  ended by ``SELECT 'store'; COMMIT`` in another, as a fresh key's is (7 round trips with the
  health check).
- ``POST /bench/floor/replay/``: the same authentication, then ``SELECT 'lookup'``,
  answering a stored charge's bytes, as a replay does (3 round trips).
- ``POST /bench/floor/canned/``: the same authentication and answer, nothing else (2).

Two more send the design's real statements without the engine: the lookup, the claim and
the store functions, called through ``django_idempotency.storage`` with the request's key, a
constant fingerprint (a replay's body is neither read nor hashed) and no options, telemetry
or decisions. Their distance from the round-trip floors is what the functions cost (in the
database, and adapting their parameters and rows); a mode's distance from them is the
engine's Python.

- ``POST /bench/floor/fresh-statements/``: the real lookup, then the plain charge handler
  between the real claim and the real store with its ``COMMIT``, storing the rendered charge
  (a fresh key's 7).
- ``POST /bench/floor/replay-statements/``: the same authentication, the real lookup of a key
  the previous floor stored, and its stored response (a replay's 3).
"""

from __future__ import annotations

# Mode names and paths, shared by the benchmark's client and its round-trip count.
FLOOR_FRESH = "floor: fresh key's round trips"
FLOOR_REPLAY = "floor: replay's round trips"
FLOOR_CANNED = "floor: auth and answer only"
FLOOR_FRESH_STATEMENTS = "floor: fresh key's statements"
FLOOR_REPLAY_STATEMENTS = "floor: replay's statements"
PATHS = {
    FLOOR_FRESH: "/bench/floor/fresh/",
    FLOOR_REPLAY: "/bench/floor/replay/",
    FLOOR_CANNED: "/bench/floor/canned/",
    FLOOR_FRESH_STATEMENTS: "/bench/floor/fresh-statements/",
    FLOOR_REPLAY_STATEMENTS: "/bench/floor/replay-statements/",
}
# Not a floor: the protected charges with lookup_first off (per view, as ``lookup_first=``
# sets it: the claim first, as before the lookup was the default), served beside them by the
# same gunicorn, so that both modes run on the same workers with the same warm caches.
CLAIM_FIRST_PATH = "/bench/charges-claim-first/"
# The floors that take an Idempotency-Key: a new one, and one the first stored.
NEW_KEY_FLOORS = (FLOOR_FRESH_STATEMENTS,)
STORED_KEY_FLOORS = (FLOOR_REPLAY_STATEMENTS,)
# Which mode of the benchmark each floor stands for (the same round trips).
STANDS_FOR = {
    FLOOR_FRESH: "fresh key",
    FLOOR_FRESH_STATEMENTS: "fresh key",
    FLOOR_REPLAY: "replay",
    FLOOR_REPLAY_STATEMENTS: "replay",
}
