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

ITEMS = (
    "Espresso beans, dark roast, 1 kg",
    "Oat milk, barista edition, 1 l",
    "Paper filters, size 4, pack of 100",
    "Ceramic mug, matte white, 350 ml",
    "Cold brew bottle, glass, 1 l",
    "Milk frothing jug, steel, 600 ml",
    "Descaling tablets, pack of 12",
    "Burr grinder cleaning pellets",
    "Green tea, sencha, loose, 250 g",
    "Shortbread biscuits, butter, 200 g",
    "Reusable cup, bamboo fibre, 12 oz",
    "Gift card, printed, any amount",
)
# "000001 3fa2c9d017e4  3 x Espresso beans, ... 1 kg       1299      3897" in quotes.
LINE = "{n:06d} {sku} {qty:>2} x {item:<36.36} {unit:>8d} {total:>9d}"
LINE_BYTES = len(LINE.format(n=0, sku="0" * 12, qty=0, item="", unit=0, total=0))


def _length(data: Any) -> int:
    # DRF's JSONRenderer: compact separators, non-ASCII characters left as they are.
    return len(json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode())


def minimum_size(charge: dict[str, Any]) -> int:
    """The bytes of a receipt with no lines and no padding."""
    return _length({"charge": charge, "lines": [], "padding": ""})


def receipt(charge: dict[str, Any], pk: int, size: int) -> dict[str, Any]:
    """The receipt of the charge ``charge`` (its serialized data), ``size`` bytes long as
    JSON; ``size`` must be at least ``minimum_size(charge)``."""
    room = size - minimum_size(charge)
    if room < 0:
        raise ValueError(f"a receipt takes at least {size - room} bytes")
    # Each line costs its characters, two quotes and (after the first) a comma.
    count = (room + 1) // (LINE_BYTES + 3)
    rng = random.Random(pk)
    skus = rng.randbytes(6 * count).hex()
    lines = []
    for n in range(count):
        qty = rng.randint(1, 12)
        unit = rng.randint(99, 99_999)
        sku = skus[12 * n : 12 * n + 12]
        item = ITEMS[rng.randrange(len(ITEMS))]
        lines.append(LINE.format(n=n + 1, sku=sku, qty=qty, item=item, unit=unit, total=qty * unit))
    used = count * (LINE_BYTES + 3) - 1 if count else 0
    return {"charge": charge, "lines": lines, "padding": " " * (room - used)}
