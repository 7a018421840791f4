"""The input boundary's limits, defined once: every field of an event has a range, and every record the fold
can write fits a topic's default maximum message size (1 MiB) by construction. The codec enforces what it can
see in one record (its size, valid Unicode); the fold's validation enforces the ranges (`invalid_event`) and the
ledger's own limits (`limit_exceeded`). docs/processor.md ("Input limits") says the same for users.

Why these numbers: ids are names, not payloads; quantities and times keep every sum the fold computes far
inside int64 (an Avro long) however long a ledger runs, and the balance terms are checked against
MAX_BALANCE before a settlement is applied; a parent's record lists its children and its speculative winners,
and a child's record its usage report ids, so their counts times MAX_ID_BYTES bound the ledger's records.
"""

# One event, as encoded on the input topic (Avro) or as one JSON line: larger is a dead letter.
MAX_EVENT_BYTES = 64 * 1024
# Ids (event, parent, child, branch, attempt, usage report, dimension names), in UTF-8 bytes.
MAX_ID_BYTES = 200
# An idempotency key (SPEC builds a child's from four parts, each an id) and a record's Kafka key.
MAX_KEY_BYTES = 1024
# Dimensions in one capacity, quantities, usage or lending-limit map.
MAX_DIMENSIONS = 32
# One quantity (capacity, reservation, usage, lending limit).
MAX_QUANTITY = 2**50
# Times: a Tick's now_ms (ledger time), and every TTL and timeout.
MAX_TIME_MS = 2**50
MAX_TTL_MS = 2**42  # about 139 years
MAX_LEASE_GENERATION = 2**31
# What one parent's and one attempt's records may list.
MAX_CHILDREN_PER_PARENT = 1024
MAX_USAGE_REPORTS_PER_ATTEMPT = 1024
# Loans one parent's record lists (open and returned): with its children and winners at their limits, a parent
# record of this many loans, each of the longest ids and MAX_DIMENSIONS quantities and usage, still fits 1 MiB.
MAX_LOANS_PER_PARENT = 16
# No balance term and no child's consumption may grow beyond this: int64 with headroom.
MAX_BALANCE = 2**62
# The part of an undecodable record kept in its dead letter: a larger record is refused for its size, and the
# reason names its size and digest.
DEAD_LETTER_ORIGINAL_BYTES = MAX_EVENT_BYTES
