"""The processor's metric updates: the count of folded events by result, what each checkpoint did (its
outcome, its duration, what it released), the gauges of the owned partitions (the ledger of their parents
and children, lag, ledger time), and librdkafka's statistics of its clients.

The ledger gauges cost nothing per event. Each owned partition has a `LedgerStats`, built once from its
projection and kept up to date from each committed checkpoint: the audit records it committed (every change of a
child's state is one, and so is every lease expiry) and the ledger changes it writes to RocksDB (the new value of
every parent and child it changed). Only the few fields it needs are read from a record's Avro bytes (`_Fields`),
so a checkpoint costs well under a microsecond per record more; `update_gauges` then sums a few small dicts per
partition.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from typing import Iterable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from branch_settlement.processors.kafka.config import ProcessorConfig
from branch_settlement.processors.kafka.metrics import Metrics
from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.processors.kafka.txn_guard import stuck_calls
from branch_settlement.processors.ledger.outputs import OUTPUT_ROUTES
from branch_settlement.projections import keys, model
from branch_settlement.schemas import native

log = logging.getLogger("settle.metrics")

# The child states a ledger record can hold (`expired` is passed through within one event, never stored), and
# the parent statuses: each is exported, 0 included, so that a dashboard's series never has gaps.
CHILD_STATES = (model.RESERVED, model.ACTIVATED, model.PARTIALLY_CONSUMED, model.CANCEL_REQUESTED,
                model.RECONCILING, model.STRANDED, model.COMMITTED, model.RELEASED)
PARENT_STATUSES = (model.PARENT_OPEN, model.PARENT_CLOSING, model.PARENT_EXPIRED, model.PARENT_CLOSED)
FENCED_STATUSES = frozenset({model.PARENT_CLOSING, model.PARENT_EXPIRED})
AUDIT_TOPIC = next(topic for attr, topic, _ in OUTPUT_ROUTES if attr == "audits")

# librdkafka statistics every this many ms, unless the processor's librdkafka settings say otherwise
# (statistics.interval.ms; 0 turns them off): a JSON document of a few KB per client, parsed on the loop.
STATISTICS_INTERVAL_MS = 10_000


class EventCounters:
    """The events counter per result code. Events are counted in `pending` (a plain dict: result code -> events)
    and added to the counter once per loop step by `flush`: a counter's inc() takes a lock, too much for every
    event. Each counter child is looked up once: labels() costs a lock and a lookup too."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._counters: dict = {}
        self.pending: dict[str, int] = {}

    def count(self, code: str) -> None:
        pending = self.pending
        pending[code] = pending.get(code, 0) + 1

    def flush(self) -> None:
        if not self.pending:
            return
        counters = self._counters
        for code, events in self.pending.items():
            counter = counters.get(code)
            if counter is None:
                counter = counters[code] = self._metrics.events.labels(code)
            counter.inc(events)
        self.pending.clear()


def record_checkpoint(metrics: Metrics, committed: bool, elapsed: float) -> None:
    """Every checkpoint, committed or not."""
    metrics.transactions.labels("committed" if committed else "aborted").inc()
    metrics.checkpoint_seconds.set(elapsed)
    metrics.checkpoint_duration.observe(elapsed)
    metrics.stuck_calls.set(stuck_calls())


def record_commit(metrics: Metrics, result) -> None:
    """A committed checkpoint: when, how many events, what it released."""
    metrics.last_commit.set(time.time())
    metrics.checkpoint_events.observe(result.events)
    for (dimension, destination), quantity in result.released.items():
        metrics.releases.labels(dimension, destination).inc(quantity)


# -- the ledger gauges ------------------------------------------------------------------------------------


def track_partitions(metrics: Metrics, tasks: Iterable[PartitionTask]) -> None:
    """Give every task not tracked yet its LedgerStats. Right after the tasks are built (before they fold),
    every lease expiry they commit is counted; `update_gauges` tracks any task it finds untracked, from its
    first commit on (the expiries of that first checkpoint are then not counted; the gauges are right)."""
    for task in tasks:
        _stats(metrics, task)


def update_gauges(metrics: Metrics, tasks: Iterable[PartitionTask], consumer: Consumer, input_topic: str) -> None:
    """After a commit: the owned partitions' ledger (children by state, parents by status, the balance terms
    of open parents and of all, stranded capacity), each one's ledger time and lag behind the input's high
    watermark (as the consumer last saw it: no request). Series of partitions no longer owned are removed."""
    children = dict.fromkeys(CHILD_STATES, 0)
    parents = dict.fromkeys(PARENT_STATUSES, 0)
    every: dict[tuple[str, str], int] = {}
    open_only: dict[tuple[str, str], int] = {}
    stranded: dict[str, int] = {}
    owned = set()
    for task in tasks:
        owned.add(task.partition)
        label = str(task.partition)
        _add(every, task.capacity)
        stats = _stats(metrics, task)
        if stats is not None and not stats.failed:
            _add(children, stats.children)
            _add(parents, stats.parents)
            _add(stranded, stats.stranded_capacity)
            _add(open_only, task.capacity)
            _subtract(open_only, stats.fenced_totals)
            _subtract(open_only, stats.closed_totals)
        metrics.ledger_time.labels(label).set(task.view.meta.get("ledger_time_ms", 0) / 1000)
        tp = TopicPartition(input_topic, task.partition)
        try:
            _, high = consumer.get_watermark_offsets(tp, cached=True)
        except KafkaException:
            continue
        if high >= 0 and task.committed_position >= 0:
            metrics.lag.labels(label).set(max(high - task.committed_position, 0))
    _export(metrics, "children", metrics.children, {(state,): n for state, n in children.items()})
    _export(metrics, "parents", metrics.parents, {(status,): n for status, n in parents.items()})
    _export(metrics, "capacity", metrics.capacity, open_only)
    _export(metrics, "capacity_all_parents", metrics.capacity_all_parents, every)
    _export(metrics, "stranded", metrics.stranded, {(dim,): n for dim, n in stranded.items()})
    _export_loans(metrics, tasks)
    metrics.owned_partitions.set(len(owned))
    for partition in [p for p in metrics.partition_stats if p not in owned]:
        del metrics.partition_stats[partition]
        for gauge in (metrics.ledger_time, metrics.lag, metrics.stopped, metrics.restore_records):
            _remove(gauge, str(partition))


def _export_loans(metrics: Metrics, tasks: Iterable[PartitionTask]) -> None:
    """Explicit borrowing: lent capacity per parent and dimension (a series per parent with a loan open, removed
    once none is: parents come and go), loans open, revocations outstanding, and the loans asked back since."""
    lent: dict[tuple[str, str], int] = {}
    open_loans = outstanding = asked = 0
    for task in tasks:
        asked += task.take_revocations_asked()
        for parent_id, entry in task.loans.items():
            open_loans += entry["open"]
            outstanding += entry["outstanding"]
            for dim, quantity in entry["lent"].items():
                if entry["open"]:
                    lent[(parent_id, dim)] = quantity
    for labels, value in lent.items():
        metrics.lent.labels(*labels).set(value)
    for labels in metrics.exported.get("lent", set()) - lent.keys():
        _remove(metrics.lent, *labels)
    metrics.exported["lent"] = set(lent)
    metrics.loans_open.set(open_loans)
    metrics.revocations_outstanding.set(outstanding)
    if asked > 0:
        metrics.revocations.inc(asked)


def _add(totals: dict, values: dict) -> None:
    for key, value in values.items():
        totals[key] = totals.get(key, 0) + value


def _export(metrics: Metrics, name: str, gauge, values: dict) -> None:
    """Set each label set of `values`; one exported before and absent now goes to 0 (a dimension whose last
    open parent closed, a partition given away), so no series is left at a stale value."""
    previous = metrics.exported.get(name, set())
    for labels, value in values.items():
        gauge.labels(*labels).set(value)
    for labels in previous - values.keys():
        gauge.labels(*labels).set(0)
    metrics.exported[name] = previous | values.keys()


def _remove(gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass


def _stats(metrics: Metrics, task: PartitionTask) -> LedgerStats | None:
    """The task's LedgerStats, made on first sight. Its hooks follow the commit sequence (checkpoint.py):
    forget_committed (the transaction committed; the task's records are still there) counts the audit records,
    write_committed applies the ledger changes before RocksDB is written (an old value it needs is read from
    there). A failure in the statistics never reaches the commit: they are given up for that task."""
    entry = metrics.partition_stats.get(task.partition)
    if entry is not None and entry[0]() is task:
        return entry[1]
    try:
        stats = LedgerStats(task.store, task.codec, metrics)
        _hook(task, stats)
    except Exception:
        log.exception("partition %d: no ledger gauges (could not read its projection)", task.partition)
        stats = None
    metrics.partition_stats[task.partition] = (weakref.ref(task), stats)
    return stats


def _hook(task: PartitionTask, stats: LedgerStats) -> None:
    """Wrap the task's own (whatever the instance has: a simulation may have replaced them already)."""
    forget, write = task.forget_committed, task.write_committed

    def forget_committed():
        stats.guarded(stats.count_audits, task.records)
        return forget()

    def write_committed(changes, changelog_offset):
        stats.guarded(stats.apply, changes)
        return write(changes, changelog_offset)

    task.forget_committed = forget_committed
    task.write_committed = write_committed


class LedgerStats:
    """One partition's committed ledger as the gauges show it: children by state, parents by status, the
    balance terms of parents that are not open (closing and expired ones each, closed ones summed: a closed
    parent never changes again), what stranded children hold, and the lease expiries it committed.

    The children are counted from the committed audit records, not from the changed records: every change of a
    child's state is an audit record (prior -> new; a new child's prior is empty, and `expired`, which a child
    only passes through within one event, is never stored), so nothing is kept per child but the remainders of
    stranded ones; a child deleted by retention (settled: its state never changes again) is taken off with its
    stored state. Per parent it keeps the keys of open parents and the terms of closing and expired ones. The
    balance terms of open parents are the task's totals (PartitionTask.capacity, every parent) minus those of the
    others."""

    def __init__(self, store, codec, metrics: Metrics) -> None:
        self._store = store
        self._codec = codec
        self._fields = _Fields(codec)
        self._expiries = {kind: metrics.lease_expiries.labels(kind) for kind in ("child", "parent")}
        self.children = dict.fromkeys(CHILD_STATES, 0)
        self.parents = dict.fromkeys(PARENT_STATUSES, 0)
        self.stranded_capacity: dict[str, int] = {}
        self.fenced_totals: dict[tuple[str, str], int] = {}
        self.closed_totals: dict[tuple[str, str], int] = {}
        self._stranded: dict[bytes, dict[str, int]] = {}  # child key -> its remainders, for stranded children
        self._open: set[bytes] = set()  # parent keys
        # closing or expired parent key -> (its status, its terms)
        self._fenced: dict[bytes, tuple[str, dict[tuple[str, str], int]]] = {}
        self.failed = False
        children, state = self.children, self._fields.child_state
        for key, value in store.scan(keys.prefix(keys.CHILD)):
            name = state(value)
            children[name] = children.get(name, 0) + 1
            self._strand(key, name, value)
        for key, value in store.scan(keys.prefix(keys.PARENT)):
            self._parent(key, value)

    def guarded(self, step, arg) -> None:
        if self.failed:
            return
        try:
            step(arg)
        except Exception:
            self.failed = True
            log.exception("ledger gauges given up for a partition: they stay as they were")

    # -- a checkpoint's audit records, once committed ---------------------------------------------------

    def count_audits(self, records: list) -> None:
        """A committed checkpoint's records ((logical topic, key, value), in order): each audit record of a child
        whose state changed moves it from its prior state to its new one, and one whose new state is `expired`
        is a lease expiry (a child's, or an open parent's)."""
        compiled = native.compiled_function("count_audits")  # native/src/stats.rs
        if compiled is not None and type(records) is list:
            child, parent = compiled(records, self._audit_layout())
        else:
            child = parent = 0
            for topic, _, value in records:
                if topic == AUDIT_TOPIC:
                    c, p = self._count_audit(value)
                    child += c
                    parent += p
        if child:
            self._expiries["child"].inc(child)
        if parent:
            self._expiries["parent"].inc(parent)

    def _audit_layout(self) -> tuple:
        """What native/src/stats.rs reads of these gauges and of the audit record's layout, in its order."""
        return AUDIT_TOPIC, self._fields._audit, _STATES, self.children, self._count_audit

    def _count_audit(self, value: bytes) -> tuple[int, int]:
        """One audit record counted: the lease expiries it is, (a child's, a parent's)."""
        is_child, prior, new = self._fields.transition(value)
        if prior == new:
            return 0, 0
        if is_child:
            children = self.children
            if prior and prior != model.EXPIRED:
                children[prior] = children.get(prior, 0) - 1
            if new != model.EXPIRED:
                children[new] = children.get(new, 0) + 1
        if new != model.EXPIRED:
            return 0, 0
        return (1, 0) if is_child else (0, 1)

    # -- a checkpoint's changes, before they are written ------------------------------------------------

    def apply(self, changes: list) -> None:
        compiled = native.compiled_function("apply_ledger_changes")  # native/src/stats.rs
        if compiled is not None and type(changes) is list:
            compiled(changes, self._layout())  # the plain changes compiled, each other one by the methods below
            return
        child, parent = _CHILD, _PARENT
        for key, value in changes:
            kind = key[0]  # one byte names a record's kind (projections/keys.py)
            if kind == child:
                self._change_child(key, value)
            elif kind == parent:
                self._change_parent(key, value)

    def _layout(self) -> tuple:
        """What native/src/stats.rs reads of these gauges and of the record layout, in its order."""
        fields = self._fields
        return (_CHILD, _PARENT, fields._child, fields._parent, model.STRANDED.encode(), model.PARENT_OPEN.encode(),
                self._stranded, self._open, self._change_child, self._change_parent)

    def _change_child(self, key: bytes, value: bytes | None) -> None:
        """Its state was counted from the audit records; what is left: the remainders of a stranded child, and a
        child deleted (by retention: settled, so its stored state is its last)."""
        held = self._stranded.pop(key, None)
        if held is not None:
            _subtract(self.stranded_capacity, held)
        if value is None:
            stored = self._store.get(key)
            if stored is not None:
                state = self._fields.child_state(stored)
                self.children[state] = self.children.get(state, 0) - 1
            return
        self._strand(key, self._fields.child_state(value), value)

    def _strand(self, key: bytes, state: str, value: bytes) -> None:
        if state == model.STRANDED:
            child = self._codec.decode(value)[1]
            held = {dim: model.remainder(child, dim) for dim in child["reserved"]}
            self._stranded[key] = held
            _add(self.stranded_capacity, held)

    def _change_parent(self, key: bytes, value: bytes | None) -> None:
        if key in self._open:
            self._open.discard(key)
            self.parents[model.PARENT_OPEN] -= 1
        elif key in self._fenced:
            status, terms = self._fenced.pop(key)
            self.parents[status] -= 1
            _subtract(self.fenced_totals, terms)
        elif value is None or self._fields.parent_status(value) != model.PARENT_OPEN:
            # A parent is open first, so one that is neither open, closing nor expired here is new, or closed
            # (closed parents never change: read to be sure).
            stored = self._store.get(key)
            if stored is not None:
                status = self._fields.parent_status(stored)
                self.parents[status] -= 1
                if status == model.PARENT_CLOSED:
                    _subtract(self.closed_totals, model.balance_terms(self._codec.decode(stored)[1]))
        if value is not None:
            self._parent(key, value)

    def _parent(self, key: bytes, value: bytes) -> None:
        status = self._fields.parent_status(value)
        self.parents[status] = self.parents.get(status, 0) + 1
        if status == model.PARENT_OPEN:
            self._open.add(key)
            return
        terms = model.balance_terms(self._codec.decode(value)[1])
        if status in FENCED_STATUSES:
            self._fenced[key] = (status, terms)
            _add(self.fenced_totals, terms)
        else:
            _add(self.closed_totals, terms)


def _subtract(totals: dict, values: dict) -> None:
    for key, value in values.items():
        totals[key] = totals.get(key, 0) - value


# -- reading a few fields of a record's Avro bytes ------------------------------------------------------------

_CHILD, _PARENT = keys.CHILD[0], keys.PARENT[0]
_HEADER = 10  # C3 01 and the writer schema's 8-byte fingerprint (schemas/codec.py)
_STATES = {state.encode(): state for state in (*CHILD_STATES, model.EXPIRED, *PARENT_STATUSES)}


class _Fields:
    """The state of a child, the status of a parent, the states of an audit record, from the record's bytes
    when its writer schema is the current one (those fields come first: a few varints to skip), from the
    codec otherwise (a record an older version wrote)."""

    def __init__(self, codec) -> None:
        self._codec = codec
        child = model.new_child("p", "c", "b", "a", {})
        parent = model.new_parent("p", {}, 0, {"max_live_children": 1, "reconciliation_timeout_ms": 0,
                                               "lending_limit": {}})
        audit = {"parent_id": "p", "child_id": "", "attempt_id": "", "dimension": None, "quantity": None,
                 "prior_state": "", "new_state": "", "idempotency_key": "", "lease_generation": 0,
                 "triggering_event_id": "", "event_type": "", "input_partition": 0, "input_offset": 0,
                 "ledger_time_ms": 0, "note": ""}
        self._child = codec.encode("LedgerChild", child)[2:_HEADER]
        self._parent = codec.encode("LedgerParent", parent)[2:_HEADER]
        self._audit = codec.encode("AuditRecord", audit)[2:_HEADER]

    def child_state(self, data: bytes) -> str:
        if data[2:_HEADER] == self._child:
            pos = _skip(data, _HEADER, 4)  # parent_id, child_id, branch_id, attempt_id
            return _state(data, pos)
        return self._codec.decode(data)[1]["state"]

    def parent_status(self, data: bytes) -> str:
        if data[2:_HEADER] == self._parent:
            return _state(data, _skip(data, _HEADER, 1))  # after parent_id
        return self._codec.decode(data)[1]["status"]

    def transition(self, data: bytes) -> tuple[bool, str, str]:
        """An audit record's (whether it is a child's, its prior state, its new state)."""
        if data[2:_HEADER] == self._audit:
            pos = _skip(data, _HEADER, 1)  # parent_id
            child_len, pos = _long(data, pos)
            pos = _skip(data, pos + child_len, 1)  # attempt_id
            branch, pos = _long(data, pos)  # dimension: null or string
            if branch:
                pos = _skip(data, pos, 1)
            branch, pos = _long(data, pos)  # quantity: null or long
            if branch:
                _, pos = _long(data, pos)
            prior_len, pos = _long(data, pos)
            prior = _name(data[pos:pos + prior_len])
            pos += prior_len
            new_len, pos = _long(data, pos)
            return child_len > 0, prior, _name(data[pos:pos + new_len])
        record = self._codec.decode(data)[1]
        return bool(record["child_id"]), record["prior_state"], record["new_state"]


def _long(data: bytes, pos: int) -> tuple[int, int]:
    """An Avro long (zigzag varint) at pos, and the position after it."""
    b = data[pos]
    pos += 1
    n = b & 0x7F
    shift = 7
    while b & 0x80:
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
    return (n >> 1) ^ -(n & 1), pos


def _skip(data: bytes, pos: int, strings: int) -> int:
    for _ in range(strings):
        b = data[pos]
        if b < 0x80:  # a string shorter than 64 bytes: its length is one byte
            pos += 1 + (b >> 1)
        else:
            length, pos = _long(data, pos)
            pos += length
    return pos


def _state(data: bytes, pos: int) -> str:
    b = data[pos]
    if b < 0x80:
        raw = data[pos + 1:pos + 1 + (b >> 1)]
    else:
        length, pos = _long(data, pos)
        raw = data[pos:pos + length]
    return _name(raw)


def _name(raw: bytes) -> str:
    state = _STATES.get(raw)
    return raw.decode() if state is None else state


# -- librdkafka statistics ------------------------------------------------------------------------------------


def client_statistics(config: ProcessorConfig, metrics: Metrics, input_topic: str,
                      interval_ms: int = STATISTICS_INTERVAL_MS) -> dict:
    """The settings that turn librdkafka's statistics on for one client, delivered to a ClientStatistics for
    `metrics` (statistics.interval.ms, unless the processor's settings name one; 0, or a stats_cb of the user's
    own, leaves them as set): {} when off. For the group consumer and the transactional producer only: theirs
    are the reports the metrics read; in the settings every client shares, the restore's consumer and the
    AdminClients would report too, for nothing. (What made statistics abort the process was a call inside a
    rebalance callback: decision 20.)"""
    if "stats_cb" in config.kafka:
        return {}
    interval = str(config.kafka.get("statistics.interval.ms", interval_ms))
    if interval.strip() in ("", "0"):
        return {}
    return {"statistics.interval.ms": interval, "stats_cb": ClientStatistics(metrics, input_topic)}


class ClientStatistics:
    """librdkafka's `stats_cb`: a few numbers of its JSON statistics, served on the loop (consume, poll,
    flush) every statistics.interval.ms. From the group consumer (the one reading the input topic): each
    partition's records not yet handed to the processor and the assignment's size (its round trips include its
    fetch waits: not exported). From a transactional producer, should one be given it: its queue and the p50
    and p99 round trip of its requests to each broker (the processor's has none: its transactional calls run on
    worker threads, txn_guard.py, decision 20). Any other client (the
    restore's consumer) is ignored. Never raises: an exception here would surface from the client's call."""

    def __init__(self, metrics: Metrics, input_topic: str) -> None:
        self._metrics = metrics
        self._input_topic = input_topic
        self._lag_partitions: set[str] = set()
        self._brokers: set[str] = set()

    def __call__(self, raw: str) -> None:
        try:
            stats = json.loads(raw)
            if stats.get("type") == "consumer":
                self._consumer(stats)
            elif stats.get("type") == "producer" and "txn_state" in stats.get("eos", {}):
                self._producer(stats)
        except Exception:  # a statistic is never worth a failed consume
            log.debug("librdkafka statistics not understood", exc_info=True)

    def _consumer(self, stats: dict) -> None:
        topic = stats.get("topics", {}).get(self._input_topic)
        if topic is None:
            return
        metrics = self._metrics
        seen = set()
        for partition, part in topic.get("partitions", {}).items():
            if int(partition) < 0 or part.get("fetch_state") in (None, "none", "stopped"):
                continue
            # consumer_lag is -1 here: it needs the consumer's own committed offset, and the processor
            # commits through its producer's transactions.
            end, position = part.get("ls_offset", -1), part.get("app_offset", -1)
            if end >= 0 and position >= 0:
                metrics.kafka_lag.labels(partition).set(max(end - position, 0))
                seen.add(partition)
        for partition in self._lag_partitions - seen:
            _remove(metrics.kafka_lag, partition)
        self._lag_partitions = seen
        group = stats.get("cgrp")
        if group is not None:
            metrics.kafka_assigned.set(group.get("assignment_size", 0))
        metrics.kafka_statistics.labels("consumer").set(time.time())

    def _producer(self, stats: dict) -> None:
        metrics = self._metrics
        metrics.kafka_queue_messages.set(stats.get("msg_cnt", 0))
        metrics.kafka_queue_bytes.set(stats.get("msg_size", 0))
        self._round_trips(stats)
        metrics.kafka_statistics.labels("producer").set(time.time())

    def _round_trips(self, stats: dict) -> None:
        metrics = self._metrics
        for broker in stats.get("brokers", {}).values():
            rtt = broker.get("rtt") or {}
            if broker.get("nodeid", -1) < 0 or not rtt.get("cnt"):
                continue  # the bootstrap and logical entries; or no request in the interval
            node = str(broker["nodeid"])
            metrics.kafka_rtt.labels(node, "0.5").set(rtt.get("p50", 0) / 1e6)
            metrics.kafka_rtt.labels(node, "0.99").set(rtt.get("p99", 0) / 1e6)
