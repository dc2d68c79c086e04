"""The request benchmark's floors: what this design's round trips cost with no engine at all.

Three views beside the testproject's charges (``bench/floor_views.py``, served only by the
benchmark's gunicorn through ``bench.settings``) send the round trips of a protected request
with ``SELECT 'claim'`` and ``SELECT 'store'`` in place of the claim and the store. A mode's
distance from its floor is then the engine's own cost (its Python, the functions' work in the
database), and the floor's distance from the plain request what the round trips alone cost.

- ``POST /bench/floor/fresh/``: the plain charge handler in a transaction opened by ``BEGIN``
  and ``SELECT 'claim'`` and ended by ``SELECT 'store'; COMMIT`` in one message, as a fresh
  key's is (7 round trips with the health check).
- ``POST /bench/floor/replay/``: the same authentication, then ``BEGIN``, ``SELECT 'claim'``
  and ``COMMIT``, answering a stored charge's bytes, as a replay does (5 round trips).
- ``POST /bench/floor/canned/``: the same authentication and answer, nothing else (2).
"""

from __future__ import annotations

# Mode names and paths, shared by the benchmark's client and its round-trip count.
FLOOR_FRESH = "floor: fresh key's round trips"
FLOOR_REPLAY = "floor: replay's round trips"
FLOOR_CANNED = "floor: auth and answer only"
PATHS = {
    FLOOR_FRESH: "/bench/floor/fresh/",
    FLOOR_REPLAY: "/bench/floor/replay/",
    FLOOR_CANNED: "/bench/floor/canned/",
}
