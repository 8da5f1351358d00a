"""bmqctl's self-checking payloads, in Python (the same bytes as bmqctl/src/payload.rs).

A consumer can verify every byte of such a payload and learn who produced it, with which
sequence number. Used by the SDK acceptance suite (test_sdk.py) and its benchmark
(bench_sdk.py) to exchange messages with `bmqctl produce` / `bmqctl consume`. Needs no
environment variable and no broker.

Layout (integers big-endian), HEADER_LEN = 32 bytes:

    offset  size  field
    0       4     magic b"BMQP"
    4       8     producer_id (u64)
    12      8     sequence (u64)
    20      4     total payload length, header included (u32)
    24      8     check: FNV-1a 64 of bytes 0..24
    32      ..    filler: splitmix64 seeded by (producer_id, sequence), each 64-bit word
                  written as 8 little-endian bytes, the last word truncated
"""

import struct

HEADER_LEN = 32
PAYLOAD_LEN_MAX = 0xFFFF_FFFF
MAGIC = b"BMQP"

_MASK = 0xFFFF_FFFF_FFFF_FFFF
_GOLDEN = 0x9E37_79B9_7F4A_7C15


def fnv1a64(data):
    """FNV-1a 64 of `data` (offset basis 0xcbf29ce484222325, prime 0x100000001b3)."""
    h = 0xCBF2_9CE4_8422_2325
    for b in data:
        h ^= b
        h = (h * 0x0100_0000_01B3) & _MASK
    return h


def _rotl64(x, n):
    return ((x << n) | (x >> (64 - n))) & _MASK


def filler(producer_id, sequence, length):
    """The first `length` filler bytes of message `sequence` of `producer_id`."""
    state = producer_id ^ _rotl64(sequence, 32) ^ _GOLDEN
    words = []
    for _ in range((length + 7) // 8):
        state = (state + _GOLDEN) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK
        words.append((z ^ (z >> 31)).to_bytes(8, "little"))
    return b"".join(words)[:length]


def encode(producer_id, sequence, size):
    """A payload of max(size, HEADER_LEN) bytes for message `sequence` of `producer_id`."""
    if not 0 <= size <= PAYLOAD_LEN_MAX:
        raise ValueError(f"payload size {size} out of range")
    size = max(size, HEADER_LEN)
    head = MAGIC + struct.pack(">QQI", producer_id, sequence, size)
    head += struct.pack(">Q", fnv1a64(head))
    return head + filler(producer_id, sequence, size - HEADER_LEN)


def verify(payload):
    """Checks every byte of `payload`; returns its (producer_id, sequence).

    Raises ValueError saying what is wrong (too short, bad magic, corrupt header, length
    mismatch, or the offset of the first corrupt filler byte).
    """
    payload = bytes(payload)
    if len(payload) < HEADER_LEN:
        raise ValueError(
            f"payload of {len(payload)} bytes is shorter than the {HEADER_LEN}-byte header"
        )
    if payload[:4] != MAGIC:
        raise ValueError("payload does not start with the BMQP magic")
    (check,) = struct.unpack(">Q", payload[24:32])
    if check != fnv1a64(payload[:24]):
        raise ValueError("payload header is corrupt")
    producer_id, sequence, expected = struct.unpack(">QQI", payload[4:24])
    if expected != len(payload):
        raise ValueError(f"payload header says {expected} bytes, payload has {len(payload)}")
    body = payload[HEADER_LEN:]
    want = filler(producer_id, sequence, len(body))
    if body != want:
        offset = next(i for i, (a, b) in enumerate(zip(body, want)) if a != b)
        raise ValueError(
            f"payload of producer {producer_id} sequence {sequence} is corrupt at byte "
            f"{HEADER_LEN + offset}"
        )
    return producer_id, sequence
