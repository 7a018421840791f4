"""Store keys. One keyspace, split by a one-byte prefix, shared by RocksDB, the in-memory store and the
ledger changelog (whose record keys are these same bytes).

Ids may not contain NUL (the fold rejects such events as `invalid_event`), so NUL separates key parts
without ambiguity. Timer keys sort by deadline: a range scan yields timers in firing order.
"""

from __future__ import annotations

SEP = b"\x00"
PARENT = b"p"
CHILD = b"c"
IDEMPOTENCY = b"i"
TIMER = b"t"
META = b"m"

# Partition metadata kept in the changelog (ledger time, last tick).
META_KEY = META + SEP + b"partition"
# Store-only metadata: the changelog offset this projection is current up to. Written in the same batch as
# the state it describes; never itself in the changelog.
CHANGELOG_OFFSET_KEY = META + SEP + b"changelog_offset"

DEADLINE_DIGITS = 16


# The fold builds several keys per event, so each key is formatted as one str and encoded once (the UTF-8 of
# a concatenation is the concatenation of the parts' UTF-8): half the cost of joining encoded parts.
_SEP = SEP.decode()
_PARENT, _CHILD, _IDEMPOTENCY, _TIMER = PARENT.decode(), CHILD.decode(), IDEMPOTENCY.decode(), TIMER.decode()


def parent_key(parent_id: str) -> bytes:
    return f"{_PARENT}{_SEP}{parent_id}".encode()


def child_key(parent_id: str, child_id: str) -> bytes:
    return f"{_CHILD}{_SEP}{parent_id}{_SEP}{child_id}".encode()


def idempotency_key(parent_id: str, key: str) -> bytes:
    return f"{_IDEMPOTENCY}{_SEP}{parent_id}{_SEP}{key}".encode()


def timer_key(deadline_ms: int, kind: str, parent_id: str, child_id: str) -> bytes:
    return f"{_TIMER}{_SEP}{deadline_ms:0{DEADLINE_DIGITS}d}{_SEP}{kind}{_SEP}{parent_id}{_SEP}{child_id}".encode()


def prefix(kind: bytes) -> bytes:
    return kind + SEP
