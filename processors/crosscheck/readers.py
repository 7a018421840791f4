"""Readers of the committed topics for the cross-check: read_committed consumers with large fetches, the
topics' metadata (partitions, leaders) and offsets (watermarks, offsets for a time, last stable offsets)."""

from __future__ import annotations

import sys
from typing import Callable, Iterable

from confluent_kafka import (Consumer, ConsumerGroupTopicPartitions, IsolationLevel, KafkaError, KafkaException,
                             TopicPartition)
from confluent_kafka.admin import AdminClient, OffsetSpec

from branch_settlement.processors.kafka.clients import positions_reached
from branch_settlement.processors.kafka.errors import KafkaFailure
from branch_settlement.processors.kafka.preflight import kafka_error
from branch_settlement.processors.kafka.ticks import anchor_of
from branch_settlement.processors.replay.export_format import decode_record
from branch_settlement.processors.replay.replayer import Input, merge_ticks
from branch_settlement.schemas.codec import Codec, CodecError

# A reader of whole topics: large fetches, and a short wait whenever the fetched records run out, since
# consume(n, timeout) waits out its timeout on every batch of fewer than n records.
READER_SETTINGS = {"enable.auto.commit": False, "isolation.level": "read_committed", "enable.partition.eof": True,
                   "fetch.wait.max.ms": 10, "max.partition.fetch.bytes": 8 << 20, "fetch.max.bytes": 64 << 20}
BATCH = 10_000
IDLE_WAIT_S = 0.05
GROUP_ID = "settle-audit-replay"


def read_committed(client_config: dict, topic: str, partitions: Iterable[int], start: dict[int, int] | None = None,
                   end: dict[int, int] | None = None, progress: Callable[[int], None] | None = None
                   ) -> dict[int, list]:
    """Committed records of `topic` per partition: (offset, key, value), from `start` (default: the
    beginning) up to the end offsets `end` (default: the ends when reading began). `progress(n)`: told of
    every batch of records read."""
    consumer = Consumer({**client_config, "group.id": GROUP_ID, **READER_SETTINGS})
    try:
        partitions = list(partitions)
        if end is None:
            end = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
        start = start or {}
        records: dict[int, list] = {p: [] for p in partitions}
        pending = {p for p in partitions if start.get(p, 0) < end[p]}
        if not pending:
            return records
        consumer.assign([TopicPartition(topic, p, start.get(p, -2)) for p in pending])
        while pending:
            kept = 0
            for message in consumer.consume(num_messages=BATCH, timeout=IDLE_WAIT_S):
                p = message.partition()
                err = message.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(p)
                        continue
                    raise KafkaFailure(f"reading {topic}[{p}]: {err.str()} ({err.name()})", code=err.name())
                if message.offset() >= end[p]:
                    pending.discard(p)
                    continue
                records[p].append((message.offset(), message.key(), message.value()))
                kept += 1
                if message.offset() >= end[p] - 1:
                    pending.discard(p)
            if progress is not None and kept:
                progress(kept)
            pending -= reached(consumer, topic, pending, end)
        return records
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"reading {topic}", exc) from None
    finally:
        consumer.close()


def reached(consumer: Consumer, topic: str, partitions, end: dict[int, int]) -> set[int]:
    """The partitions of `topic` whose position is at or past `end` (clients.positions_reached)."""
    return {p for _, p in positions_reached(consumer, [(topic, p) for p in partitions],
                                            {(topic, p): end[p] for p in partitions})}


def know_leaders(consumer: Consumer, topics: list[str]) -> None:
    """Fetch the topics' metadata before assigning partitions at a logical offset (the beginning): assigned
    before its leader is known, a partition's offset query waits for librdkafka's retry timer ("no current
    leader for partition: (re)starting offset query timer"), which every reader would pay (docs/audit.md)."""
    for topic in topics:
        consumer.list_topics(topic, timeout=10)


def partitions_of(client_config: dict, topic: str) -> list[int]:
    consumer = Consumer({**client_config, "group.id": GROUP_ID})
    try:
        metadata = consumer.list_topics(topic, timeout=10)
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"metadata of {topic}", exc) from None
    finally:
        consumer.close()
    found = metadata.topics.get(topic)
    if found is None or found.error is not None:
        raise KafkaFailure(f"topic {topic} does not exist")
    return sorted(found.partitions)


def offsets_for_time(client_config: dict, topic: str, partitions: list[int], time_ms: int) -> dict[int, int]:
    consumer = Consumer({**client_config, "group.id": GROUP_ID})
    try:
        found = consumer.offsets_for_times([TopicPartition(topic, p, time_ms) for p in partitions], timeout=10)
    finally:
        consumer.close()
    ends = {}
    for tp in found:
        ends[tp.partition] = tp.offset if tp.offset >= 0 else sys.maxsize
    return ends


def read_folded_records(client_config: dict, names: dict[str, str], partitions: list[int], codec: Codec,
                        progress: Callable[[int], None] | None = None
                        ) -> dict[int, list[tuple[Input, bytes | None]]]:
    """What the processor folded, per partition: the committed input records (each with its raw bytes) with
    its ledger ticks merged in where it folded them (processors/replay/replayer.py, merge_ticks; a tick has
    no raw bytes of its own). `progress(n)`: told of the input records as they are read."""
    topic = names["branch-events"]
    ends = {p: high for p, (high, _) in input_bounds(client_config, topic, partitions).items()}
    raw = read_committed(client_config, topic, partitions, end=ends, progress=progress)
    ticks = read_ticks(client_config, names["ledger-ticks"], partitions, codec)
    folded = {}
    for p in partitions:
        values = {offset: value for offset, _, value in raw[p]}
        inputs = (decode_record(codec, p, offset, value)[1] for offset, _, value in raw[p])
        folded[p] = [(item, None if item.ledger_tick else values[item.offset])
                     for item in merge_ticks(inputs, ticks[p], ends[p])]
    return folded


def read_folded_inputs(client_config: dict, names: dict[str, str], partitions: list[int], codec: Codec,
                       progress: Callable[[int], None] | None = None) -> dict[int, list[Input]]:
    """`read_folded_records` without the raw bytes."""
    return {p: [item for item, _ in records]
            for p, records in read_folded_records(client_config, names, partitions, codec, progress).items()}


def read_ticks(client_config: dict, topic: str, partitions: list[int], codec: Codec) -> dict[int, list[Input]]:
    """The processor's ticks of each partition (topic ledger-ticks), in their order, as ledger-tick Inputs
    at their anchors, for processors/replay/replayer.py merge_ticks."""
    raw = read_committed(client_config, topic, partitions)
    return {p: [tick_input(codec, offset, key, value) for offset, key, value in recs] for p, recs in raw.items()}


def tick_input(codec: Codec, offset: int, key: bytes | None, value: bytes | None) -> Input:
    """A ledger-ticks record as the replay folds it: a Tick before input offset `key`, or a dead letter
    saying why it is not one (only the processor writes there: any such record is a divergence)."""
    anchor = anchor_of(key)
    if anchor is None:
        return Input(-1, None, f"ledger-ticks offset {offset}: key {key!r} is not an input offset", ledger_tick=True)
    try:
        event = codec.decode_event(value or b"")
    except CodecError as exc:
        return Input(anchor, None, f"ledger-ticks offset {offset}: {exc}", ledger_tick=True)
    if event["type"] != "Tick":
        return Input(anchor, None, f"ledger-ticks offset {offset}: a {event['type']}, not a Tick", ledger_tick=True)
    return Input(anchor, event, ledger_tick=True)


def input_bounds(client_config: dict, topic: str, partitions: list[int]) -> dict[int, tuple[int, int]]:
    """(end, beginning) of each partition of the input when reading begins; the end is the last stable
    offset (read_committed), where the replay of that partition stops."""
    consumer = Consumer({**client_config, "group.id": GROUP_ID, **READER_SETTINGS})
    try:
        bounds = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            bounds[p] = (high, min(low, high))
        return bounds
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"offsets of {topic}", exc) from None
    finally:
        consumer.close()


def committed_offsets(client_config: dict, group_id: str, topic: str, partitions: list[int]) -> dict[int, int]:
    """Where the consumer group `group_id` (the processors') has committed each partition of `topic`: the
    next offset it will fold, every input before it folded and its outputs committed with it (the processor
    commits its offsets in the transaction of its outputs); 0 where it committed nothing. An admin request
    (OffsetFetch: DESCRIBE on the group and the topic), which neither joins the group nor changes it."""
    admin = AdminClient(client_config)
    request = [ConsumerGroupTopicPartitions(group_id, [TopicPartition(topic, p) for p in partitions])]
    try:
        found = admin.list_consumer_group_offsets(request, request_timeout=10)[group_id].result()
    except KafkaException as exc:
        raise kafka_error(exc, f"the offsets group {group_id} committed on {topic}", client_config) from None
    committed = {p: 0 for p in partitions}
    for tp in found.topic_partitions or ():
        if tp.error is not None:
            raise KafkaFailure(f"the offset group {group_id} committed on {topic}[{tp.partition}]: {tp.error.str()}",
                               code=tp.error.name())
        if tp.partition in committed and tp.offset >= 0:
            committed[tp.partition] = tp.offset
    return committed


def stable_ends(admin: AdminClient, topics: list[str], partition: int) -> dict[str, int]:
    """The last stable offset of `partition` of each topic (read_committed), in one request."""
    request = {TopicPartition(topic, partition): OffsetSpec.latest() for topic in topics}
    futures = admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=10)
    try:
        return {tp.topic: future.result().offset for tp, future in futures.items()}
    except KafkaException as exc:
        raise KafkaFailure.wrap(f"end offsets of partition {partition}", exc) from None


__all__ = ["READER_SETTINGS", "BATCH", "IDLE_WAIT_S", "GROUP_ID", "read_committed", "reached", "know_leaders", "partitions_of",
           "offsets_for_time", "read_folded_records", "read_folded_inputs", "read_ticks", "tick_input", "input_bounds", "committed_offsets", "stable_ends"]
