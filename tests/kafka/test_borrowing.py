"""Explicit borrowing end to end (docs/contract.md, "Borrowing"): through the real broker and a real
processor, a borrower takes idle capacity of a parent that lends, a sibling's reservation that only the loan
could cover is `awaiting_revocation` and the processor asks the loan back (a `LoanRevocationRequested` on
capacity-releases), the borrower returns it with its usage, and the sibling's retry is `ok`. Published with
`settle produce` and the producer API, read with the consumer API; `settle replay --topic` agrees afterwards.
The unit tests here hold the consumer API to the processor's bytes of a revocation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from branch_settlement.processors.kafka.clients import BranchEventProducer
from branch_settlement.processors.kafka.consumers import (CapacityReleased, LoanRevocationRequested, SettlementConsumer,
                                                          decode_output, encode_output, from_record)
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.schemas.codec import default_codec
from tests.harness import T0, Ledger
from tests.kafka.pipeline import REPO, ProcessorProcess, wait_for_results

POLICY = {"max_live_children": 8, "reconciliation_timeout_ms": 600_000, "lending_limit": {"tokens": 50}}


def settle(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=600, input=stdin)


def now_ms() -> int:
    return int(time.time() * 1000)


def opening_lines(parent: str) -> str:
    """What `settle produce` publishes: the parent (100 tokens, lending at most 50), child A (40), loan L1 (30)."""
    t = now_ms()
    events = [
        {"type": "ParentReserved", "event_id": f"{parent}-1", "idempotency_key": f"{parent}/ParentReserved/1",
         "parent_id": parent, "occurred_at_ms": t, "lease_ttl_ms": 3_600_000, "policy": POLICY,
         "capacity": {"tokens": {"quantity": 100, "kind": "logical"}}},
        {"type": "ChildReserved", "event_id": f"{parent}-2", "idempotency_key": f"{parent}/A/A1/reserve",
         "parent_id": parent, "occurred_at_ms": t, "child_id": "A", "branch_id": "A", "attempt_id": "A1",
         "quantities": {"tokens": 40}},
        {"type": "LoanRequested", "event_id": f"{parent}-3", "idempotency_key": f"{parent}/loan/L1/request",
         "parent_id": parent, "occurred_at_ms": t, "loan_id": "L1", "borrower": "batch-7",
         "quantities": {"tokens": 30}},
    ]
    return "".join(json.dumps(event) + "\n" for event in events)


def sibling_b(parent: str) -> dict:
    return {"type": "ChildReserved", "event_id": str(uuid.uuid4()), "idempotency_key": f"{parent}/B/B1/reserve",
            "parent_id": parent, "occurred_at_ms": now_ms(), "child_id": "B", "branch_id": "B", "attempt_id": "B1",
            "quantities": {"tokens": 45}}


@pytest.mark.kafka
def test_a_sibling_recalls_a_loan_and_its_retry_succeeds(kafka_topics, tmp_path: Path) -> None:
    common = ("--topic-prefix", kafka_topics.prefix, "--bootstrap-servers", kafka_topics.bootstrap_servers)
    config = {"bootstrap.servers": kafka_topics.bootstrap_servers}
    parent = f"wf-lend-{uuid.uuid4().hex[:8]}"
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="lend", group="g")
    producer = BranchEventProducer(config, kafka_topics.name("branch-events"),
                                   results_topic=kafka_topics.name("settlement-results"))
    try:
        lines = tmp_path / "opening.jsonl"
        lines.write_text(opening_lines(parent))
        run = settle("produce", str(lines), *common)
        assert run.returncode == 0, run.stdout + run.stderr
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, 3, 120, [proc])

        # 30 available, 30 lent: B (45) is covered only with the loan back.
        waiting = producer.publish_and_wait(sibling_b(parent), timeout_s=60)
        assert waiting.result == "awaiting_revocation", waiting.detail
        assert not waiting.applied and "L1" in waiting.detail

        # The processor asked the borrower: the consumer API hands over a typed revocation.
        seen: list = []
        consumer = SettlementConsumer(config, group_id=f"borrower-{uuid.uuid4()}",
                                      topics=[kafka_topics.name("capacity-releases")])
        try:
            deadline = time.monotonic() + 60
            while not any(isinstance(r, LoanRevocationRequested) for r in seen):
                assert time.monotonic() < deadline, f"no revocation; saw {seen}"
                consumer.poll(seen.append, 0.5)
        finally:
            consumer.close()
        [revocation] = [r for r in seen if isinstance(r, LoanRevocationRequested)]
        assert (revocation.parent_id, revocation.loan_id, revocation.borrower, revocation.quantities,
                revocation.reason, revocation.child_id, revocation.triggering_event_type) == (
            parent, "L1", "batch-7", {"tokens": 30}, "sibling_needs_capacity", "B", "ChildReserved")
        assert revocation.triggering_event_id == waiting.event_id
        assert revocation.dedupe_key == f"{parent}/loan/L1/revocation"
        assert revocation.source.partition == waiting.input_partition  # keyed by the parent id, like releases

        # The borrower used 10 of its 30: 20 come back to the parent; then B's retry fits (50 available).
        returned = producer.loan_returned(parent, loan_id="L1", usage={"tokens": 10}, occurred_at_ms=now_ms())
        assert returned["idempotency_key"] == f"{parent}/loan/L1/return"
        producer.flush()
        retry = producer.publish_and_wait(sibling_b(parent), timeout_s=60)
        assert retry.result == "ok", retry.detail
        again = producer.publish_and_wait(dict(returned, event_id=str(uuid.uuid4())), timeout_s=60)
        assert again.result == "duplicate"  # a loan is never returned twice

        released: list = []
        consumer = SettlementConsumer(config, group_id=f"quota-{uuid.uuid4()}",
                                      topics=[kafka_topics.name("capacity-releases")])
        try:
            deadline = time.monotonic() + 60
            while not any(isinstance(r, CapacityReleased) for r in released):
                assert time.monotonic() < deadline, f"no release; saw {released}"
                consumer.poll(released.append, 0.5)
        finally:
            consumer.close()
        assert [(r.parent_id, r.child_id, r.quantity, r.destination, r.reason) for r in released
                if isinstance(r, CapacityReleased)] == [(parent, "", 20, "parent", "loan_returned")]
        assert [r.loan_id for r in released if isinstance(r, LoanRevocationRequested)] == ["L1"]  # once
        [release] = [r for r in released if isinstance(r, CapacityReleased)]
        assert (release.balance.available, release.balance.lent, release.balance.committed) == (50, 0, 10)
    finally:
        producer.close()
        assert proc.stop() == 0, proc.output()[-3000:]

    replayed = settle("replay", "--topic", "branch-events", *common, "--state-dir", str(tmp_path / "state"),
                      "--group-id", "g")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "AGREES" in replayed.stdout
    as_json = settle("replay", "--topic", "branch-events", "--json", *common)
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    ledger = json.loads(as_json.stdout)
    tokens = ledger["parents"][parent]["dimensions"]["tokens"]
    assert (tokens["available"], tokens["outstanding"], tokens["lent"], tokens["committed"]) == (5, 85, 0, 10)
    assert ledger["parents"][parent]["loans"] == {
        "L1": {"borrower": "batch-7", "quantities": {"tokens": 30}, "state": "returned",
               "revocation_requested": True, "usage": {"tokens": 10}}}


# -- the consumer API and the processor's bytes (no broker) ---------------------------------------------------


def revocation_of_a_fold() -> dict:
    L = Ledger()
    L.tick(T0)
    assert L.open_parent(lending_limit={"tokens": 50}) == "ok"
    assert L.reserve("A", tokens=40) == "ok"
    assert L.lend("L1", 30, borrower="batch-7") == "ok"
    assert L.reserve("B", tokens=45) == "awaiting_revocation"
    [record] = L.out.revocations
    return record


@pytest.mark.unit
def test_the_consumer_api_reads_the_processors_revocation() -> None:
    codec = default_codec()
    record = revocation_of_a_fold()
    data = codec.encode("LoanRevocationRequested", record)
    typed = decode_output(data)
    assert isinstance(typed, LoanRevocationRequested) and typed.kind == "LoanRevocationRequested"
    assert typed.to_record() == record
    assert encode_output(typed) == data
    assert typed == from_record("LoanRevocationRequested", record)
    assert len({typed, decode_output(data)}) == 1
    assert typed.dedupe_key == "P/loan/L1/revocation" and typed.child_id == "B"


@pytest.mark.unit
def test_revocations_go_to_capacity_releases_keyed_by_the_parent() -> None:
    from branch_settlement.processors.ledger.outputs import OUTPUT_ROUTES
    assert ("revocations", "capacity-releases", "LoanRevocationRequested") in OUTPUT_ROUTES
    out = Outputs(revocations=[revocation_of_a_fold()])
    assert out.count() == 1 and out.revocations[0]["parent_id"] == "P"


# -- the loan metrics against a recount (no broker) -----------------------------------------------------------


def loan_recount(store) -> tuple[dict, int, int]:
    """From every parent of the projection: lent per (parent, dimension) of the open loans of parents not closed,
    loans open, revocations outstanding."""
    from branch_settlement.projections import keys
    codec = default_codec()
    lent: dict = {}
    open_loans = outstanding = 0
    for _, raw in store.scan(keys.prefix(keys.PARENT)):
        parent = codec.decode(raw)[1]
        if parent["status"] == "closed":
            continue
        for loan in parent["loans"]:
            if loan["state"] == "open":
                open_loans += 1
                outstanding += loan["revocation_requested"]
                for dim, quantity in loan["quantities"].items():
                    lent[(parent["parent_id"], dim)] = lent.get((parent["parent_id"], dim), 0) + quantity
    return lent, open_loans, outstanding


@pytest.mark.unit
@pytest.mark.parametrize("seed", (0, 1, 4, 5, 6, 7))  # seeds whose checkpoints find loans open
def test_loan_metrics_agree_with_a_recount_after_every_checkpoint(tmp_path: Path, seed: int) -> None:
    import random

    from branch_settlement.processors.kafka import reporting
    from branch_settlement.processors.kafka.metrics import Metrics
    from branch_settlement.processors.kafka.partition import PartitionTask
    from branch_settlement.projections.store import RocksStore
    from tests.kafka.test_metrics_unit import NoConsumer, checkpoint
    from tests.ledger.test_reference_model import Stream

    codec = default_codec()
    rng = random.Random(seed)
    store = RocksStore(tmp_path / "p0")
    task = PartitionTask(0, store, codec, 0, 1)
    metrics = Metrics()
    reporting.track_partitions(metrics, [task])
    asked = 0
    reached = {"lent": False, "outstanding": False}
    for offset, event in enumerate(Stream(seed, 400).build()):
        task.apply(event, offset, ledger_tick=event["type"] == "Tick")
        if rng.random() >= 0.2:
            continue
        if rng.random() < 0.15:  # aborted: nothing of it may count
            task.discard()
            continue
        asked += sum(1 for topic, _, value in task.records
                     if topic == "capacity-releases" and codec.decode(value)[0] == "LoanRevocationRequested")
        checkpoint(task, offset)
        reporting.update_gauges(metrics, [task], NoConsumer(), "branch-events")
        lent, open_loans, outstanding = loan_recount(store)
        got = {(s.labels["parent_id"], s.labels["dimension"]): int(s.value)
               for family in metrics.registry.collect() for s in family.samples if s.name == "settle_lent_capacity"}
        assert got == lent, f"seed {seed}, offset {offset}"
        sample = metrics.registry.get_sample_value
        assert sample("settle_loans_open") == open_loans
        assert sample("settle_loan_revocations_outstanding") == outstanding
        assert sample("settle_loan_revocations_total") == asked
        reached["lent"] |= bool(lent)
        reached["outstanding"] |= outstanding > 0
    again = Metrics()  # a processor taking the partition over: the gauges from the projection alone
    reporting.update_gauges(again, [PartitionTask(0, store, codec, 0, 1)], NoConsumer(), "branch-events")
    assert again.registry.get_sample_value("settle_loans_open") == metrics.registry.get_sample_value("settle_loans_open")
    store.close()
    assert reached["lent"]


@pytest.mark.unit
def test_the_faust_example_takes_a_revocation_once_and_credits_nothing(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import faust_releases
    finally:
        sys.path.pop(0)
    revocation = decode_output(default_codec().encode("LoanRevocationRequested", revocation_of_a_fold()))
    codec = faust_releases.SettlementAvroCodec()
    assert codec.loads(encode_output(revocation)) == revocation
    store = faust_releases.open_store(str(tmp_path / "quota.db"))
    assert faust_releases.apply_record(store, revocation) is True
    assert faust_releases.apply_record(store, revocation) is False  # deduplicated by its revocation key
    assert store.connection.execute("SELECT COUNT(*) FROM credited").fetchone() == (0,)
