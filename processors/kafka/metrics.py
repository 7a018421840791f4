"""Prometheus metrics of the processor. One registry per processor, so tests can run several."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.events = Counter("settle_events", "Input events folded, by result code", ["result"], registry=r)
        self.dead_letters = Counter("settle_dead_letters", "Input records sent to the dead-letter topic", registry=r)
        self.releases = Counter("settle_released_quantity", "Capacity released, by dimension and destination",
                                ["dimension", "destination"], registry=r)
        self.transactions = Counter("settle_transactions", "Transactions, by outcome (committed, aborted)",
                                    ["outcome"], registry=r)
        self.capacity = Gauge("settle_capacity", "Ledger balance terms summed over the owned partitions' parents",
                              ["term", "dimension"], registry=r)
        self.lag = Gauge("settle_consumer_lag_records", "Input records not yet folded, per partition",
                         ["partition"], registry=r)
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

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
