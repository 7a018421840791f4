"""Prometheus metrics of the processor. One registry per processor, so tests can run several.

Every metric is described in docs/operations.md (with the alerts of deploy/prometheus/alerts.yml and the
dashboard of deploy/grafana/); tests/kafka/test_metrics_unit.py checks that every expression of those two
names a metric registered here. The ledger gauges are set at checkpoint time from what was committed
(processors/kafka/reporting.py), never per event.
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
                               start_http_server)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        # process_* (CPU, resident memory, open files, start time) and python_info of this process.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.events = Counter("settle_events", "Input events folded, by result code", ["result"], registry=r)
        self.dead_letters = Counter("settle_dead_letters", "Input records sent to the dead-letter topic", registry=r)
        self.releases = Counter("settle_released_quantity", "Capacity released, by dimension and destination",
                                ["dimension", "destination"], registry=r)
        self.transactions = Counter("settle_transactions", "Transactions, by outcome (committed, aborted)",
                                    ["outcome"], registry=r)
        self.capacity = Gauge("settle_capacity",
                              "Ledger balance terms summed over the owned partitions' open parents (status open)",
                              ["term", "dimension"], registry=r)
        self.capacity_all_parents = Gauge(
            "settle_capacity_all_parents",
            "Ledger balance terms summed over every parent the owned partitions hold, closing, expired and closed "
            "ones included (grows with every closed parent)", ["term", "dimension"], registry=r)
        self.children = Gauge("settle_children", "Children of the owned partitions' parents, by state",
                              ["state"], registry=r)
        self.parents = Gauge("settle_parents", "Parents of the owned partitions, by status (open, closing, "
                             "expired, closed)", ["status"], registry=r)
        self.stranded = Gauge("settle_stranded_capacity",
                              "Capacity held in pending by stranded children (their reconciliation timed out at "
                              "the ledger time; only ReconciliationResolved frees it), by dimension",
                              ["dimension"], registry=r)
        self.lent = Gauge("settle_lent_capacity",
                          "Capacity lent to other workloads by the open loans of each parent that lent and is not "
                          "closed, by parent and dimension (explicit borrowing)", ["parent_id", "dimension"],
                          registry=r)
        self.loans_open = Gauge("settle_loans_open", "Loans of the owned partitions' parents not yet returned",
                                registry=r)
        self.revocations_outstanding = Gauge(
            "settle_loan_revocations_outstanding",
            "Open loans the processor asked back (LoanRevocationRequested) whose borrower has not returned them yet",
            registry=r)
        self.revocations = Counter("settle_loan_revocations",
                                   "Loans asked back (LoanRevocationRequested) in committed checkpoints", registry=r)
        self.lease_expiries = Counter("settle_lease_expiries",
                                      "Leases that expired in committed checkpoints: kind child (a live child "
                                      "went to expired, then reconciling) or parent (an open parent expired)",
                                      ["kind"], registry=r)
        self.ledger_time = Gauge("settle_ledger_time_seconds",
                                 "Ledger time of each owned partition (its last tick), Unix seconds; 0 before "
                                 "its first tick", ["partition"], registry=r)
        self.owned_partitions = Gauge("settle_owned_partitions",
                                      "Input partitions this processor owns (stopped ones included), as of its "
                                      "last commit", registry=r)
        self.lag = Gauge("settle_consumer_lag_records",
                         "Input records not yet committed, per partition (high watermark as the consumer last "
                         "saw it minus the committed offset), as of the last commit", ["partition"], registry=r)
        self.restore_records = Gauge("settle_restore_records", "Changelog records applied by the running restore",
                                     ["partition"], registry=r)
        self.stopped = Gauge("settle_partition_stopped",
                             "1 while a partition is stopped by an invariant violation", ["partition"], registry=r)
        self.checkpoint_seconds = Gauge("settle_last_checkpoint_seconds", "Duration of the last checkpoint",
                                        registry=r)
        self.checkpoint_duration = Histogram(
            "settle_checkpoint_duration_seconds", "Checkpoints (the transaction and the RocksDB write), by duration",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=r)
        self.checkpoint_events = Histogram(
            "settle_checkpoint_events", "Input events per committed checkpoint",
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2000, 5000), registry=r)
        # For a liveness probe: a processor with input to fold whose last commit is old is stuck.
        self.last_commit = Gauge("settle_last_commit_timestamp_seconds",
                                 "Unix time of the last committed transaction", registry=r)
        self.projection_rebuilds = Counter("settle_projection_rebuilds",
                                           "Projections found ahead of the committed offsets and rebuilt",
                                           registry=r)
        self.consumer_replacements = Counter("settle_consumer_replacements",
                                             "Consumers replaced after failing to rejoin the group", registry=r)
        self.stuck_calls = Gauge("settle_transactional_calls_stuck",
                                 "Given-up producers still blocked in a librdkafka transactional call", registry=r)
        # 1 while read_committed consumers cannot read past what this processor committed there (processors/
        # kafka/stability.py): an open transaction of another producer or a hanging one holds the partition.
        self.unreadable = Gauge("settle_unreadable_partition",
                                "Partitions written by this processor that read_committed consumers cannot read "
                                "past", ["topic", "partition"], registry=r)
        # From librdkafka's statistics (statistics.interval.ms, reporting.ClientStatistics): fresh every interval
        # whether or not the processor commits.
        self.kafka_lag = Gauge("settle_kafka_consumer_lag",
                               "Input records the group consumer has not handed to the processor yet, per partition "
                               "(librdkafka: last stable offset minus the application's position)", ["partition"],
                               registry=r)
        self.kafka_assigned = Gauge("settle_kafka_assigned_partitions",
                                    "Partitions assigned to the group consumer (librdkafka cgrp.assignment_size)",
                                    registry=r)
        self.kafka_queue_messages = Gauge("settle_kafka_producer_queue_messages",
                                          "Messages in the transactional producer's queues (librdkafka msg_cnt)",
                                          registry=r)
        self.kafka_queue_bytes = Gauge("settle_kafka_producer_queue_bytes",
                                       "Bytes in the transactional producer's queues (librdkafka msg_size)",
                                       registry=r)
        self.kafka_rtt = Gauge("settle_kafka_broker_rtt_seconds",
                               "Round-trip time of the transactional producer's requests to each broker over the "
                               "last statistics interval (librdkafka rtt p50 and p99)", ["broker", "quantile"],
                               registry=r)
        self.kafka_statistics = Gauge("settle_kafka_statistics_timestamp_seconds",
                                      "Unix time of the last librdkafka statistics received, by client (consumer, "
                                      "producer): served by the processor's loop, so an old one means a stalled loop",
                                      ["client"], registry=r)
        # The ledger statistics of each owned partition (reporting.LedgerStats), by partition; and the label sets
        # last exported by the summed gauges, so a label set that disappears is set to 0 rather than left stale.
        self.partition_stats: dict = {}
        self.exported: dict[str, set] = {}

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
