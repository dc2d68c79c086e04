"""A charge's receipt of a size the client chooses: the large-body benchmark's answer.

The receipt's ``lines`` are printable till lines of one fixed width, with item, SKU and
amounts drawn from a generator seeded by the charge's id, so a body compresses about as
well as real JSON does (not like a run of one repeated byte) and is the same every time it
is built for that charge. ``padding`` takes up the bytes that no whole line fills, so the
body, rendered as DRF renders JSON, is exactly ``size`` bytes.
"""

from __future__ import annotations

import json
import random
from typing import Any

# Each item with its unit price in cents.
ITEMS = (
    ("Espresso beans, dark roast, 1 kg", 2450),
    ("Oat milk, barista edition, 1 l", 299),
    ("Paper filters, size 4, pack of 100", 549),
    ("Ceramic mug, matte white, 350 ml", 1299),
    ("Cold brew bottle, glass, 1 l", 1899),
    ("Milk frothing jug, steel, 600 ml", 2199),
    ("Descaling tablets, pack of 12", 899),
    ("Burr grinder cleaning pellets", 1149),
    ("Green tea, sencha, loose, 250 g", 1350),
    ("Shortbread biscuits, butter, 200 g", 425),
    ("Reusable cup, bamboo fibre, 12 oz", 995),
    ("Gift card, printed, any amount", 2500),
)
# What follows a line's number and SKU: quantity, item, unit price, total; one of these.
ENTRIES = tuple(
    f"{qty:>2} x {item:<36.36} {unit:>8d} {qty * unit:>9d}"
    for item, unit in ITEMS
    for qty in range(1, 13)
)
# "000001 3fa2c9d017e4  3 x Espresso beans, dark roast, 1 kg  2450  7350"
LINE_BYTES = 6 + 1 + 12 + 1 + len(ENTRIES[0])


def _length(data: Any) -> int:
    # DRF's JSONRenderer: compact separators, non-ASCII characters left as they are.
    return len(json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode())


def minimum_size(charge: dict[str, Any]) -> int:
    """The bytes of a receipt with no lines and no padding."""
    return _length({"charge": charge, "lines": [], "padding": ""})


def receipt(charge: dict[str, Any], pk: int, size: int) -> dict[str, Any]:
    """The receipt of a charge (``charge`` is its serialized data), ``size`` bytes long as
    JSON; ``size`` must be at least ``minimum_size(charge)``."""
    room = size - minimum_size(charge)
    if room < 0:
        raise ValueError(f"a receipt takes at least {size - room} bytes")
    # Each line costs its characters, two quotes and (after the first) a comma.
    count = (room + 1) // (LINE_BYTES + 3)
    # Drawn in one call: per-line calls into random would cost more than the rest of the
    # request, which would flatter every replay measured against this view.
    drawn = random.Random(pk).randbytes(7 * count)
    skus = drawn.hex()
    lines = [
        f"{n + 1:06d} {skus[14 * n : 14 * n + 12]} {ENTRIES[drawn[7 * n + 6] % len(ENTRIES)]}"
        for n in range(count)
    ]
    used = count * (LINE_BYTES + 3) - 1 if count else 0
    return {"charge": charge, "lines": lines, "padding": " " * (room - used)}
