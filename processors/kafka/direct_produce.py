"""Where the compiled produce loop may hand records to librdkafka itself (native/src/produce.rs).

confluent-kafka's `Producer.produce` costs the processor's main thread more than librdkafka's own work: it parses
its arguments, allocates a per-message state for the delivery callback whether one is given or not, and each
message's delivery report then takes the interpreter lock to free that state. Most records a checkpoint produces
need no delivery report (only the last of each topic-partition does), so the compiled loop produces those with
librdkafka's `rd_kafka_produceva` on the producer's own handle: the same topic, partition, key and value, copied,
in the same order on the same queue, and no per-message state, which confluent-kafka's delivery callback skips
(docs/decisions.md, 38). Records with a delivery report, and any record librdkafka refuses for another reason than
a full queue, still go through `produce`, which raises what it always raised.

The direct path is taken only where it can be exact: the compiled implementation is selected, the producer is
confluent-kafka's own `Producer` (not a subclass or a simulation), and the librdkafka that confluent-kafka loaded
is found among the process's mapped libraries (Linux) and exports the functions used. The compiled code also checks,
at every call, that the handle it reads from the producer is a producer handle whose opaque is that very producer
(confluent-kafka gives each handle its object as the opaque its callbacks get). `settle --implementation python`
turns it off with the rest of the compiled code.
"""

from __future__ import annotations

import logging
from functools import cache

from confluent_kafka import Producer

from branch_settlement.schemas import native

log = logging.getLogger("settle.produce")

MAPS = "/proc/self/maps"


def librdkafka_path(maps: str = MAPS) -> str | None:
    """The path of the librdkafka mapped into this process (the one confluent-kafka links), or None."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                path = line.rstrip("\n").split(maxsplit=5)[5:]
                if path and "/librdkafka" in path[0]:
                    return path[0]
    except OSError:
        return None
    return None


@cache
def _opened() -> bool:
    open_library = native.compiled_function("direct_produce_open")
    if open_library is None:
        return False
    path = librdkafka_path()
    opened = path is not None and open_library(path)
    if not opened:
        log.info("records are produced through confluent-kafka's produce only: its librdkafka was not found (%s)",
                 path or "not among the mapped libraries")
    return opened


def direct(producer) -> bool:
    """Whether the compiled loop may produce `producer`'s records without a delivery report directly."""
    return type(producer) is Producer and native.compiled_function("produce_records") is not None and _opened()
