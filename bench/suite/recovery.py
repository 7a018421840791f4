"""Replay (a file, the topic) and restore (a projection rebuilt from the changelog), each next to its ceiling:
the same records decoded or consumed with nothing else done. Each measurement runs in a fresh process
(`python -m bench.suite.recovery KIND ...`, one JSON line on stdout), so no heap or thread of the benchmark
driver weighs on it.

- file:    `settle replay FILE`'s path (processors.replay.sharded.replay_file over a JSON Lines file: its parents
           folded in shards, one process per core, merged into one fold's output) vs
           reading and decoding the same lines into events in one process (processors.replay.replayer.read_events);
- topic:   `settle replay --topic`'s audit replay (processors.crosscheck.topic_replay.audit_replay: re-fold the
           input topic with the processor's ticks of ledger-ticks merged in, compare every output) vs a raw
           read_committed consume of the same topics (ledger-ticks included), all at once by one consumer with
           the replay's reader settings (raw_consume);
- restore: processors.kafka.restore.restore into empty RocksDB projections, to the group's committed
           offsets, vs a raw read_committed consume of the changelog.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from branch_settlement.processors.kafka.restore import restore
from branch_settlement.processors.kafka.ticks import TICKS_TOPIC
from branch_settlement.processors.crosscheck.readers import BATCH, IDLE_WAIT_S, READER_SETTINGS, know_leaders
from branch_settlement.processors.crosscheck.topic_replay import audit_replay
from branch_settlement.processors.ledger.outputs import OUTPUT_TOPICS
from branch_settlement.processors.replay.replayer import read_events
from branch_settlement.processors.replay.sharded import replay_file
from branch_settlement.processors.crosscheck.live_ledgers import live_projections
from branch_settlement.projections import keys
from branch_settlement.projections.store import RocksStore
from branch_settlement.schemas.codec import default_codec


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its children waited for (the replays' workers)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def ceiling_around(ceiling, measured):
    """The ceiling timed before and after the measurement, the faster kept (a ceiling is a best case, and
    the first read of a topic may find the broker's page cache colder than the second)."""
    value, first_s = timed(ceiling)
    cpu = cpu_seconds()
    result, measured_s = timed(measured)
    global measured_cpu_s
    measured_cpu_s = cpu_seconds() - cpu
    _, second_s = timed(ceiling)
    return value, min(first_s, second_s), result, measured_s


measured_cpu_s = 0.0  # CPU seconds of the last measurement (ceiling_around), its workers included


def raw_consume(config: dict, topics: list[str], partitions: int) -> dict[str, int]:
    """Every committed record of `topics`, read_committed from the beginning to the end by one consumer with
    the audit replay's reader settings (large fetches, a 10 ms fetch wait), touching each value: the ceiling
    of anything that has to read these topics in one process. Returns the record count per topic."""
    consumer = Consumer({**config, "group.id": "bench-raw-consume", **READER_SETTINGS})
    try:
        know_leaders(consumer, topics)  # as the replays do (know_leaders says why)
        pending = {(topic, p) for topic in topics for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for topic, p in pending])
        counts = dict.fromkeys(topics, 0)
        while pending:
            # consume(n) waits out its timeout whenever fewer than n records are left: a short one
            for message in consumer.consume(num_messages=BATCH, timeout=IDLE_WAIT_S):
                err = message.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard((message.topic(), message.partition()))
                    continue
                counts[message.topic()] += 1
                len(message.value() or b"")
        return counts
    finally:
        consumer.close()


def file_replay(path: str) -> dict:
    """`settle replay FILE`'s fold (processors.replay.sharded.replay_file: parent shards on every core)."""
    codec = default_codec()
    lines, decode_s, (result, _), replay_s = ceiling_around(
        lambda: sum(1 for _ in read_events(path, codec)), lambda: replay_file(path, codec))
    return {"records": lines, "events": result.events, "dead_letters": len(result.dead_letters),
            "replay_s": round(replay_s, 3), "replay_events_per_s": round(lines / replay_s),
            "replay_cpu_us_per_record": round(measured_cpu_s * 1e6 / lines, 1),
            "ceiling_s": round(decode_s, 3), "ceiling_events_per_s": round(lines / decode_s)}


def topic_replay(bootstrap: str, names: dict[str, str], partitions: int, state_dir: str | None = None,
                 group: str | None = None) -> dict:
    """With `state_dir` and `group` (a stopped processor's), the final ledgers are compared too, as
    `settle replay --topic --state-dir` does: reading the live projections is part of the replay's time."""
    config = {"bootstrap.servers": bootstrap}
    codec = default_codec()
    topics = ["branch-events", TICKS_TOPIC, *OUTPUT_TOPICS]

    def replay_topic():
        live = live_projections(state_dir, group) if state_dir else None
        return audit_replay(config, names, codec, live_ledgers=live, keep_folded=False,
                            progress_stream=open("/dev/null", "w"))

    consumed, consume_s, report, replay_s = ceiling_around(
        lambda: raw_consume(config, [names[t] for t in topics], partitions), replay_topic)
    events = consumed[names["branch-events"]]
    return {"records": events, "output_records": sum(consumed.values()) - events, "agrees": report.agrees,
            "divergences": len(report.divergences), "compared": report.compared, "live_ledgers": bool(state_dir),
            "replay_s": round(replay_s, 3), "replay_cpu_us_per_record": round(measured_cpu_s * 1e6 / events, 1),
            "replay_events_per_s": round(events / replay_s), "ceiling_s": round(consume_s, 3),
            "ceiling_events_per_s": round(events / consume_s)}


def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=30)
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in found}


def restore_projection(bootstrap: str, changelog: str, input_topic: str, group: str, partitions: int) -> dict:
    config = {"bootstrap.servers": bootstrap}
    targets = committed_offsets(bootstrap, group, input_topic, partitions)
    with tempfile.TemporaryDirectory(prefix="bench-restore-") as tmp:
        stores = {p: RocksStore(Path(tmp) / f"partition-{p}") for p in range(partitions)}
        try:
            records, consume_s, applied, restore_s = ceiling_around(
                lambda: raw_consume(config, [changelog], partitions)[changelog],
                lambda: restore(stores, config, changelog, f"bench-restore-{group}", targets))
            children = sum(1 for store in stores.values() for _ in store.scan(keys.prefix(keys.CHILD)))
        finally:
            for store in stores.values():
                store.close()
    return {"changelog_records": records, "records_applied": sum(applied.values()), "children": children,
            "restore_s": round(restore_s, 3), "restore_records_per_s": round(sum(applied.values()) / restore_s),
            "restore_children_per_s": round(children / restore_s),
            "restore_s_per_million_children": round(restore_s * 1e6 / children, 1) if children else None,
            "restore_cpu_us_per_record": round(measured_cpu_s * 1e6 / sum(applied.values()), 2) if applied else None,
            "ceiling_s": round(consume_s, 3), "ceiling_records_per_s": round(records / consume_s),
            "ceiling_children_per_s": round(children / consume_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = parser.add_subparsers(dest="kind", required=True)
    f = kinds.add_parser("file", help="settle replay FILE vs decoding the file")
    f.add_argument("path")
    t = kinds.add_parser("topic", help="settle replay --topic vs consuming the topics")
    t.add_argument("--bootstrap-servers", required=True)
    t.add_argument("--names", required=True, help="JSON: logical topic name -> physical name")
    t.add_argument("--partitions", type=int, required=True)
    t.add_argument("--state-dir", help="the stopped processor's state directory: compare the live ledgers too")
    t.add_argument("--group", help="the processor's group (with --state-dir)")
    r = kinds.add_parser("restore", help="restore from the changelog vs consuming it")
    r.add_argument("--bootstrap-servers", required=True)
    r.add_argument("--names", required=True)
    r.add_argument("--group", required=True, help="the processor's group (its committed offsets are the target)")
    r.add_argument("--partitions", type=int, required=True)
    args = parser.parse_args(argv)
    if args.kind == "file":
        out = file_replay(args.path)
    elif args.kind == "topic":
        out = topic_replay(args.bootstrap_servers, json.loads(args.names), args.partitions, args.state_dir,
                           args.group)
    else:
        names = json.loads(args.names)
        out = restore_projection(args.bootstrap_servers, names["ledger-changelog"], names["branch-events"],
                                 args.group, args.partitions)
    print(json.dumps(out))
    return 0


def run(kind_args: list[str], timeout_s: float = 1800) -> dict:
    """Run one measurement in a fresh process; its JSON line."""
    import subprocess

    from bench.suite.env import REPO
    done = subprocess.run([sys.executable, "-m", "bench.suite.recovery", *kind_args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"bench.suite.recovery {kind_args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
