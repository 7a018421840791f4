"""Result codes (SPEC §10): exactly one per input event. Outcomes are data, not exceptions."""

OK = "ok"
DUPLICATE = "duplicate"
IDEMPOTENCY_CONFLICT = "idempotency_conflict"
OVERDRAWN = "overdrawn"

EXCEEDS_AVAILABLE = "exceeds_available"
FANOUT_EXCEEDED = "fanout_exceeded"
INVALID_TRANSITION = "invalid_transition"
DISPATCH_FENCED = "dispatch_fenced"
STALE_LEASE_GENERATION = "stale_lease_generation"
SUPERSEDED_ATTEMPT = "superseded_attempt"
UNKNOWN_PARENT = "unknown_parent"
UNKNOWN_CHILD = "unknown_child"
PARENT_CLOSED = "parent_closed"
ALREADY_SETTLED = "already_settled"
INVALID_EVENT = "invalid_event"
# A usage report whose usage_report_id this child already counted, under another idempotency key.
DUPLICATE_USAGE_REPORT = "duplicate_usage_report"
# A tick that does not move ledger time forward.
STALE_TICK = "stale_tick"
# The event would take the ledger past one of its own limits (schemas/limits.py): too many children for one
# parent, usage reports for one attempt, or a balance term beyond int64's headroom.
LIMIT_EXCEEDED = "limit_exceeded"
# The event's parent belongs to another partition (schemas/partitioning.py): folding it here would open a second
# ledger for the parent id. Nothing changes; the detail names the partition it belongs to.
MISROUTED = "misrouted"
# A Tick on the input topic: ledger time comes only from the processor's own ticks (topic ledger-ticks).
TICK_NOT_ACCEPTED = "tick_not_accepted"

# Explicit borrowing: a loan of a dimension the parent's policy gives no lending limit; a loan that would take
# what is lent past the limit; a reservation (or a loan) that must wait for lent capacity to come back: the
# processor asked the borrowers to return it (LoanRevocationRequested); a return of a loan the ledger never lent.
LENDING_NOT_ALLOWED = "lending_not_allowed"
EXCEEDS_LENDING_LIMIT = "exceeds_lending_limit"
AWAITING_REVOCATION = "awaiting_revocation"
UNKNOWN_LOAN = "unknown_loan"

# Results of applied events: stored under the idempotency key, so a redelivery gets `duplicate`.
# Rejections change nothing and are not stored: the same key may be retried (e.g. a reservation that
# exceeded `available` can succeed once siblings have released).
APPLIED = frozenset({OK, OVERDRAWN})

REJECTIONS = (
    EXCEEDS_AVAILABLE,
    FANOUT_EXCEEDED,
    INVALID_TRANSITION,
    DISPATCH_FENCED,
    STALE_LEASE_GENERATION,
    SUPERSEDED_ATTEMPT,
    UNKNOWN_PARENT,
    UNKNOWN_CHILD,
    PARENT_CLOSED,
    ALREADY_SETTLED,
    INVALID_EVENT,
    DUPLICATE_USAGE_REPORT,
    STALE_TICK,
    LIMIT_EXCEEDED,
    MISROUTED,
    TICK_NOT_ACCEPTED,
    LENDING_NOT_ALLOWED,
    EXCEEDS_LENDING_LIMIT,
    AWAITING_REVOCATION,
    UNKNOWN_LOAN,
)
ALL = (OK, DUPLICATE, IDEMPOTENCY_CONFLICT, OVERDRAWN) + REJECTIONS
