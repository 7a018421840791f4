"""The adversarial input: processors.workload's realistic stream (5% duplicate deliveries, 3% timeouts with
late final reports) made harder, from the same seed:

- reordered reports: a usage report or completion swapped with the next event of the same parent;
- late reports after expiry: a completion moved past the child's lease expiry (ledger time + 40 s);
- stale lease generations: a usage report repeated (new key, new report id) with an older generation;
- 1% malformed records: the workload's malformed JSON lines, published as raw bytes (not Avro), so they
  reach the processor as undecodable records (dead letters), which `settle produce` would have refused.

The stream carries the workload's Ticks: the simulation (faults/sim.py) turns them into the processor's
clock. Against a real broker only the processor advances ledger time (its own ticks from the system clock,
on ledger-ticks; a Tick on the input is refused), so `for_system_clock` splits the stream for the scenarios:
no Ticks, and the records that must come after a lease expiry (the completions moved late, the timed-out
children's late final reports) held back as a tail, their children's leases cut to SHORT_LEASE_MS. The
scenario publishes the tail once the processors' committed ticks have passed those leases
(faults/scenarios.py), so each of those children expires before its late report, whatever the speed.

`publish` produces records to the input topic in one idempotent producer, every event keyed by its parent_id
with the producer's murmur2 partitioner (schemas/partitioning.py), so each partition's order is the stream's
order and every event is in its parent's partition."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from confluent_kafka import Producer

from branch_settlement.processors.workload import CHILD_LEASE_TTL_MS, Generator, Mix
from branch_settlement.schemas.codec import default_codec

REORDER_RATE = 0.03
LATE_RATE = 0.01
STALE_RATE = 0.02
LATE_BY_MS = CHILD_LEASE_TTL_MS + 10_000
# The lease of a child whose late report is held back in the tail (for_system_clock): short, so the system
# clock passes it within seconds of the child's activation.
SHORT_LEASE_MS = 1_000


@dataclass
class Workload:
    seed: int
    records: list  # dict events, or str for a malformed record
    adversity: Counter = field(default_factory=Counter)
    # Idempotency keys of the completions _late moved past their child's lease expiry.
    late_keys: set = field(default_factory=set)

    def events(self) -> int:
        return sum(1 for r in self.records if not isinstance(r, str))


def build(seed: int, events: int, mix: Mix = Mix()) -> Workload:
    rng = random.Random(seed * 7919 + 1)
    records = list(Generator(seed, mix).generate(events))
    adversity: Counter = Counter()
    adversity["duplicate_deliveries"] = sum(1 for r in records if isinstance(r, dict) and r["event_id"].endswith("-dup"))
    adversity["malformed_records"] = sum(1 for r in records if isinstance(r, str))
    records = _stale_generations(records, rng, adversity)
    records = _reorder(records, rng, adversity)
    late_keys: set = set()
    records = _late(records, rng, adversity, late_keys)
    return Workload(seed, records, adversity, late_keys)


def _stale_generations(records: list, rng: random.Random, adversity: Counter) -> list:
    out = []
    for record in records:
        out.append(record)
        if (isinstance(record, dict) and record["type"] == "UsageReported" and not record["event_id"].endswith("-dup")
                and rng.random() < STALE_RATE):
            stale = dict(record, event_id=record["event_id"] + "-stale",
                         idempotency_key=record["idempotency_key"] + "/stale",
                         usage_report_id=record["usage_report_id"] + "-stale",
                         lease_generation=record["lease_generation"] - 1, final=False)
            out.append(stale)
            adversity["stale_lease_generations"] += 1
    return out


def _reorder(records: list, rng: random.Random, adversity: Counter) -> list:
    """Swap a report with the next event of the same parent (same partition: a real reordering)."""
    index_of_next: dict[int, int] = {}
    last_of_parent: dict[str, int] = {}
    for i in range(len(records) - 1, -1, -1):
        r = records[i]
        if isinstance(r, dict) and r["parent_id"]:
            if r["parent_id"] in last_of_parent:
                index_of_next[i] = last_of_parent[r["parent_id"]]
            last_of_parent[r["parent_id"]] = i
    swapped: set[int] = set()
    for i, r in enumerate(records):
        if (i in swapped or not isinstance(r, dict) or r["type"] not in ("UsageReported", "ChildCompleted")
                or i not in index_of_next or rng.random() >= REORDER_RATE):
            continue
        j = index_of_next[i]
        if j in swapped:
            continue
        records[i], records[j] = records[j], records[i]
        swapped.update((i, j))
        adversity["reordered_reports"] += 1
    return records


def _late(records: list, rng: random.Random, adversity: Counter, late_keys: set) -> list:
    """Move completions past the child's lease expiry: after the first tick LATE_BY_MS beyond them."""
    ticks = [(i, r["now_ms"]) for i, r in enumerate(records) if isinstance(r, dict) and r["type"] == "Tick"]
    moves: dict[int, list] = {}
    dropped: set[int] = set()
    for i, r in enumerate(records):
        if not isinstance(r, dict) or r["type"] != "ChildCompleted" or rng.random() >= LATE_RATE:
            continue
        target = next((ti for ti, now in ticks if now >= r["occurred_at_ms"] + LATE_BY_MS), None)
        if target is None or target <= i:
            continue
        dropped.add(i)
        late_keys.add(r["idempotency_key"])
        moves.setdefault(target, []).append(r)
        adversity["late_reports_after_expiry"] += 1
    out = []
    for i, r in enumerate(records):
        if i not in dropped:
            out.append(r)
        out.extend(moves.get(i, ()))
    return out


@dataclass
class LiveStream:
    """The workload as the scenarios publish it against a real broker (for_system_clock)."""

    main: list  # published at the start
    tail: list  # published once the processors' clock has passed every shortened lease
    short_leases: int  # children whose lease was cut to SHORT_LEASE_MS


def is_late_report(record) -> bool:
    """The final report of a child the workload lets time out (processors/workload.py: no outcome before the
    lease ends, then a late report). The completions _late moved are in Workload.late_keys."""
    return (isinstance(record, dict) and record["type"] == "UsageReported"
            and record["idempotency_key"].endswith("/late"))


def for_system_clock(workload: Workload) -> LiveStream:
    """The stream without its Ticks, split into a main part and a tail of late reports (with their duplicate
    deliveries, which share their idempotency keys); the leases of the tail's children cut to SHORT_LEASE_MS
    in every ChildActivated of theirs (duplicates too, so a duplicate stays a duplicate). The order within
    each part is the stream's."""
    tail_keys = set(workload.late_keys)
    tail_keys.update(r["idempotency_key"] for r in workload.records if is_late_report(r))
    children = {(r["parent_id"], r["child_id"]) for r in workload.records
                if isinstance(r, dict) and r["idempotency_key"] in tail_keys}
    main, tail = [], []
    for record in workload.records:
        if isinstance(record, dict):
            if record["type"] == "Tick":
                continue
            if record["type"] == "ChildActivated" and (record["parent_id"], record["child_id"]) in children:
                record = dict(record, lease_ttl_ms=SHORT_LEASE_MS)
            if record["idempotency_key"] in tail_keys:
                tail.append(record)
                continue
        main.append(record)
    return LiveStream(main, tail, len(children))


def publish(records: list, bootstrap: str, topic: str) -> int:
    """Produce `records` (events as dicts, malformed records as str: sent as raw bytes) in order; return how
    many results the processors must commit for them (one per event). A Tick is refused: only the processor
    advances ledger time, and the input topic answers one with `tick_not_accepted`."""
    codec = default_codec()
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                         "partitioner": "murmur2_random", "linger.ms": 20, "log_level": 0,
                         "queue.buffering.max.messages": 200_000})
    failures = []

    def delivered(err, _msg) -> None:
        if err is not None:
            failures.append(err)

    def send(value: bytes, key: bytes) -> None:
        while True:
            try:
                producer.produce(topic, value=value, key=key, on_delivery=delivered)
                return
            except BufferError:
                producer.poll(0.05)

    expected = 0
    for n, record in enumerate(records):
        if isinstance(record, str):
            send(record.encode(), f"malformed-{n}".encode())
            continue
        event = codec.event_from_json(record)
        if event["type"] == "Tick":
            raise ValueError(f"record {n} is a Tick: only the processor advances ledger time (ledger-ticks)")
        send(codec.encode_event(event), event["parent_id"].encode())
        expected += 1
    remaining = producer.flush(120)
    if failures or remaining:
        raise RuntimeError(f"publishing the workload: {len(failures)} failed, {remaining} unacknowledged: "
                           f"{failures[:1]}")
    return expected
