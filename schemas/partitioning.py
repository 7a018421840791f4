"""Which partition a parent belongs to: Kafka's default partitioner over the parent id, defined once.

Every event of a parent is keyed by its `parent_id`, and the producer's partitioner (librdkafka's
`murmur2_random`, the Java client's default) puts it in partition `murmur2(key) & 0x7fffffff % partitions`.
The processor folds an event only in that partition (result `misrouted` anywhere else), so one parent id can
never have two ledgers, whatever key or explicit partition a producer used. This module is that function, bit
for bit Kafka's `Utils.murmur2`: tests/kafka/test_ticks_unit.py (test_murmur2_is_kafkas) checks it against the
vectors of Kafka's own UtilsTest.testMurmur2, and on a real broker the partition librdkafka's `murmur2_random`
chose for a key is the one this module names (tests/kafka/test_consumer_api.py,
test_publish_and_wait_returns_the_events_own_result; tests/kafka/test_hostile_input.py).
"""

from __future__ import annotations

from functools import lru_cache

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 of `data` as an unsigned 32-bit number."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    end = length & ~3
    for i in range(0, end, 4):
        k = (data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24) * _M & _MASK
        k ^= k >> 24
        k = k * _M & _MASK
        h = (h * _M & _MASK) ^ k
    tail = length & 3
    if tail == 3:
        h ^= data[end + 2] << 16
    if tail >= 2:
        h ^= data[end + 1] << 8
    if tail >= 1:
        h ^= data[end]
        h = h * _M & _MASK
    h ^= h >> 13
    h = h * _M & _MASK
    h ^= h >> 15
    return h


@lru_cache(maxsize=65536)  # a parent's events come in runs: its id is hashed once per run, not per event
def partition_of(parent_id: str, partitions: int) -> int:
    """The partition of `partitions` that the parent's events belong to."""
    return (murmur2(parent_id.encode()) & 0x7FFFFFFF) % partitions
