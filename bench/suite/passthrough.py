"""The ceiling: a transactional pass-through with the processor's Kafka work and none of its own.

It consumes the input topic exactly as `settle run` does (read_committed, batches of 500, the same consumer
settings), and for every input record produces the records the processor produced for that partition, in
proportion: partition p's outputs of each topic are the processor's committed outputs of that partition
(same bytes, same keys, so the same sizes and compressibility), spread evenly over p's input records. It
checkpoints like the processor (every commit_interval_ms or commit_events): begin, produce the buffer, flush,
send the offsets with the group metadata, commit. No decode, no fold, no store.

    python -m bench.suite.passthrough --plan PLAN.pickle --input TOPIC --output-prefix PREFIX --group G ...

`build_plan` writes the plan from the processor's committed outputs. With `--echo`, the latency ceiling:
each input record itself goes to `settlement-results` in place of the processor's result (a reader matches
it by event_id like a result), the other outputs as above, input offsets beyond the plan wrapping around.
Each checkpoint is logged like the processor's (DEBUG "checkpoint committed: ... ms (its steps)").

`--schedule end` (default) is `settle run`'s loop: a checkpoint is due commit_interval_ms after the end of
the previous one, and each consume call may wait up to 50 ms for a full batch. `--schedule start` is a
fixed-period loop: due commit_interval_ms after the start of the previous checkpoint, and consume never
waits past that moment; it shows what the checkpoint cadence alone costs in latency.
"""

from __future__ import annotations

import argparse
import logging
import pickle
import signal
import sys
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from bench.suite.env import OUTPUT_TOPICS, RESULTS, TopicSet
from branch_settlement.processors.crosscheck.readers import read_committed
from branch_settlement.processors.kafka.processor_clients import PRODUCER_GUARANTEES, PRODUCER_TUNING

log = logging.getLogger("bench.passthrough")
CONSUME_BATCH = 500  # processors/kafka/processor.py
IDLE_POLL_S = 0.05


def build_plan(client_config: dict, source: TopicSet, inputs: dict[int, int], path: Path) -> dict[str, int]:
    """Read the processor's committed outputs of every partition; write the plan; return record counts."""
    partitions = list(range(source.partitions))
    plan = {"inputs": inputs, "outputs": {}}
    counts = {}
    for logical in OUTPUT_TOPICS:
        records = read_committed(client_config, source.name(logical), partitions)
        plan["outputs"][logical] = {p: [(key, value) for _, key, value in recs] for p, recs in records.items()}
        counts[logical] = sum(len(recs) for recs in records.values())
    path.write_bytes(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
    return counts


class PassThrough:
    def __init__(self, args: argparse.Namespace) -> None:
        plan = pickle.loads(Path(args.plan).read_bytes())
        self.inputs: dict[int, int] = plan["inputs"]
        self.outputs: dict[str, dict[int, list]] = plan["outputs"]
        self.output_topics = {logical: args.output_prefix + logical for logical in self.outputs}
        self.echo_topic = args.output_prefix + RESULTS if args.echo else None
        if args.echo:
            self.outputs.pop(RESULTS, None)
        self.input_topic = args.input
        self.commit_interval_ms = args.commit_interval_ms
        self.fixed_period = args.schedule == "start"
        self.commit_events = args.commit_events
        config = {"bootstrap.servers": args.bootstrap_servers}
        # the processor's own producer settings (processors/kafka/processor_clients.py)
        self.producer = Producer({**PRODUCER_TUNING, **config, **PRODUCER_GUARANTEES,
                                  "transactional.id": args.transactional_id, "transaction.timeout.ms": 30_000})
        self.producer.init_transactions(30)
        self.consumer = Consumer({**config, "group.id": args.group, "isolation.level": "read_committed",
                                  "enable.auto.commit": False, "enable.auto.offset.store": False,
                                  "auto.offset.reset": "earliest", "session.timeout.ms": 6000,
                                  "max.poll.interval.ms": 60_000, "heartbeat.interval.ms": 1200})
        self.buffer: list[tuple[str, int, bytes | None, bytes]] = []
        self.positions: dict[int, int] = {}
        self.events = 0
        self.last_checkpoint = time.monotonic()  # end of the last checkpoint, or its start with a fixed period

    def outputs_of(self, partition: int, offset: int, value: bytes, key: bytes | None):
        """The processor's outputs of `partition` spread evenly over its input offsets."""
        if self.echo_topic is not None:
            yield self.echo_topic, partition, key, value
        n = self.inputs.get(partition, 0)
        if not n:
            return
        offset %= n
        for logical, per_partition in self.outputs.items():
            records = per_partition.get(partition, [])
            lo, hi = offset * len(records) // n, (offset + 1) * len(records) // n
            topic = self.output_topics[logical]
            for key, value in records[lo:hi]:
                yield topic, partition, key, value

    def run(self, should_stop) -> None:
        self.consumer.subscribe([self.input_topic], on_assign=self._on_assign)
        try:
            while not should_stop():
                timeout = IDLE_POLL_S
                if self.fixed_period and self.events:
                    due = self.last_checkpoint + self.commit_interval_ms / 1000
                    timeout = min(IDLE_POLL_S, max(due - time.monotonic(), 0.0))
                for message in self.consumer.consume(num_messages=CONSUME_BATCH, timeout=timeout):
                    if message.error():
                        continue
                    p, offset = message.partition(), message.offset()
                    self.buffer.extend(self.outputs_of(p, offset, message.value(), message.key()))
                    self.positions[p] = offset + 1
                    self.events += 1
                if self.events and (self.events >= self.commit_events or
                                    (time.monotonic() - self.last_checkpoint) * 1000 >= self.commit_interval_ms):
                    self.checkpoint()
            if self.events:
                self.checkpoint()
        finally:
            self.consumer.close()
            self.producer.flush(5)

    def _on_assign(self, consumer, partitions) -> None:
        log.info("assigned partitions %s", sorted(tp.partition for tp in partitions))

    def checkpoint(self) -> None:
        started = time.monotonic()
        events, records = self.events, len(self.buffer)
        self.producer.begin_transaction()
        # No delivery report per record, as the processor asks none (processors/kafka/checkpoint.py): a record
        # that fails puts the transaction in the abortable error state, which the commit raises.
        for topic, partition, key, value in self.buffer:
            while True:
                try:
                    self.producer.produce(topic, value, key, partition)
                    break
                except BufferError:
                    self.producer.poll(0.05)
        produced = time.monotonic()
        self.producer.flush(30)
        flushed = time.monotonic()
        offsets = [TopicPartition(self.input_topic, p, offset) for p, offset in sorted(self.positions.items())]
        self.producer.send_offsets_to_transaction(offsets, self.consumer.consumer_group_metadata(), 30)
        offsets_sent = time.monotonic()
        self.producer.commit_transaction(30)
        self.buffer.clear()
        self.events = 0
        ended = time.monotonic()
        self.last_checkpoint = started if self.fixed_period else ended
        # the processor's line (processors/kafka/processor.py), its steps in this checkpoint's order
        log.debug("checkpoint committed: %d events, %d records, %.1f ms (produce %.1f, flush %.1f, offsets %.1f, "
                  "commit %.1f)", events, records, (ended - started) * 1000, (produced - started) * 1000,
                  (flushed - produced) * 1000, (offsets_sent - flushed) * 1000, (ended - offsets_sent) * 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--plan", required=True, help="pickle written by build_plan")
    parser.add_argument("--input", required=True, help="input topic (physical name)")
    parser.add_argument("--output-prefix", required=True, help="prefix of the output topics")
    parser.add_argument("--group", required=True)
    parser.add_argument("--transactional-id", required=True)
    parser.add_argument("--commit-interval-ms", type=int, default=100)
    parser.add_argument("--commit-events", type=int, default=2_000)
    parser.add_argument("--echo", action="store_true", help="the input record itself in place of the result")
    parser.add_argument("--schedule", choices=("end", "start"), default="end",
                        help="commit interval counted from the end (settle run) or the start of the last checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    PassThrough(args).run(lambda: bool(stopping))
    log.info("stopped cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
