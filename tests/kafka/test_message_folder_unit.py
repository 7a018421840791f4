"""The compiled per-message loop (native/src/batch.rs, `MessageFolder`) against the Python one it stands in for
(`Processor._fold`, message by message): the same consumed batches, with every kind of message the loop hands back
(consumer errors, undecodable records, redeliveries, unassigned partitions, misrouted events, Ticks on the input)
and with checkpoints and a failing fold in the middle, give the same buffered records, ledger changes, positions,
event counts and stopped partitions.

Real confluent-kafka `Message`s, real tasks over in-memory stores; no broker: the checkpoint stands in for the
transaction by doing what a committed one does to the tasks (forget the buffers, write the store)."""

from __future__ import annotations

import random

import pytest
from confluent_kafka import Consumer, KafkaError, Message

from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.processors.kafka.processor import Processor
from branch_settlement.processors.workload import Generator
from branch_settlement.projections import keys
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas import native
from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.limits import MAX_EVENT_BYTES
from branch_settlement.schemas.partitioning import partition_of

pytestmark = [pytest.mark.unit, pytest.mark.skipif(native.module() is None, reason="needs the compiled module")]

PARTITIONS = 4
TOPIC = "branch-events"
POISONED = "poisoned-parent"


class PoisonedStore(MemoryStore):
    """A store whose read of one parent's record raises: the fold of that parent's first event fails (a bug of
    ours, as far as the processor can tell), which stops its partition."""

    def get(self, key: bytes):
        if key == keys.parent_key(POISONED):
            raise RuntimeError("the store failed to read a parent")
        return super().get(key)


def messages_of(seed: int, events: int, codec, poisoned: bool = True) -> list[Message]:
    """A workload as consumed: each event at the next offset of its parent's partition, with what the loop must
    hand back mixed in (and, if `poisoned`, an event whose fold fails halfway through)."""
    rng = random.Random(seed)
    offsets = dict.fromkeys(range(PARTITIONS + 1), 0)
    consumed = []

    def message(partition: int, value: bytes | None, key: bytes | None = None, error=None) -> Message:
        offset = offsets[partition]
        offsets[partition] += 1
        return Message(topic=TOPIC, partition=partition, offset=offset, key=key, value=value, error=error)

    items = list(Generator(seed).generate(events, ticks=False))
    poison = {"type": "ParentReserved", "event_id": "poison-1", "idempotency_key": f"{POISONED}/reserve",
                "parent_id": POISONED, "occurred_at_ms": 1_764_410_400_000,
                "capacity": {"tokens": {"quantity": 10, "kind": "logical"}}, "lease_ttl_ms": 60_000,
                "policy": {"max_live_children": 2, "reconciliation_timeout_ms": 60_000, "lending_limit": {}}}
    if poisoned:
        items.insert(len(items) // 2, poison)
    for n, item in enumerate(items):
        if isinstance(item, str):  # the generator's hostile lines: not Avro at all
            consumed.append(message(n % PARTITIONS, item.encode()))
            continue
        event = codec.event_from_json(item)
        partition = partition_of(event["parent_id"], PARTITIONS)
        consumed.append(message(partition, codec.encode_event(event), event["parent_id"].encode()))
        roll = rng.random()
        if roll < 0.01:  # a redelivery of the message just consumed
            consumed.append(Message(topic=TOPIC, partition=partition, offset=offsets[partition] - 1,
                                    value=codec.encode_event(event)))
        elif roll < 0.02:
            consumed.append(Message(topic=TOPIC, partition=partition, offset=offsets[partition],
                                    error=KafkaError(KafkaError._PARTITION_EOF)))
        elif roll < 0.03:  # single-object bytes cut short, or with bytes after the record
            data = codec.encode_event(event)
            consumed.append(message(partition, data[:len(data) // 2] if rng.random() < 0.5 else data + b"\0"))
        elif roll < 0.032:  # over the largest event, behind a valid header: a dead letter; the partition goes on
            data = codec.encode_event(event)
            consumed.append(message(partition, data + b"\0" * (MAX_EVENT_BYTES + 1 - len(data))))
        elif roll < 0.035:  # to a partition this processor does not own
            consumed.append(message(PARTITIONS, codec.encode_event(event)))
        elif roll < 0.04:  # a Tick on the input, and an event in the wrong partition
            tick = codec.event_from_json({"type": "Tick", "event_id": f"t{n}", "idempotency_key": f"tick/0/{n}",
                                          "parent_id": "", "occurred_at_ms": 1, "now_ms": 1_764_410_400_000 + n})
            consumed.append(message(partition, codec.encode_event(tick)))
            consumed.append(message((partition + 1) % PARTITIONS, codec.encode_event(event)))
    return consumed


class Run:
    """A processor over in-memory tasks, fed consumed batches; its checkpoints recorded."""

    def __init__(self, compiled_loop: bool, commit_records: int) -> None:
        codec = default_codec()
        config = ProcessorConfig(commit_records=commit_records)
        self.processor = p = Processor(config, {TOPIC: TOPIC}, codec=codec)
        if not compiled_loop:
            p._message_folder = None
        elif p._message_folder is None:
            pytest.fail("the compiled codec gave no compiled event readers")
        # Only paused (a stopped partition): never connected, and its connection errors not logged.
        p.consumer = Consumer({"group.id": "message-folder-unit", "bootstrap.servers": "127.0.0.1:1",
                               "log_level": 0})
        p.tasks = {n: PartitionTask(n, PoisonedStore(), codec, 0, PARTITIONS) for n in range(PARTITIONS)}
        self.checkpoints: list[dict] = []
        p.checkpoint = self.checkpoint

    def checkpoint(self) -> bool:
        """What a committed checkpoint leaves behind, and a record of what it committed."""
        p = self.processor
        committed = {}
        for n, task in p.tasks.items():
            changes = task.view.changes()
            committed[n] = (list(task.records), changes, dict(task.released), task.results, task.dead_letters,
                            task.position, task.next_offset)
            task.forget_committed()
            task.write_committed(changes, 0)
        self.checkpoints.append({"events": p.events_since_checkpoint, "partitions": committed})
        p.events_since_checkpoint = 0
        return True

    def feed(self, messages: list[Message], batch: int) -> None:
        for start in range(0, len(messages), batch):
            self.processor._fold_batch(messages[start:start + batch])
        self.processor._event_counters.flush()
        self.checkpoint()

    def outcome(self) -> dict:
        p = self.processor
        counts = {labels["result"]: sample for labels, sample in
                  ((s.labels, s.value) for metric in p.metrics.events.collect() for s in metric.samples
                   if s.name.endswith("_total"))}
        return {"checkpoints": self.checkpoints, "counts": counts,
                "stopped": {n: task.stopped for n, task in p.tasks.items()},
                "stores": {n: dict(task.store.scan(b"")) for n, task in p.tasks.items()}}


@pytest.mark.parametrize("seed,batch,commit_records", [(1, 500, 20_000), (2, 37, 60), (3, 1, 200)])
def test_the_compiled_loop_folds_a_consumed_batch_as_the_python_loop_does(seed, batch, commit_records) -> None:
    messages = messages_of(seed, 3_000, default_codec())
    compiled, python = Run(True, commit_records), Run(False, commit_records)
    compiled.feed(messages, batch)
    python.feed(messages, batch)
    got, want = compiled.outcome(), python.outcome()
    assert len(got["checkpoints"]) == len(want["checkpoints"])
    for n, (g, w) in enumerate(zip(got["checkpoints"], want["checkpoints"])):
        assert g == w, f"checkpoint {n} differs"
    assert got == want
    # The batches held what the loop must hand back, and the run met every case.
    stopped = [n for n, reason in got["stopped"].items() if reason]
    assert stopped == [partition_of(POISONED, PARTITIONS)], got["stopped"]
    assert "the store failed to read a parent" in got["stopped"][stopped[0]]
    letters = [value for cp in got["checkpoints"] for c in cp["partitions"].values() for topic, _, value in c[0]
               if topic == "branch-events-dlq"]
    assert sum(c[4] for cp in got["checkpoints"] for c in cp["partitions"].values()) == len(letters) > 0
    assert any(b"is at most" in letter for letter in letters)  # the oversized records' reason
    assert {"ok", "misrouted", "tick_not_accepted"} <= set(got["counts"]), got["counts"]
    if commit_records < 20_000:
        assert len(got["checkpoints"]) > 3  # checkpoints called by the loop itself, when a task was full


def test_the_compiled_loop_takes_most_messages_itself() -> None:
    """Most of a realistic batch is folded by the compiled loop, not handed back to `_fold`."""
    messages = messages_of(4, 2_000, default_codec(), poisoned=False)
    run = Run(True, 20_000)
    handed_back = []
    fold = run.processor._fold

    def counting_fold(message):
        handed_back.append(message)
        return fold(message)

    # Replacing _fold on the instance turns the compiled loop off (a simulation does so); count through the class.
    original = Processor._fold
    Processor._fold = lambda self, message: counting_fold(message)
    try:
        run.feed(messages, 500)
    finally:
        Processor._fold = original
    assert 0 < len(handed_back) < len(messages) * 0.1, (len(handed_back), len(messages))


def test_a_processor_whose_fold_a_simulation_replaced_folds_every_message_through_it() -> None:
    messages = messages_of(5, 300, default_codec())
    run = Run(True, 20_000)
    seen = []
    fold = run.processor._fold
    run.processor._fold = lambda message: seen.append(message) or fold(message)
    run.feed(messages, 500)
    assert len(seen) == len(messages)


def test_the_python_codec_gives_no_compiled_readers_and_no_compiled_loop() -> None:
    from branch_settlement.schemas.codec import Codec
    codec = Codec(implementation=native.PYTHON)
    assert codec.compiled_event_readers() == {}
    assert Processor(ProcessorConfig(), {TOPIC: TOPIC}, codec=codec)._message_folder is None


def messages_from(events: list[dict], codec) -> list[Message]:
    """`events` as consumed: each at the next offset of its parent's partition."""
    offsets = dict.fromkeys(range(PARTITIONS), 0)
    consumed = []
    for event in events:
        partition = partition_of(event["parent_id"], PARTITIONS) if event["parent_id"] else 0
        consumed.append(Message(topic=TOPIC, partition=partition, offset=offsets[partition],
                                key=event["parent_id"].encode(), value=codec.encode_event(event)))
        offsets[partition] += 1
    return consumed


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_loop_writes_results_releases_and_audits_as_the_encoder_does_on_adversarial_streams(seed) -> None:
    """The compiled loop has the core write the results, releases and audit records of the events it takes itself (no
    dicts):
    the reference model's streams (duplicates, conflicts, stale and superseded reports, escalations, overruns,
    retries, loans), and the worked and borrowing examples, give the same records as the loop of dicts and the
    output encoder."""
    from tests.ledger.test_implementations_agree import example
    from tests.ledger.test_reference_model import Stream
    codec = default_codec()
    events = [codec.event_from_json(event) for event in Stream(seed, 400).build()]
    if seed == 0:
        events += example("worked-example.jsonl", codec) + example("borrowing.jsonl", codec)
    messages = messages_from(events, codec)
    compiled, python = Run(True, 20_000), Run(False, 20_000)
    compiled.feed(messages, 64)
    python.feed(messages, 64)
    got, want = compiled.outcome(), python.outcome()
    assert got == want
    written = [record for cp in got["checkpoints"] for c in cp["partitions"].values() for record in c[0]]
    audits = [value for topic, _, value in written if topic == "settlement-audit"]
    assert len(audits) > 100 and any(b"escalation" in value for value in audits)
    assert sum(topic == "capacity-releases" for topic, _, _ in written) > 10
    assert len(set(got["counts"])) > 5, got["counts"]
