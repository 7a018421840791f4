"""Hostile records on the real broker: each gets a dead letter or a result, no partition stops or wedges, the
good events after them settle, and other parents' balances are what they would be without them.

The records: an undecodable record of 900 KB (its dead letter must still fit the topic), a valid event whose id
makes it 900 KB (refused at decode, not folded into outputs too large to produce), a varint beyond 64 bits
(fastavro would have wrapped it around to a small quantity), a usage at the limit of a quantity repeated past
the balance headroom, an id beyond its size, a TTL that would have set a time bomb; a second ParentReserved and a
ParentClosed for the parent keyed so that they land in another partition (misrouted: no second ledger, no
release of the parent's capacity); a Tick ten years ahead in every partition (only the processor's own ticks
advance ledger time). And the values of the issue: an event of 1.2 MB in two ids of 600 KB (compressed on the
wire, so the broker takes it), a usage of 2**63-1 on a child that already has usage, a lease_ttl_ms of 2**63-1 on
a ParentReserved and a ChildActivated, and a map written with a negative block count whose entry is a varint of
2**64 + 10 (fastavro would have wrapped it around to 5). A second parent in the same partition, whose events come
before and after them all, ends with exactly the balances its own events give; `settle replay --topic` agrees."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.limits import DEAD_LETTER_ORIGINAL_BYTES, MAX_ID_BYTES, MAX_QUANTITY, MAX_TTL_MS
from branch_settlement.schemas.partitioning import partition_of
from tests.kafka.pipeline import REPO, ProcessorProcess, projection_ledgers, read_partitions, wait_for_results

pytestmark = pytest.mark.kafka

POLICY = {"max_live_children": 4, "reconciliation_timeout_ms": 600_000, "lending_limit": {}}


def event(etype: str, parent_id: str, key: str, **fields) -> dict:
    return default_codec().event_from_json({"type": etype, "event_id": key, "idempotency_key": key,
                                            "parent_id": parent_id, "occurred_at_ms": int(time.time() * 1000),
                                            **fields})


def varint(n: int) -> bytes:
    """The varint (LEB128) of a non-negative n, however large: beyond 64 bits an Avro long must refuse it."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def zigzag(n: int) -> bytes:
    """An Avro long (or int) as written: zigzag, then varint."""
    return varint(2 * n if n >= 0 else -2 * n - 1)


def settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=600)


def test_hostile_records_neither_stop_nor_wedge_nor_corrupt(kafka_topics, tmp_path: Path) -> None:
    codec = default_codec()
    topic = kafka_topics.name("branch-events")
    partitions = kafka_topics.spec.topic("branch-events").partitions
    home = partition_of("P", partitions)
    # the bystander: another parent in P's partition, so that every hostile record of P is folded among its events
    other = next(k for k in (f"Q{i}" for i in range(1000)) if partition_of(k, partitions) == home)
    # idempotent: the test relies on the order of a partition's records (a retried batch must not overtake)
    producer = Producer({"bootstrap.servers": kafka_topics.bootstrap_servers, "partitioner": "murmur2_random",
                         "message.max.bytes": 1_000_000, "enable.idempotence": True})

    def send(value: bytes, key: str = "P") -> None:
        producer.produce(topic, value=value, key=key.encode())

    def send_event(e: dict) -> None:
        send(codec.encode_event(e), e["parent_id"] or "P")

    send_event(event("ParentReserved", "P", "P/p", capacity={"tokens": {"quantity": 100, "kind": "logical"}},
                     lease_ttl_ms=3_600_000, policy=POLICY))
    send_event(event("ChildReserved", "P", "P/A", child_id="A", branch_id="A", attempt_id="A1",
                     quantities={"tokens": 20}))
    send_event(event("ParentReserved", other, "Q/p", capacity={"tokens": {"quantity": 50, "kind": "logical"}},
                     lease_ttl_ms=3_600_000, policy=POLICY))
    send_event(event("ChildReserved", other, "Q/C", child_id="C", branch_id="C", attempt_id="C1",
                     quantities={"tokens": 10}))
    hostile = 0
    send(b"\xc3\x01" + b"\xff" * 900_000)  # undecodable, 900 KB
    hostile += 1
    send(codec.encode_event(event("ChildReserved", "P", "P/big", child_id="B" * 900_000, branch_id="B",
                                  attempt_id="B1", quantities={"tokens": 1})))  # valid Avro, far too large
    hostile += 1
    # 1.2 MB in two ids: beyond the producer's and the topic's default limits uncompressed, so sent lz4-compressed
    # (the broker checks the compressed batch) by a producer of its own, between flushes to keep the order.
    two_ids = codec.encode_event(event("ChildReserved", "P", "P/two-ids", child_id="X" * 600_000,
                                       branch_id="Y" * 600_000, attempt_id="X1", quantities={"tokens": 1}))
    assert len(two_ids) > 1_200_000
    producer.flush(30)
    squeezed = Producer({"bootstrap.servers": kafka_topics.bootstrap_servers, "partitioner": "murmur2_random",
                         "message.max.bytes": 2_000_000, "compression.type": "lz4", "enable.idempotence": True})
    squeezed.produce(topic, value=two_ids, key=b"P")
    assert squeezed.flush(30) == 0
    hostile += 1
    good = codec.encode_event(event("ChildReserved", "P", "P/wrap", child_id="W", branch_id="W", attempt_id="W1",
                                    quantities={"tokens": 5}))
    at = good.rindex(bytes([10]))  # zigzag(5), the record's last value
    send(good[:at] + b"\x8a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x02" + good[at + 1:])  # 11 bytes: 2**71 + 10
    hostile += 1
    # quantities as one block of count -1 (then the block's size in bytes), its one entry a varint of 2**64 + 10:
    # wrapped around to 64 bits that is zigzag(5). An empty map is its terminating 0 alone: replace that.
    empty = codec.encode_event(event("ChildReserved", "P", "P/negative-block", child_id="N", branch_id="N",
                                     attempt_id="N1", quantities={}))
    assert empty.endswith(b"\x00")
    entry = zigzag(len("tokens")) + b"tokens" + varint(2**64 + 10)
    negative_block = empty[:-1] + zigzag(-1) + zigzag(len(entry)) + entry + b"\x00"
    send(negative_block)
    hostile += 1
    results_expected = 4  # the two parents, child A and child C
    for e in (event("ChildReserved", "P", "P/long-id", child_id="L" * (MAX_ID_BYTES + 1), branch_id="L",
                    attempt_id="L1", quantities={"tokens": 1}),
              event("ChildActivated", "P", "P/bomb", child_id="A", attempt_id="A1", lease_generation=1,
                    lease_ttl_ms=MAX_TTL_MS + 1),
              event("ChildActivated", "P", "P/bomb-max", child_id="A", attempt_id="A1", lease_generation=1,
                    lease_ttl_ms=2**63 - 1),
              event("ParentReserved", "P-ttl", "P-ttl/p", capacity={"tokens": {"quantity": 10, "kind": "logical"}},
                    lease_ttl_ms=2**63 - 1, policy=POLICY),
              event("ChildActivated", "P", "P/A/a", child_id="A", attempt_id="A1", lease_generation=1,
                    lease_ttl_ms=3_600_000),
              event("UsageReported", "P", "P/A/u1", child_id="A", attempt_id="A1", lease_generation=1,
                    usage_report_id="u1", usage={"tokens": 4}),
              event("UsageReported", "P", "P/A/u-max", child_id="A", attempt_id="A1", lease_generation=1,
                    usage_report_id="u-max", usage={"tokens": 2**63 - 1}),
              event("ChildCompleted", "P", "P/A/c", child_id="A", attempt_id="A1", lease_generation=1,
                    usage={"tokens": 12}),
              event("UsageAdjustment", "P", "P/A/adj", child_id="A", attempt_id="A1",
                    usage={"tokens": MAX_QUANTITY}, reason="an invoice far beyond the parent")):
        send_event(e)
        results_expected += 1
    elsewhere = next(k for k in (f"K{i}" for i in range(1000)) if partition_of(k, partitions) != home)
    send(codec.encode_event(event("ParentReserved", "P", "P/second", capacity={"tokens": {"quantity": 10**6,
                                  "kind": "logical"}}, lease_ttl_ms=3_600_000, policy=POLICY)), key=elsewhere)
    send(codec.encode_event(event("ParentClosed", "P", "P/close-elsewhere", outcome="cancelled")), key=elsewhere)
    results_expected += 2
    ten_years = int(time.time() * 1000) + 10 * 365 * 86_400_000
    forged = codec.encode_event(event("Tick", "", "tick/forged", now_ms=ten_years))
    for p in range(partitions):
        producer.produce(topic, value=forged, partition=p)
    results_expected += partitions
    # the bystander's own events after all of them: C uses 3 of its 10, D holds 15
    for e in (event("ChildActivated", other, "Q/C/a", child_id="C", attempt_id="C1", lease_generation=1,
                    lease_ttl_ms=3_600_000),
              event("ChildCompleted", other, "Q/C/c", child_id="C", attempt_id="C1", lease_generation=1,
                    usage={"tokens": 3}),
              event("ChildReserved", other, "Q/D", child_id="D", branch_id="D", attempt_id="D1",
                    quantities={"tokens": 15})):
        send_event(e)
        results_expected += 1
    producer.flush(30)
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g")
    try:
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, results_expected, 120, procs=[proc])
        results = [r for recs in read_partitions(kafka_topics.bootstrap_servers,
                                                 kafka_topics.name("settlement-results")).values() for _, _, r in recs]
        by_key = {r["idempotency_key"]: r for r in results}
        assert by_key["P/long-id"]["result"] == "invalid_event"
        for key in ("P/bomb", "P/bomb-max", "P-ttl/p", "P/A/u-max"):
            assert by_key[key]["result"] == "invalid_event", by_key[key]
        for key in ("P/A/a", "P/A/u1", "P/A/c", "Q/p", "Q/C", "Q/C/a", "Q/C/c", "Q/D"):
            assert by_key[key]["result"] == "ok", by_key[key]
        assert by_key["P/A/adj"]["result"] == "overdrawn"
        for key in ("P/big", "P/two-ids", "P/wrap", "P/negative-block"):  # dead letters: no result
            assert key not in by_key, by_key[key]
        for key in ("P/second", "P/close-elsewhere"):
            assert by_key[key]["result"] == "misrouted", by_key[key]
            assert f"belongs to partition {home} of {partitions}" in by_key[key]["detail"]
            assert by_key[key]["input_partition"] == partition_of(elsewhere, partitions)
        forged_results = [r for r in results if r["idempotency_key"] == "tick/forged"]
        assert sorted(r["input_partition"] for r in forged_results) == list(range(partitions))
        assert {r["result"] for r in forged_results} == {"tick_not_accepted"}
        assert max(r["ledger_time_ms"] for r in results) < ten_years
        dead = [r for recs in read_partitions(kafka_topics.bootstrap_servers,
                                              kafka_topics.name("branch-events-dlq")).values() for _, _, r in recs]
        assert len(dead) == hostile, [d["reason"][:120] for d in dead]
        reasons = " | ".join(d["reason"] for d in dead)
        assert "an event is at most" in reasons and "beyond the 64 bits" in reasons and "sha256" in reasons
        assert f"a record of {len(two_ids)} bytes" in reasons
        [refused] = [d for d in dead if d["original"] == negative_block] or [None]
        assert refused is not None and refused["reason"], [d["reason"][:120] for d in dead]
        assert all(len(d["original"]) <= DEAD_LETTER_ORIGINAL_BYTES for d in dead)
        releases = [r for recs in read_partitions(kafka_topics.bootstrap_servers,
                                                  kafka_topics.name("capacity-releases")).values()
                    for _, _, r in recs if "release_key" in r]
        assert sorted((r["parent_id"], r["child_id"], r["quantity"], r["destination"]) for r in releases) == [
            ("P", "A", 8, "parent"), (other, "C", 7, "parent")]
        assert "STOPPED" not in proc.output()
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    ledger = projection_ledgers(tmp_path / "state", "g")[home]
    # exactly what the bystander's own five events give: 50, less C's 10 and D's 15, C's 3 committed, 7 back
    assert ledger["parents"][other] == {"status": "open", "dimensions": {"tokens": {
        "capacity": 50, "available": 32, "outstanding": 15, "pending": 0, "awaiting_confirmation": 0, "lent": 0,
        "returned_to_pool": 0, "committed": 3, "overdrawn": 0}}}
    assert {c: (v["state"], v["reserved"], v["consumed"]) for c, v in ledger["children"].items()
            if c.startswith(f"{other}/")} == {f"{other}/C": ("released", {"tokens": 10}, {"tokens": 3}),
                                              f"{other}/D": ("reserved", {"tokens": 15}, {"tokens": 0})}
    # P itself: A's 12 and the adjustment committed, the adjustment drawn from the 88 available and the rest
    # overdrawn; the refused usage of 2**63 - 1 nowhere
    assert ledger["parents"]["P"]["dimensions"]["tokens"] == {
        "capacity": 100, "available": 0, "outstanding": 0, "pending": 0, "awaiting_confirmation": 0, "lent": 0,
        "returned_to_pool": 0, "committed": 12 + MAX_QUANTITY, "overdrawn": MAX_QUANTITY - 88}
    assert [c for c in ledger["children"] if c.startswith("P/")] == ["P/A"]  # none of a dead letter or a refusal
    assert all("P-ttl" not in led["parents"] for led in projection_ledgers(tmp_path / "state", "g").values())
    replayed = settle("replay", "--topic", "branch-events", "--topic-prefix", kafka_topics.prefix,
                      "--bootstrap-servers", kafka_topics.bootstrap_servers, "--state-dir", str(tmp_path / "state"),
                      "--group-id", "g")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "AGREES" in replayed.stdout and "and the live ledgers" in replayed.stdout, replayed.stdout


def test_a_record_too_large_to_produce_stops_its_partition_not_the_processor(kafka_topics, tmp_path: Path) -> None:
    """The fold's records fit the default message sizes by construction; an operator who lowers the
    producer's message.max.bytes below one of them gets that partition stopped with the record's size and the
    setting named, not a checkpoint aborted twice a second for ever; the other partitions go on. (A topic's
    max.message.bytes refusing a record is the broker's delivery report: tests/kafka/test_ticks_unit.py.)"""
    codec = default_codec()
    topic = kafka_topics.name("branch-events")
    partitions = kafka_topics.spec.topic("branch-events").partitions
    producer = Producer({"bootstrap.servers": kafka_topics.bootstrap_servers, "partitioner": "murmur2_random",
                         "enable.idempotence": True})
    big, small = "P-big", next(f"Q{i}" for i in range(1000) if partition_of(f"Q{i}", partitions) != partition_of(
        "P-big", partitions))
    extra_args = ("--commit-events", "1", "--kafka-config", "message.max.bytes=8000")

    def send(e: dict) -> None:
        producer.produce(topic, value=codec.encode_event(e), key=e["parent_id"].encode())

    for parent in (big, small):
        send(event("ParentReserved", parent, f"{parent}/p", capacity={"tokens": {"quantity": 10, "kind": "logical"}},
                   lease_ttl_ms=3_600_000, policy=POLICY))
        send(event("ChildReserved", parent, f"{parent}/A", child_id="A", branch_id="A", attempt_id="A1",
                   quantities={"tokens": 5}))
    send(event("ChildSkipped", big, f"{big}/A/skip", child_id="A", attempt_id="A1", reason="x" * 20_000))
    producer.flush(30)
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g",
                            extra_args=extra_args)
    try:
        deadline = time.monotonic() + 90
        while "STOPPED" not in proc.output():
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.output()[-3000:]
            time.sleep(0.5)
        send(event("ChildSkipped", small, f"{small}/A/skip", child_id="A", attempt_id="A1", reason="pruned"))
        producer.flush(30)
        deadline = time.monotonic() + 60
        while True:
            results = {r["idempotency_key"]: r for recs in read_partitions(
                kafka_topics.bootstrap_servers, kafka_topics.name("settlement-results")).values() for _, _, r in recs}
            if f"{small}/A/skip" in results:
                break
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.output()[-3000:]
            time.sleep(0.5)
        time.sleep(2)
        output = proc.output()
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    home = partition_of(big, partitions)
    assert f"PARTITION {home} STOPPED: a record of " in output
    assert "message.max.bytes" in output and "Raise that setting" in output
    assert output.count("STOPPED") == 1 and output.count("checkpoint aborted") <= 1, output[-3000:]
    assert results[f"{small}/A/skip"]["result"] == "ok"
    assert f"{big}/A/skip" not in results  # nothing of the stopped partition's checkpoint was committed
