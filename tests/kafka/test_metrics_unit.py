"""The processor's metrics without a broker: the ledger gauges kept from each checkpoint's changes agree with
a recount of the whole projection after every checkpoint of adversarial event streams (aborts included), the
lease expiries counted from the committed audit records agree with a decoding of every one of them, a
failure in the statistics never reaches the commit, librdkafka's statistics are read as they come. And the
operations files: every expression of the alert rules and of the Grafana dashboard names metrics (and labels)
the processor registers, every registered metric is documented, and `promtool` checks and unit-tests the
rules (Debian's prometheus package, installed with apt-get when missing, as tests/audit does for chromium)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import yaml
from confluent_kafka import KafkaException

from branch_settlement.processors.kafka import reporting
from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.processors.kafka.processor import Processor
from branch_settlement.projections import keys, model
from branch_settlement.projections.store import RocksStore
from branch_settlement.schemas import native
from branch_settlement.schemas.codec import SCHEMA_DIR, default_codec
from branch_settlement.schemas.partitioning import partition_of
from tests.ledger.test_reference_model import Stream
from tests.schemas.test_codec import single_object
from tests.debian import debian_binary, run

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = REPO / "deploy" / "prometheus" / "alerts.test.yml"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "branch-settlement.json"
OPERATIONS = REPO / "docs" / "operations.md"
PROMTOOL = Path("/usr/bin/promtool")
CODEC = default_codec()


# -- the ledger gauges against a recount -------------------------------------------------------------------


def recount(store) -> dict:
    """Everything the ledger gauges show, from every record of the projection, fully decoded."""
    children = dict.fromkeys(reporting.CHILD_STATES, 0)
    parents = dict.fromkeys(reporting.PARENT_STATUSES, 0)
    stranded: dict[str, int] = {}
    every: dict[tuple[str, str], int] = {}
    open_only: dict[tuple[str, str], int] = {}
    for _, raw in store.scan(keys.prefix(keys.CHILD)):
        child = CODEC.decode(raw)[1]
        children[child["state"]] += 1
        if child["state"] == model.STRANDED:
            for dim in child["reserved"]:
                stranded[dim] = stranded.get(dim, 0) + model.remainder(child, dim)
    for _, raw in store.scan(keys.prefix(keys.PARENT)):
        parent = CODEC.decode(raw)[1]
        parents[parent["status"]] += 1
        for dim, balance in parent["dimensions"].items():
            for term, value in balance.items():
                if term != "kind":
                    every[(term, dim)] = every.get((term, dim), 0) + value
                    if parent["status"] == model.PARENT_OPEN:
                        open_only[(term, dim)] = open_only.get((term, dim), 0) + value
                    else:
                        open_only.setdefault((term, dim), 0)
    return {"children": children, "parents": parents, "stranded": stranded, "every": every, "open": open_only}


def nonzero(values: dict) -> dict:
    return {key: value for key, value in values.items() if value}


class NoConsumer:
    """update_gauges asks the consumer for cached watermarks only; without a broker there are none."""

    def get_watermark_offsets(self, tp, cached):
        raise KafkaException("no broker in a unit test")


def sample(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def exported(metrics: Metrics) -> dict:
    """What update_gauges exported, in the shape of recount()."""
    values = {"children": {}, "parents": {}, "stranded": {}, "every": {}, "open": {}}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "settle_children":
                values["children"][s.labels["state"]] = int(s.value)
            elif s.name == "settle_parents":
                values["parents"][s.labels["status"]] = int(s.value)
            elif s.name == "settle_stranded_capacity":
                values["stranded"][s.labels["dimension"]] = int(s.value)
            elif s.name == "settle_capacity_all_parents":
                values["every"][(s.labels["term"], s.labels["dimension"])] = int(s.value)
            elif s.name == "settle_capacity":
                values["open"][(s.labels["term"], s.labels["dimension"])] = int(s.value)
    return values


def committed_expiries(task: PartitionTask) -> dict[str, int]:
    """The lease expiries among the task's buffered audit records, every one decoded."""
    found = {"child": 0, "parent": 0}
    for topic, _, value in task.records:
        if topic == reporting.AUDIT_TOPIC:
            audit = CODEC.decode(value)[1]
            if audit["new_state"] == model.EXPIRED and audit["prior_state"] != model.EXPIRED:
                found["child" if audit["child_id"] else "parent"] += 1
    return found


def checkpoint(task: PartitionTask, offset: int) -> None:
    """What commit_checkpoint does to a task once its transaction committed (processors/kafka/checkpoint.py)."""
    changes = task.view.changes()
    task.forget_committed()
    task.write_committed(changes, offset)


SEEDS = range(12)


def fold_and_compare(tmp_path: Path, seed: int, hooked: bool) -> dict[str, bool]:
    """Fold a seeded stream, checkpointing at random (some checkpoints aborted), and compare what the gauges
    export with a recount after every commit. What the stream reached, for the test that they reach it."""
    rng = random.Random(seed)
    store = RocksStore(tmp_path / "p0")
    task = PartitionTask(0, store, CODEC, 0, 1)
    metrics = Metrics()
    if hooked:
        reporting.track_partitions(metrics, [task])
    expected = {"child": 0, "parent": 0}
    commits = 0
    seen = {"stranded": False, "expiries": False, "closed": False}
    for offset, event in enumerate(Stream(seed, 400).build()):
        task.apply(event, offset, ledger_tick=event["type"] == "Tick")
        if rng.random() >= 0.2:
            continue
        if rng.random() < 0.15:  # an aborted checkpoint: nothing of it may count
            task.discard()
            continue
        if hooked or commits:
            for kind, n in committed_expiries(task).items():
                expected[kind] += n
        checkpoint(task, offset)
        commits += 1
        reporting.update_gauges(metrics, [task], NoConsumer(), "branch-events")
        truth = recount(store)
        got = exported(metrics)
        assert got["children"] == truth["children"], f"seed {seed}, offset {offset}"
        assert got["parents"] == truth["parents"], f"seed {seed}, offset {offset}"
        assert nonzero(got["stranded"]) == nonzero(truth["stranded"]), f"seed {seed}, offset {offset}"
        assert got["every"] == truth["every"], f"seed {seed}, offset {offset}"
        assert got["open"] == truth["open"], f"seed {seed}, offset {offset}"
        assert {kind: sample(metrics, "settle_lease_expiries_total", kind=kind) or 0 for kind in expected} == expected
        assert sample(metrics, "settle_ledger_time_seconds", partition="0") == task.view.meta["ledger_time_ms"] / 1000
        seen["stranded"] |= truth["children"]["stranded"] > 0
        seen["expiries"] |= sum(expected.values()) > 0
        seen["closed"] |= truth["parents"]["closed"] > 0
        # Nothing is kept per child but the remainders of a stranded one; per parent, the open ones' keys and
        # the terms of closing and expired ones.
        stats = metrics.partition_stats[0][1]
        assert len(stats._stranded) == truth["children"]["stranded"]
        assert len(stats._open) == truth["parents"]["open"]
        assert len(stats._fenced) == truth["parents"]["closing"] + truth["parents"]["expired"]
    assert commits and sample(metrics, "settle_owned_partitions") == 1
    # A processor taking the partition over counts the same from the projection alone.
    again = Metrics()
    reporting.update_gauges(again, [PartitionTask(0, store, CODEC, 0, 1)], NoConsumer(), "branch-events")
    assert exported(again)["children"] == exported(metrics)["children"]
    assert exported(again)["open"] == exported(metrics)["open"]
    assert not metrics.partition_stats[0][1].failed
    store.close()
    return seen


@pytest.mark.parametrize("implementation", [native.COMPILED, native.PYTHON])
@pytest.mark.parametrize("hooked", [True, False], ids=["tracked-at-load", "tracked-at-first-commit"])
@pytest.mark.parametrize("seed", SEEDS)
def test_ledger_gauges_agree_with_a_recount_after_every_checkpoint(tmp_path: Path, seed: int, hooked: bool,
                                                                   implementation: str, monkeypatch) -> None:
    """Both implementations of LedgerStats.apply and count_audits (native/src/stats.rs and the Python loops they
    fall back to)."""
    if implementation == native.COMPILED and native.module() is None:
        pytest.skip("needs the compiled module")  # CI builds it: never skipped there
    monkeypatch.setenv(native.ENV, implementation)
    for name in ("apply_ledger_changes", "count_audits"):
        assert (native.compiled_function(name) is not None) == (implementation == native.COMPILED)
    fold_and_compare(tmp_path, seed, hooked)


def test_the_streams_reach_what_the_gauges_are_for(tmp_path: Path) -> None:
    """The seeds above are not vacuous: together they strand children, expire leases and close parents."""
    seen = {"stranded": False, "expiries": False, "closed": False}
    for seed in SEEDS:
        found = fold_and_compare(tmp_path / str(seed), seed, True)
        seen = {key: seen[key] or found[key] for key in seen}
    assert seen == {"stranded": True, "expiries": True, "closed": True}


def test_a_dimension_whose_last_open_parent_closed_goes_to_zero_and_partitions_given_away_are_removed(
        tmp_path: Path) -> None:
    metrics = Metrics()
    tasks = [PartitionTask(p, RocksStore(tmp_path / f"p{p}"), CODEC, 0, 2) for p in (0, 1)]
    reporting.track_partitions(metrics, tasks)
    parent = {"type": "ParentReserved", "event_id": "e1", "idempotency_key": "k1", "parent_id": "wf-1",
              "occurred_at_ms": 1, "capacity": {"gpu_s": {"quantity": 5, "kind": "logical"}},
              "lease_ttl_ms": 60_000, "policy": {"max_live_children": 2, "reconciliation_timeout_ms": 1000,
                                                 "lending_limit": {}}}
    owner = tasks[partition_of("wf-1", 2)]
    assert owner.apply(CODEC.event_from_json(parent), 0)["result"] == "ok"
    checkpoint(owner, 0)
    reporting.update_gauges(metrics, tasks, NoConsumer(), "branch-events")
    assert sample(metrics, "settle_capacity", term="available", dimension="gpu_s") == 5
    assert sample(metrics, "settle_parents", status="open") == 1
    close = {"type": "ParentClosed", "event_id": "e2", "idempotency_key": "k2", "parent_id": "wf-1",
             "occurred_at_ms": 2, "outcome": "succeeded"}
    assert owner.apply(CODEC.event_from_json(close), 1)["result"] == "ok"
    checkpoint(owner, 1)
    reporting.update_gauges(metrics, tasks, NoConsumer(), "branch-events")
    assert sample(metrics, "settle_capacity", term="available", dimension="gpu_s") == 0
    assert sample(metrics, "settle_capacity_all_parents", term="returned_to_pool", dimension="gpu_s") == 5
    assert sample(metrics, "settle_parents", status="closed") == 1
    # The owner is given away: its series go, the sums lose it.
    reporting.update_gauges(metrics, [t for t in tasks if t is not owner], NoConsumer(), "branch-events")
    assert sample(metrics, "settle_ledger_time_seconds", partition=str(owner.partition)) is None
    assert sample(metrics, "settle_capacity_all_parents", term="returned_to_pool", dimension="gpu_s") == 0
    assert sample(metrics, "settle_parents", status="closed") == 0
    assert sample(metrics, "settle_owned_partitions") == 1
    for task in tasks:
        task.close()


def test_a_failure_in_the_statistics_never_reaches_the_commit(tmp_path: Path, caplog) -> None:
    store = RocksStore(tmp_path / "p0")
    task = PartitionTask(0, store, CODEC, 0, 1)
    metrics = Metrics()
    reporting.track_partitions(metrics, [task])
    stats = metrics.partition_stats[0][1]
    stats._fields = None  # any bug in reading the changes
    parent = {"type": "ParentReserved", "event_id": "e1", "idempotency_key": "k1", "parent_id": "wf-1",
              "occurred_at_ms": 1, "capacity": {"gpu_s": {"quantity": 5, "kind": "logical"}},
              "lease_ttl_ms": 60_000, "policy": {"max_live_children": 2, "reconciliation_timeout_ms": 1000,
                                                 "lending_limit": {}}}
    task.apply(CODEC.event_from_json(parent), 0)
    checkpoint(task, 0)
    assert store.get(keys.parent_key("wf-1")) is not None  # written all the same
    assert stats.failed and "ledger gauges given up" in caplog.text
    reporting.update_gauges(metrics, [task], NoConsumer(), "branch-events")
    assert sample(metrics, "settle_capacity_all_parents", term="available", dimension="gpu_s") == 5
    task.close()


def test_records_of_an_older_writer_schema_are_read_through_the_codec() -> None:
    old = {"parent_id": "P", "child_id": "A", "branch_id": "A", "attempt_id": "A1", "state": "stranded",
           "activated": True, "lease_generation": 1, "lease_expires_at_ms": None, "reconcile_deadline_ms": 5,
           "reserved": {"tokens": 20}, "consumed": {"tokens": 3}, "awaiting": {}, "awaiting_destination": {},
           "escalated": {}, "usage_report_ids": []}
    data = single_object(SCHEMA_DIR / "history" / "LedgerChild.v1.avsc", old)
    fields = reporting._Fields(CODEC)
    assert fields.child_state(data) == "stranded"
    current = CODEC.encode("LedgerChild", {**CODEC.decode(data)[1], "child_id": "x" * 300})  # a long id too
    assert fields.child_state(current) == "stranded"


def audit(child_id: str, prior: str, new: str, dimension: str | None = None, quantity: int | None = None) -> bytes:
    return CODEC.encode("AuditRecord", {
        "parent_id": "wf-" + "p" * 70, "child_id": child_id, "attempt_id": "a1", "dimension": dimension,
        "quantity": quantity, "prior_state": prior, "new_state": new, "idempotency_key": "k", "lease_generation": 0,
        "triggering_event_id": "e", "event_type": "Tick", "input_partition": 0, "input_offset": 1,
        "ledger_time_ms": 5, "note": ""})


@pytest.mark.parametrize("implementation", [native.COMPILED, native.PYTHON])
def test_audit_records_move_children_between_states_and_count_expiries(tmp_path: Path, implementation: str,
                                                                       monkeypatch) -> None:
    """Each change of a child's state is one audit record: a new child comes from nowhere (prior ''), `expired`
    is passed through and never counted as a state, a note (prior == new) moves nothing, a parent's audit record
    counts only as a parent's lease expiry, and a record of another topic is not read."""
    if implementation == native.COMPILED and native.module() is None:
        pytest.skip("needs the compiled module")  # CI builds it: never skipped there
    monkeypatch.setenv(native.ENV, implementation)
    metrics = Metrics()
    stats = reporting.LedgerStats(RocksStore(tmp_path / "p0"), CODEC, metrics)
    long_id = "c" * 200  # a length of more than one varint byte
    records = [(reporting.AUDIT_TOPIC, b"k", audit("c1", "", model.RESERVED)),
               (reporting.AUDIT_TOPIC, b"k", audit(long_id, "", model.RESERVED)),
               (reporting.AUDIT_TOPIC, b"k", audit("c1", model.RESERVED, model.ACTIVATED)),
               (reporting.AUDIT_TOPIC, b"k", audit("c1", model.ACTIVATED, model.ACTIVATED, "tokens", 3)),
               (reporting.AUDIT_TOPIC, b"k", audit(long_id, model.RESERVED, model.EXPIRED)),
               (reporting.AUDIT_TOPIC, b"k", audit(long_id, model.EXPIRED, model.RELEASED, "tokens", 7)),
               (reporting.AUDIT_TOPIC, b"k", audit("", model.PARENT_OPEN, model.PARENT_EXPIRED)),
               (reporting.AUDIT_TOPIC, b"k", audit("", model.PARENT_EXPIRED, model.PARENT_EXPIRED)),
               ("settlement-results", b"k", audit("c9", "", model.RESERVED))]
    stats.count_audits(records)
    assert nonzero(stats.children) == {model.ACTIVATED: 1, model.RELEASED: 1}
    assert model.EXPIRED not in stats.children
    assert sample(metrics, "settle_lease_expiries_total", kind="child") == 1
    assert sample(metrics, "settle_lease_expiries_total", kind="parent") == 1
    assert stats._fields.transition(records[3][2]) == (True, model.ACTIVATED, model.ACTIVATED)
    assert stats._fields.transition(records[6][2]) == (False, model.PARENT_OPEN, model.PARENT_EXPIRED)


# -- librdkafka statistics ------------------------------------------------------------------------------------

# Shaped as librdkafka 2.x sends them (trimmed): the group consumer, the restore's consumer, the producer.
CONSUMER_STATS = {
    "name": "rdkafka#consumer-1", "type": "consumer", "ts": 1, "msg_cnt": 0,
    "cgrp": {"state": "up", "join_state": "steady", "assignment_size": 2, "rebalance_cnt": 1},
    "brokers": {"127.0.0.1:9092/1": {"nodeid": 1, "rtt": {"cnt": 3, "p50": 500000, "p99": 501000}}},
    "topics": {"branch-events": {"partitions": {
        "0": {"fetch_state": "active", "ls_offset": 120, "hi_offset": 121, "app_offset": 100, "consumer_lag": -1},
        "1": {"fetch_state": "active", "ls_offset": 40, "hi_offset": 40, "app_offset": 40, "consumer_lag": -1},
        "2": {"fetch_state": "none", "ls_offset": -1001, "app_offset": -1001, "consumer_lag": -1},
        "-1": {"fetch_state": "none", "ls_offset": -1001, "app_offset": -1001, "consumer_lag": -1}}}},
}
RESTORE_STATS = {"name": "rdkafka#consumer-2", "type": "consumer",
                 "cgrp": {"assignment_size": 0},
                 "topics": {"ledger-changelog": {"partitions": {
                     "0": {"fetch_state": "active", "ls_offset": 900, "app_offset": 10}}}}}
PRODUCER_STATS = {
    "name": "rdkafka#producer-3", "type": "producer", "msg_cnt": 7, "msg_size": 2048,
    "eos": {"idemp_state": "Assigned", "txn_state": "Ready", "producer_id": 4, "producer_epoch": 0},
    "brokers": {"127.0.0.1:9092/bootstrap": {"nodeid": -1, "rtt": {"cnt": 0}},
                "TxnCoordinator": {"nodeid": -1, "rtt": {"cnt": 0}},
                "127.0.0.1:9092/1": {"nodeid": 1, "rtt": {"cnt": 12, "p50": 1500, "p99": 8000}},
                "127.0.0.1:9094/2": {"nodeid": 2, "rtt": {"cnt": 0, "p50": 0, "p99": 0}}},
}


def test_client_statistics_export_the_group_consumer_and_the_transactional_producer() -> None:
    metrics = Metrics()
    stats = reporting.ClientStatistics(metrics, "branch-events")
    stats(json.dumps(CONSUMER_STATS))
    stats(json.dumps(RESTORE_STATS))  # another consumer: no series of its own, nothing overwritten
    stats(json.dumps(PRODUCER_STATS))
    stats(json.dumps({**PRODUCER_STATS, "msg_cnt": 99, "eos": {"idemp_state": "Init"}}))  # not transactional
    stats("not json")  # never raises into librdkafka's call
    stats(json.dumps({"type": "consumer", "topics": {"branch-events": {"partitions": {"0": "junk"}}}}))
    assert sample(metrics, "settle_kafka_consumer_lag", partition="0") == 20
    assert sample(metrics, "settle_kafka_consumer_lag", partition="1") == 0
    assert sample(metrics, "settle_kafka_consumer_lag", partition="2") is None
    assert sample(metrics, "settle_kafka_consumer_lag", partition="-1") is None
    assert sample(metrics, "settle_kafka_assigned_partitions") == 2
    assert sample(metrics, "settle_kafka_producer_queue_messages") == 7
    assert sample(metrics, "settle_kafka_producer_queue_bytes") == 2048
    assert sample(metrics, "settle_kafka_broker_rtt_seconds", broker="1", quantile="0.99") == 0.008
    assert sample(metrics, "settle_kafka_broker_rtt_seconds", broker="1", quantile="0.5") == 0.0015
    assert sample(metrics, "settle_kafka_broker_rtt_seconds", broker="2", quantile="0.99") is None
    assert sample(metrics, "settle_kafka_statistics_timestamp_seconds", client="producer") > 0
    # A partition given away leaves the next statistics: its series goes.
    partitions = CONSUMER_STATS["topics"]["branch-events"]["partitions"]
    stats(json.dumps({**CONSUMER_STATS, "topics": {"branch-events": {"partitions": {"1": partitions["1"]}}}}))
    assert sample(metrics, "settle_kafka_consumer_lag", partition="0") is None


def test_client_statistics_are_on_for_the_group_consumer_and_the_producer_alone() -> None:
    """Never in the shared settings (the restore consumer's, the AdminClients'): an AdminClient's callbacks run
    on librdkafka's background thread, where a stats_cb aborts the process."""
    metrics = Metrics()
    config = ProcessorConfig(kafka={"security.protocol": "PLAINTEXT"})
    on = reporting.client_statistics(config, metrics, "branch-events")
    assert on["statistics.interval.ms"] == str(reporting.STATISTICS_INTERVAL_MS)
    assert isinstance(on["stats_cb"], reporting.ClientStatistics)
    processor = Processor(config, {"branch-events": "branch-events"}, metrics=metrics)
    assert set(processor.statistics) == {"statistics.interval.ms", "stats_cb"}
    assert "stats_cb" not in processor.config.client_config() and "stats_cb" not in processor.config.kafka
    chosen = ProcessorConfig(kafka={"statistics.interval.ms": "2500"})
    assert reporting.client_statistics(chosen, metrics, "x")["statistics.interval.ms"] == "2500"
    assert reporting.client_statistics(ProcessorConfig(kafka={"statistics.interval.ms": "0"}), metrics, "x") == {}
    own = ProcessorConfig(kafka={"stats_cb": print})
    assert reporting.client_statistics(own, metrics, "x") == {}  # a stats_cb of the user's own is kept as set


# -- the operations files against the registered metrics ------------------------------------------------------

# PromQL words that are not metric names (functions, aggregations, keywords) and the labels Prometheus adds.
TARGET_LABELS = {"job", "instance"}
OTHER_METRICS = {"up"}  # Prometheus' own, per scrape target
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created"), "info": ("_info",), "unknown": ("",)}


def registered() -> dict[str, set[str]]:
    """Every sample name the processor's registry exposes, with its label names."""
    metrics = Metrics()
    labels_of = {collector._name: set(collector._labelnames) for collector in vars(metrics).values()
                 if hasattr(collector, "_labelnames")}
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        if family.name in labels_of:  # ours: every sample its type gives, whether it has children yet or not
            for suffix in _SUFFIXES[family.type]:
                names[family.name + suffix] = labels_of[family.name] | ({"le"} if suffix == "_bucket" else set())
        else:  # process_* and python_info: their samples as collected
            for s in family.samples:
                names.setdefault(s.name, set()).update(s.labels)
    return names


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) of every selector of an expression that names a metric; label names
    of `by (...)`, `without (...)` clauses are checked against the metrics of the expression."""
    found = []
    for match in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, braces = match.group(1), match.group(2) or ""
        if not (name.startswith(("settle_", "process_", "python_")) or name in OTHER_METRICS):
            continue
        found.append((name, set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", braces))))
    return found


def grouping_labels(expr: str) -> set[str]:
    labels = set()
    for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in clause.split(",") if label.strip()}
    return labels


def check_expression(expr: str, names: dict[str, set[str]], where: str) -> set[str]:
    used = selectors(expr)
    assert used, f"{where}: {expr!r} names no metric of the processor"
    labels: set[str] = set()
    for name, matched in used:
        if name in OTHER_METRICS:
            continue
        assert name in names, f"{where}: {name} is not a metric of processors/kafka/metrics.py"
        unknown = matched - names[name] - TARGET_LABELS
        assert not unknown, f"{where}: {name} has no label {sorted(unknown)}"
        labels |= names[name]
    unknown = grouping_labels(expr) - labels - TARGET_LABELS
    assert not unknown, f"{where}: grouped by {sorted(unknown)}, which none of its metrics has"
    return {name for name, _ in used}


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def dashboard_targets() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    targets = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            targets.append((panel["title"], target["expr"]))
        assert panel["type"] == "row" or panel.get("targets"), f"panel {panel['title']!r} shows nothing"
    return targets


def test_every_alert_names_metrics_the_processor_exports() -> None:
    names = registered()
    rules = alert_rules()
    assert {rule["alert"] for rule in rules} >= {"SettlePartitionStopped", "SettleUnreadablePartition",
                                                 "SettleCommitsStalled", "SettleConsumerLagHigh",
                                                 "SettleStrandedCapacity"}
    for rule in rules:
        check_expression(rule["expr"], names, rule["alert"])
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        anchor = rule["annotations"]["runbook"].split("#")[1]
        assert anchor == rule["alert"].lower(), rule["alert"]
        assert f"### {rule['alert']}" in OPERATIONS.read_text(), f"docs/operations.md does not explain {rule['alert']}"


def test_the_dashboard_is_valid_json_and_every_panel_queries_exported_metrics() -> None:
    names = registered()
    targets = dashboard_targets()
    assert len(targets) >= 20
    shown = set()
    for title, expr in targets:
        shown |= check_expression(expr, names, f"panel {title!r}")
    # The new ledger and client metrics are all on it.
    for name in ("settle_children", "settle_parents", "settle_stranded_capacity", "settle_lease_expiries_total",
                 "settle_capacity", "settle_ledger_time_seconds", "settle_kafka_consumer_lag",
                 "settle_kafka_producer_queue_messages", "settle_kafka_broker_rtt_seconds",
                 "process_resident_memory_bytes"):
        assert name in shown, name
    dashboard = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "instance"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all('instance=~"$instance"' in t["expr"] for t in panel["targets"]), panel["title"]


def test_every_metric_is_documented() -> None:
    text = OPERATIONS.read_text()
    for collector in vars(Metrics()).values():
        name = getattr(collector, "_name", None)
        if name is not None:
            assert f"`{name}" in text, f"docs/operations.md does not describe {name}"


# -- promtool -------------------------------------------------------------------------------------------------


def debian_prometheus(binary: Path) -> Path:
    """Debian's prometheus package (prometheus, promtool), installed with apt-get when missing."""
    return debian_binary(binary, "prometheus")


@pytest.fixture(scope="session")
def promtool() -> Path:
    return debian_prometheus(PROMTOOL)


def test_promtool_checks_the_rules_and_the_scrape_config(promtool: Path) -> None:
    done = run([str(promtool), "check", "rules", str(ALERTS)], 60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout
    done = run([str(promtool), "check", "config", str(SCRAPE_CONFIG)], 60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_every_alert(promtool: Path) -> None:
    tested = {case["alertname"] for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
              for case in test.get("alert_rule_test", []) if case["exp_alerts"]}
    assert tested == {rule["alert"] for rule in alert_rules()}, "an alert without a test that fires it"
    done = run([str(promtool), "test", "rules", ALERT_TESTS.name], 120, cwd=ALERT_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
