"""Input records for the benchmarks, and how they reach the input topic.

`realistic(seed, events, partitions)`: the seeded workload of processors/workload.py without its Ticks, as
`settle produce` publishes it (Avro single-object encoded, keyed by parent_id, Kafka's murmur2 partitioner),
with its 1% malformed lines produced as raw undecodable bytes (the processor dead-letters them). Ledger time
comes from the processor's own ticks (its clock; ledger-ticks): a Tick on the input would only be answered
`tick_not_accepted`. `realistic_jsonl_lines` keeps the Ticks: a file replay folds the ticks in its lines.
`ledger_fill(seed, children, partitions)`: parents of 64 children, each child one ChildReserved: the cheapest
way to put a million children into the ledger.

`HeldLoad` writes records inside one open transaction and commits it on `release()`: consumers already in
the group (read_committed) see the whole backlog at one instant, so a measurement starts at a known time
with no group join or restore in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import Producer

from branch_settlement.processors.workload import START_MS, Generator
from branch_settlement.schemas.codec import Codec, default_codec

LOAD_TRANSACTION_TIMEOUT_MS = 600_000
FILL_CHILDREN_PER_PARENT = 64


@dataclass(frozen=True)
class Record:
    partition: int | None  # None: by key, murmur2 (as BranchEventProducer)
    key: bytes | None
    value: bytes
    match_id: str | None  # event_id whose result the latency test waits for; None: no result (dead letter)


def encode_workload(items, partitions: int, codec: Codec) -> list[Record]:
    records = []
    malformed = 0
    for item in items:
        if isinstance(item, str):
            records.append(Record(malformed % partitions, None, item.encode(), None))
            malformed += 1
            continue
        event = codec.event_from_json(item)
        if event["type"] == "Tick":
            raise ValueError("a Tick is not produced to the input: only the processor advances ledger time")
        records.append(Record(None, event["parent_id"].encode(), codec.encode_event(event), event["event_id"]))
    return records


def realistic(seed: int, events: int, partitions: int, codec: Codec | None = None) -> list[Record]:
    return encode_workload(Generator(seed).generate(events, ticks=False), partitions, codec or default_codec())


def realistic_jsonl_lines(seed: int, events: int) -> list[str]:
    """The same workload as `realistic(seed, events, ...)` as JSON Lines (what `settle replay FILE` reads),
    with the generator's Ticks: a file has no processor clock, its replay folds the ticks in its lines."""
    import json
    return [item if isinstance(item, str) else json.dumps(item, separators=(",", ":"))
            for item in Generator(seed).generate(events)]


def ledger_fill_events(children: int, first_parent: int = 0):
    """Parents of 64 reserved children; times advance 1 ms per event from START_MS."""
    t = START_MS
    parents = (children + FILL_CHILDREN_PER_PARENT - 1) // FILL_CHILDREN_PER_PARENT
    for n in range(first_parent, first_parent + parents):
        parent_id = f"fill-{n:07d}"
        t += 1
        yield {"type": "ParentReserved", "event_id": f"{parent_id}-0", "idempotency_key": f"{parent_id}/reserve",
               "parent_id": parent_id, "occurred_at_ms": t,
               "capacity": {"tokens": {"quantity": FILL_CHILDREN_PER_PARENT * 100, "kind": "logical"}},
               "lease_ttl_ms": 3_600_000,
               "policy": {"max_live_children": FILL_CHILDREN_PER_PARENT + 8, "reconciliation_timeout_ms": 600_000,
                          "lending_limit": {}}}
        for c in range(FILL_CHILDREN_PER_PARENT):
            t += 1
            yield {"type": "ChildReserved", "event_id": f"{parent_id}-c{c}", "idempotency_key": f"{parent_id}/c{c}",
                   "parent_id": parent_id, "occurred_at_ms": t, "child_id": f"c{c}", "branch_id": f"c{c}",
                   "attempt_id": f"c{c}-a1", "quantities": {"tokens": 100}}


def ledger_fill(children: int, partitions: int, codec: Codec | None = None) -> list[Record]:
    return encode_workload(ledger_fill_events(children), partitions, codec or default_codec())


def producer_config(client_config: dict) -> dict:
    """An orchestrator's producer (BranchEventProducer's settings)."""
    return {**client_config, "enable.idempotence": True, "acks": "all", "partitioner": "murmur2_random",
            "linger.ms": 5}


def produce(producer: Producer, topic: str, record: Record, on_delivery=None) -> None:
    while True:
        try:
            if record.partition is None:
                producer.produce(topic, value=record.value, key=record.key, on_delivery=on_delivery)
            else:
                producer.produce(topic, value=record.value, key=record.key, partition=record.partition,
                                 on_delivery=on_delivery)
            return
        except BufferError:
            producer.poll(0.05)


class HeldLoad:
    """Records written to `topic` in one transaction that stays open until `release()`."""

    def __init__(self, client_config: dict, topic: str, records: list[Record], transactional_id: str) -> None:
        self.topic = topic
        self.count = len(records)
        self.failures: list = []
        self.per_partition: dict[int, int] = {}  # records delivered per partition
        self.producer = Producer({**producer_config(client_config), "transactional.id": transactional_id,
                                  "transaction.timeout.ms": LOAD_TRANSACTION_TIMEOUT_MS,
                                  "queue.buffering.max.messages": 500_000})
        self.producer.init_transactions(30)
        self.producer.begin_transaction()
        for record in records:
            produce(self.producer, topic, record, self._delivered)
        remaining = self.producer.flush(120)
        if remaining or self.failures:
            self.producer.abort_transaction(30)
            raise RuntimeError(f"loading {topic}: {remaining} undelivered, failures {self.failures[:3]}")

    def _delivered(self, err, msg) -> None:
        if err is not None:
            self.failures.append(err)
        else:
            self.per_partition[msg.partition()] = self.per_partition.get(msg.partition(), 0) + 1

    def abort(self) -> None:
        """Give up (the measurement failed before the release): nothing becomes visible."""
        try:
            self.producer.abort_transaction(30)
        except Exception:  # best effort: the transaction times out on its own anyway
            pass

    def release(self) -> float:
        """Commit: the backlog becomes visible to read_committed consumers. Returns the monotonic time."""
        self.producer.commit_transaction(60)
        return time.monotonic()


def load_now(client_config: dict, topic: str, records: list[Record], transactional_id: str) -> dict[int, int]:
    """Write and commit at once; returns the records per partition."""
    load = HeldLoad(client_config, topic, records, transactional_id)
    load.release()
    return load.per_partition
