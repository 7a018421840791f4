"""CPython's cyclic garbage collector, kept off the hot path.

The processor and the replays hold many long-lived objects (the ledger's decoded records, a replay's derived
outputs), and the collector's oldest generation rescans all of them whenever enough new objects survive:
folding the seeded workload with the default settings spent a tenth of its time there, in long pauses
(measured with gc.callbacks: docs/benchmarks.md). None of those objects form reference cycles (plain dicts,
lists and strings, freed by reference counting as the cache evicts them), so after each checkpoint
everything alive is moved out of the collector's sight (`gc.freeze`): later collections scan only what was
allocated since. Nor do the collections between two checkpoints run every 700 new objects (CPython's default,
a young collection every few events that scans again what the fold keeps until the checkpoint: ~6% of the
processor's main thread): the young generation's threshold is `YOUNG_THRESHOLD`, and each checkpoint collects
the objects made since the last one itself, once, before it freezes the survivors, so a cycle that became
garbage meanwhile is reclaimed there. A full collection still runs now and then (every
`FULL_COLLECTION_CHECKPOINTS` checkpoints of the process, at most `FULL_COLLECTION_INTERVAL_S` apart), between
two checkpoints, to reclaim what cycles were frozen meanwhile (an exception kept with its traceback, a replaced
client with its callbacks): what the freezing costs is that they live until then. Process-wide, as the collector
is.
"""

from __future__ import annotations

import gc
import time

YOUNG_THRESHOLD = 100_000  # new objects (net) between two checkpoints before a collection runs anyway
FULL_COLLECTION_CHECKPOINTS = 1000
FULL_COLLECTION_INTERVAL_S = 600.0
# Off for a process that creates clients by the thousand (the fault simulation: each simulated incarnation's
# processor is a cycle that freezing would keep until the next full collection).
enabled = True

_since_full = 0
_last_full = time.monotonic()


def after_checkpoint() -> None:
    """At a checkpoint boundary: freeze the survivors, after a full collection now and then."""
    global _since_full
    if not enabled:
        return
    threshold = gc.get_threshold()
    if threshold[0] != YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, *threshold[1:])
    _since_full += 1
    if _since_full >= FULL_COLLECTION_CHECKPOINTS or time.monotonic() - _last_full >= FULL_COLLECTION_INTERVAL_S:
        full_collection()
    else:
        gc.collect(1)  # what was made since the last freeze (the oldest generation only after many collections)
    gc.freeze()


def full_collection() -> None:
    """Everything back in view, collected, and frozen again (a pause of tens of milliseconds)."""
    global _since_full, _last_full
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _since_full = 0
    _last_full = time.monotonic()
