"""The consumer side: what a downstream service (a scheduler, a quota service) uses to act on what the
processor committed.

Typed records. `capacity-releases` carries three kinds of record, told apart by the writer schema in each
record's header: `CapacityReleased` (one released quantity of one dimension, unique by `release_key`),
`ParentSettled` (one per closed parent: it has no `child_id`, no `release_key`) and `LoanRevocationRequested`
(a parent asks a borrower to return a loan: once per loan, unique by `revocation_key`). `settlement-results`
carries `SettlementResult`, one per input event and one per processor tick. `decode_output` turns a record's
bytes into one of the four dataclasses (`UndecodableOutput` for anything else), so a handler matches on the type
(`match record: case CapacityReleased(): ...`) instead of reading keys that one kind lacks.

`SettlementConsumer` reads in a consumer group with `isolation.level=read_committed` (only what a committed
transaction of the processor wrote) and auto-commit off, hands each record (or each batch) to the caller's
handler, and commits a partition's offset only past records whose handler returned: at-least-once. A handler
that raises gets `HandlerFailed`; nothing from the failed record on is committed, and the record comes again
(to the next `poll` of this consumer, or after a restart to whichever member owns the partition).

At-least-once means a record can come again: after a crash between the handler and the commit, after a
rebalance, after a re-read. `dedupe=` takes a `SeenKeys` store of the keys already applied: a record whose
key it has is skipped (and committed), the handler never sees it. `BoundedSeenKeys` is an in-memory default
(it forgets on restart and past its bound: it catches redeliveries within one process). `SqliteSeenKeys` is
the durable pattern: the key is inserted in the same database transaction as the handler's own writes, so
the effect and the key commit together or not at all: effectively-once. A service on another database does
the same in its own transaction (docs/clients.md).

Connection settings are every other client's: `processors/kafka/connection.py` (`client_config`,
`config_from_args`); the settings this consumer needs for its guarantee are set here and may not be
overridden.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, ContextManager, Protocol, Union

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka.errors import HandlerFailed, KafkaFailure, UndecodableOutput
from branch_settlement.schemas.codec import Codec, default_codec
from branch_settlement.schemas.errors import CodecError

log = logging.getLogger("settle.consumer")

RELEASES_TOPIC = "capacity-releases"
RESULTS_TOPIC = "settlement-results"

# The settings the at-least-once guarantee rests on: set by the consumer, a conflicting value is refused.
_REQUIRED = {"isolation.level": "read_committed", "enable.auto.commit": False}


# -- typed records ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a record was read: its output topic, partition and offset (not part of the record)."""
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class Balance:
    """One dimension of a parent: its kind and the nine terms of the accounting invariant."""
    kind: str
    capacity: int
    available: int
    outstanding: int
    pending: int
    awaiting_confirmation: int
    lent: int
    returned_to_pool: int
    committed: int
    overdrawn: int

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Balance:
        return cls(**{name: record[name] for name in _BALANCE_FIELDS})

    def to_record(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _BALANCE_FIELDS}


_BALANCE_FIELDS = tuple(f.name for f in fields(Balance))


@dataclass(frozen=True)
class CapacityReleased:
    """One released quantity of one dimension (topic capacity-releases). `destination` is `parent` (back to
    the parent's `available`, for siblings and retries) or `global_pool`; `child_id` and `attempt_id` are
    empty for a parent-level release (the close or expiry of the parent). Unique by `release_key`."""
    kind: ClassVar[str] = "CapacityReleased"
    release_key: str
    parent_id: str
    child_id: str
    attempt_id: str
    dimension: str
    quantity: int
    destination: str
    reason: str
    idempotency_key: str
    triggering_event_id: str
    balance: Balance
    input_partition: int
    input_offset: int
    ledger_time_ms: int
    source: Source | None = field(default=None, compare=False)

    @property
    def parent_level(self) -> bool:
        """Whether the release is the parent's own (at its close or expiry), not a child's."""
        return self.child_id == ""

    @property
    def dedupe_key(self) -> str:
        """The release key: unique on the topic (docs/contract.md, "Release keys and deduplication")."""
        return self.release_key

    def to_record(self) -> dict[str, Any]:
        record = {name: getattr(self, name) for name in _RELEASE_FIELDS}
        record["balance"] = self.balance.to_record()
        return record


@dataclass(frozen=True, eq=True)
class ParentSettled:
    """The summary of a closed parent (topic capacity-releases, beside the releases): one per parent. It
    releases nothing itself (the parent-level `CapacityReleased` records do) and names no child."""
    kind: ClassVar[str] = "ParentSettled"
    parent_id: str
    outcome: str
    dimensions: dict[str, Balance]
    idempotency_key: str
    triggering_event_id: str
    input_partition: int
    input_offset: int
    ledger_time_ms: int
    source: Source | None = field(default=None, compare=False)

    def __hash__(self) -> int:  # `dimensions` is a dict; a parent settles once
        return hash((self.kind, self.parent_id, self.input_partition, self.input_offset))

    @property
    def dedupe_key(self) -> str:
        """`<parent_id>/settled`: a parent settles once, and no release key ends so (a release key ends with
        its destination, `parent` or `global_pool`)."""
        return f"{self.parent_id}/settled"

    def to_record(self) -> dict[str, Any]:
        record = {name: getattr(self, name) for name in _SETTLED_FIELDS}
        record["dimensions"] = {name: balance.to_record() for name, balance in self.dimensions.items()}
        return record


@dataclass(frozen=True)
class SettlementResult:
    """The result of one input event (topic settlement-results), or of one of the processor's own ticks
    (`is_processor_tick`). `result` is a result code (docs/contract.md, "Result codes")."""
    kind: ClassVar[str] = "SettlementResult"
    event_id: str
    idempotency_key: str
    parent_id: str
    child_id: str | None
    event_type: str
    result: str
    detail: str
    input_partition: int
    input_offset: int
    ledger_time_ms: int
    source: Source | None = field(default=None, compare=False)

    @property
    def applied(self) -> bool:
        """Whether the event changed the ledger: `ok`, or `overdrawn` (applied, with an overrun)."""
        return self.result in ("ok", "overdrawn")

    @property
    def is_processor_tick(self) -> bool:
        """A tick the processor made (a Tick on the input is answered `tick_not_accepted`)."""
        return self.event_type == "Tick" and self.result != "tick_not_accepted"

    @property
    def dedupe_key(self) -> str:
        """One result per input offset, and the processor's ticks (several may be folded before one offset)
        told apart by their idempotency key; no release key or summary key ends with `/result`."""
        if self.is_processor_tick:
            return f"{self.input_partition}/{self.input_offset}/tick/{self.idempotency_key}/result"
        return f"{self.input_partition}/{self.input_offset}/result"

    def to_record(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _RESULT_FIELDS}


@dataclass(frozen=True, eq=True)
class LoanRevocationRequested:
    """The parent asks the borrower of loan `loan_id` to return it (topic capacity-releases, keyed by the parent
    id like the releases): `reason` is `sibling_needs_capacity` (a sibling's reservation, `child_id`, was
    `awaiting_revocation`), `parent_closed` or `parent_expired`. At most one per loan; it releases nothing
    itself: the borrower's `LoanReturned` does, with its usage. Unique by `revocation_key`."""
    kind: ClassVar[str] = "LoanRevocationRequested"
    revocation_key: str
    parent_id: str
    loan_id: str
    borrower: str
    quantities: dict[str, int]
    reason: str
    idempotency_key: str
    triggering_event_id: str
    triggering_event_type: str
    child_id: str
    input_partition: int
    input_offset: int
    ledger_time_ms: int
    source: Source | None = field(default=None, compare=False)

    def __hash__(self) -> int:  # `quantities` is a dict; a loan is asked back once
        return hash((self.kind, self.revocation_key))

    @property
    def dedupe_key(self) -> str:
        """The revocation key, `<parent_id>/loan/<loan_id>/revocation`: unique on the topic (no release key
        ends so, nor `/settled`)."""
        return self.revocation_key

    def to_record(self) -> dict[str, Any]:
        record = {name: getattr(self, name) for name in _REVOCATION_FIELDS}
        record["quantities"] = dict(self.quantities)
        return record


def _record_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.name != "source")


_RELEASE_FIELDS = _record_fields(CapacityReleased)
_SETTLED_FIELDS = _record_fields(ParentSettled)
_RESULT_FIELDS = _record_fields(SettlementResult)
_REVOCATION_FIELDS = _record_fields(LoanRevocationRequested)

ReleaseRecord = Union[CapacityReleased, ParentSettled, LoanRevocationRequested]
SettlementRecord = Union[CapacityReleased, ParentSettled, LoanRevocationRequested, SettlementResult]
RECORD_TYPES: dict[str, type] = {cls.kind: cls for cls in (CapacityReleased, ParentSettled, LoanRevocationRequested,
                                                           SettlementResult)}


def from_record(kind: str, record: Mapping[str, Any], source: Source | None = None) -> SettlementRecord:
    """The typed record of a decoded output record (`Codec.decode`, `read_outputs`); UndecodableOutput for a
    kind this API does not read (AuditRecord, DeadLetter, an event)."""
    if kind == "CapacityReleased":
        values = {name: record[name] for name in _RELEASE_FIELDS}
        values["balance"] = Balance.from_record(record["balance"])
        return CapacityReleased(**values, source=source)
    if kind == "ParentSettled":
        values = {name: record[name] for name in _SETTLED_FIELDS}
        values["dimensions"] = {name: Balance.from_record(b) for name, b in record["dimensions"].items()}
        return ParentSettled(**values, source=source)
    if kind == "SettlementResult":
        return SettlementResult(**{name: record[name] for name in _RESULT_FIELDS}, source=source)
    if kind == "LoanRevocationRequested":
        values = {name: record[name] for name in _REVOCATION_FIELDS}
        values["quantities"] = dict(record["quantities"])
        return LoanRevocationRequested(**values, source=source)
    raise UndecodableOutput(f"{_where(source)}: a {kind} record, not one of {', '.join(RECORD_TYPES)}",
                            source=source)


def decode_output(value: bytes | None, *, codec: Codec | None = None, source: Source | None = None
                  ) -> SettlementRecord:
    """The typed record of an output record's value (Avro single-object encoding). UndecodableOutput when
    the bytes are not a record this client knows (a schema newer than this client's, or corrupt), or are
    a kind this API does not read; its message names the topic, partition and offset."""
    if value is None:
        raise UndecodableOutput(f"{_where(source)}: a record without a value", source=source)
    try:
        kind, record = (codec or default_codec()).decode(value)
    except CodecError as exc:
        raise UndecodableOutput(f"{_where(source)}: cannot decode: {exc}", source=source) from exc
    return from_record(kind, record, source)


def encode_output(record: SettlementRecord, *, codec: Codec | None = None) -> bytes:
    """The Avro single-object encoding of a typed record: the processor's bytes for it."""
    return (codec or default_codec()).encode(record.kind, record.to_record())


def _where(source: Source | None) -> str:
    return f"{source.topic}[{source.partition}]@{source.offset}" if source else "a record"


# -- keys already applied --------------------------------------------------------------------------------

class SeenKeys(Protocol):
    """A store of the dedupe keys already applied (release keys, `<parent>/settled`, result keys).

    `claim(keys)` is a context manager: entering it gives the subset of `keys` not applied yet (the
    consumer hands only those records to the handler); leaving it without an exception records them as
    applied; leaving it with one (the handler raised) records none of them. For effectively-once, the
    record of the keys and the handler's effect must commit together: `SqliteSeenKeys` does both in one
    database transaction."""

    def claim(self, keys: Sequence[str]) -> ContextManager[set[str]]: ...


class BoundedSeenKeys:
    """In memory, the last `max_keys` keys applied (oldest forgotten first). Catches what comes again within
    one process (a commit lost to a rebalance and the partition assigned back, a retry after HandlerFailed,
    a re-read); forgets everything on restart. For more, a durable store (`SqliteSeenKeys`)."""

    def __init__(self, max_keys: int = 100_000) -> None:
        if max_keys < 1:
            raise ConfigError(f"BoundedSeenKeys(max_keys={max_keys}): at least 1")
        self.max_keys = max_keys
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @contextlib.contextmanager
    def claim(self, keys: Sequence[str]) -> Iterator[set[str]]:
        with self._lock:
            new = {key for key in keys if key not in self._keys}
        yield new
        with self._lock:
            for key in keys:
                if key in new:
                    self._keys[key] = None
                    self._keys.move_to_end(key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)


class SqliteSeenKeys:
    """The durable pattern, in SQLite (the standard library's): the keys go into a table of the service's
    own database, in the same transaction as the handler's writes. Give the handler this store's
    `connection` and write the effect on it inside the handler: `claim` begins the transaction, inserts the
    keys, and commits after the handler returned (or rolls the effect and the keys back together when it
    raised). So a record that comes again after a crash at any point is either applied with its key, or not
    at all: effectively-once. The same on another database: insert the key (unique) and apply the effect in
    one transaction, skip when the key is there (docs/clients.md)."""

    def __init__(self, connection: sqlite3.Connection | str, table: str = "applied_settlement_keys") -> None:
        if not table.replace("_", "").isalnum():
            raise ConfigError(f"SqliteSeenKeys table {table!r}: letters, digits and underscores only")
        if isinstance(connection, str):
            connection = sqlite3.connect(connection, isolation_level=None)
        self.connection = connection
        self.table = table
        with self._transaction():
            connection.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, applied_at_ms INTEGER)")

    def __contains__(self, key: str) -> bool:
        return self.connection.execute(f"SELECT 1 FROM {self.table} WHERE key = ?", (key,)).fetchone() is not None

    def __len__(self) -> int:
        return self.connection.execute(f"SELECT COUNT(*) FROM {self.table}").fetchone()[0]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        if self.connection.in_transaction:
            raise ConfigError("SqliteSeenKeys: the connection has a transaction open already; a claim must "
                              "begin its own, to commit the keys with the handler's writes")
        self.connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.connection.rollback()
            raise
        self.connection.commit()

    @contextlib.contextmanager
    def claim(self, keys: Sequence[str]) -> Iterator[set[str]]:
        now_ms = int(time.time() * 1000)
        with self._transaction():
            new = set()
            for key in keys:
                cursor = self.connection.execute(
                    f"INSERT OR IGNORE INTO {self.table} (key, applied_at_ms) VALUES (?, ?)", (key, now_ms))
                if cursor.rowcount == 1:
                    new.add(key)
            yield new


# -- the consumer ----------------------------------------------------------------------------------------

@dataclass
class ConsumerStats:
    handled: int = 0           # records handed to the handler, whose handler returned
    duplicates: int = 0        # records skipped: their key was applied already
    ticks_skipped: int = 0     # results of the processor's own ticks, not handed over (include_ticks=False)
    undecodable: int = 0       # records given to on_undecodable
    undecodable_stops: int = 0  # UndecodableOutput raised (no on_undecodable): nothing past the record committed
    commits: int = 0
    commits_lost: int = 0      # commits refused because the partition moved: those records come again


RecordHandler = Callable[[SettlementRecord], Any]
BatchHandler = Callable[[list[SettlementRecord]], Any]

# A commit refused because this member no longer owns the partition (a rebalance): not an error, the new
# owner gets the records again, and dedupe skips what was applied.
_PARTITION_MOVED = frozenset({KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID,
                              KafkaError.REBALANCE_IN_PROGRESS, KafkaError._ASSIGNMENT_LOST,
                              KafkaError.FENCED_INSTANCE_ID})
_COMMIT_ATTEMPTS = 5


class SettlementConsumer:
    """Reads the processor's outputs in a consumer group, read_committed, and commits only past what the
    handler applied.

        consumer = SettlementConsumer(config, group_id="quota-service", topics=["capacity-releases"],
                                      dedupe=SqliteSeenKeys("quota.db"))
        consumer.run(apply)          # until SIGTERM/SIGINT or consumer.stop(); then closes

    `run(handler)` calls `handler(record)` for each record, in partition order; `run(handler, batches=True)`
    calls `handler(records)` once per fetched batch (several partitions, each in order). After each batch
    the offsets past the handled records are committed (synchronously). When the handler raises,
    `HandlerFailed` is raised: what was handled before the failing record is committed, nothing from it on,
    and the consumer is rewound there, so the next `poll` (or a restart, in any member) hands it over again.

    `topics` are the topics' actual names (with the deployment's prefix); `include_ticks=False` skips the
    results of the processor's own ticks. `on_undecodable(error)`, when given, is called for a record this
    client cannot decode (a newer schema, corruption) and the record counts as handled; without it,
    `UndecodableOutput` is raised like a handler failure: nothing past the record is committed.

    A handler slower than `max.poll.interval.ms` (librdkafka's default 300 s; set it in `client_config`)
    costs this member its partitions: its commit is refused (`commits_lost`) and the records go to another.
    """

    def __init__(self, client_config: Mapping[str, Any], *, group_id: str,
                 topics: Sequence[str] = (RELEASES_TOPIC,), dedupe: SeenKeys | None = None,
                 include_ticks: bool = False, batch_size: int = 500, poll_timeout_s: float = 1.0,
                 auto_offset_reset: str | None = None,
                 on_undecodable: Callable[[UndecodableOutput], Any] | None = None,
                 codec: Codec | None = None) -> None:
        if not group_id:
            raise ConfigError("SettlementConsumer: a group_id is needed: the group's committed offsets are where "
                              "a restart goes on from")
        if not topics:
            raise ConfigError("SettlementConsumer: no topics")
        if batch_size < 1:
            raise ConfigError(f"SettlementConsumer batch_size={batch_size}: at least 1")
        config = dict(client_config)
        for key, required in _REQUIRED.items():
            if key in config and str(config[key]).lower() != str(required).lower():
                raise ConfigError(f"SettlementConsumer: {key}={config[key]!r} is refused: the consumer needs "
                                  f"{key}={str(required).lower()} (read only what the processor committed; "
                                  "commit only after the handler succeeded)")
        if config.get("group.id") not in (None, group_id):
            raise ConfigError("SettlementConsumer: pass the group as group_id, not group.id in client_config")
        # a new group starts at the beginning: every release still on the topic (kept forever) is handed over
        config.update({"group.id": group_id, "isolation.level": "read_committed", "enable.auto.commit": False,
                       "auto.offset.reset": auto_offset_reset or config.get("auto.offset.reset", "earliest")})
        self.group_id = group_id
        self.topics = list(topics)
        self.dedupe = dedupe
        self.include_ticks = include_ticks
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.on_undecodable = on_undecodable
        self.codec = codec or default_codec()
        self.stats = ConsumerStats()
        self._stopping = threading.Event()
        self._closed = False
        try:
            self._consumer = Consumer(config)
        except KafkaException as exc:
            raise KafkaFailure.wrap("creating the consumer", exc) from exc
        self._consumer.subscribe(self.topics)

    # -- lifecycle

    def stop(self) -> None:
        """Ask `run` to return after the record or batch in hand (its offsets committed). Thread-safe, and
        what SIGTERM and SIGINT do while `run` has the signals."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def close(self) -> None:
        """Leave the group (its partitions go to the other members at once). Commits nothing: every offset
        of a handled record was committed after its batch. Idempotent."""
        if not self._closed:
            self._closed = True
            self._consumer.close()

    def __enter__(self) -> SettlementConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def committed(self, timeout_s: float = 10.0) -> dict[tuple[str, int], int]:
        """The group's committed offsets of the partitions assigned to this member (the next record each
        hands over after a restart); partitions with none left out."""
        assignment = self._consumer.assignment()
        if not assignment:
            return {}
        try:
            offsets = self._consumer.committed(assignment, timeout=timeout_s)
        except KafkaException as exc:
            raise KafkaFailure.wrap("reading the committed offsets", exc) from exc
        return {(tp.topic, tp.partition): tp.offset for tp in offsets if tp.offset >= 0}

    def assignment(self) -> list[tuple[str, int]]:
        return sorted((tp.topic, tp.partition) for tp in self._consumer.assignment())

    def run(self, handler: RecordHandler | BatchHandler, *, batches: bool = False,
            handle_signals: bool = True) -> ConsumerStats:
        """Hand records over until `stop()`, SIGTERM or SIGINT (with `handle_signals`, in the main thread:
        the handlers are put back afterwards), then close. A handler failure raises HandlerFailed, after
        closing: a supervisor restarts the service and the failed record comes first."""
        restore = self._take_signals() if handle_signals else {}
        try:
            while not self._stopping.is_set():
                (self.poll_batch if batches else self.poll)(handler)
            return self.stats
        finally:
            for signum, previous in restore.items():
                signal.signal(signum, previous)
            self.close()

    def _take_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: self.stop())
        return previous

    # -- one fetch

    def poll(self, handler: RecordHandler, timeout_s: float | None = None) -> int:
        """Fetch one batch and hand its records to `handler` one by one; commit. Returns how many records
        were taken (handled, skipped as duplicates or processor ticks)."""
        return self._poll(handler, False, timeout_s)

    def poll_batch(self, handler: BatchHandler, timeout_s: float | None = None) -> int:
        """Fetch one batch and hand it to `handler` as one list (duplicates and processor ticks left out;
        not called when nothing is left); commit. Returns how many records were taken."""
        return self._poll(handler, True, timeout_s)

    def _poll(self, handler, batched: bool, timeout_s: float | None) -> int:
        if self._closed:
            raise ConfigError("SettlementConsumer: closed")
        messages = self._fetch(self.poll_timeout_s if timeout_s is None else timeout_s)
        if not messages:
            return 0
        records: list[tuple[Any, SettlementRecord | None]] = []  # (message, record; None: leave out)
        failure = None
        for index, message in enumerate(messages):
            try:
                record = decode_output(message.value(), codec=self.codec, source=_source(message))
            except UndecodableOutput as exc:
                if self.on_undecodable is None:
                    failure = (exc, messages[index:])
                    break
                self.on_undecodable(exc)
                self.stats.undecodable += 1
                record = None
            if isinstance(record, SettlementResult) and record.is_processor_tick and not self.include_ticks:
                self.stats.ticks_skipped += 1
                record = None
            records.append((message, record))
        if failure is not None:
            self._rewind(failure[1])  # before the handler runs: a failure there rewinds to an earlier offset
        if batched:
            self._hand_batch(handler, records)
        else:
            self._hand_each(handler, records)
        if failure is not None:
            self.stats.undecodable_stops += 1
            raise failure[0]
        return len(records)

    def _fetch(self, timeout_s: float) -> list:
        try:
            messages = self._consumer.consume(num_messages=self.batch_size, timeout=timeout_s)
        except KafkaException as exc:
            raise KafkaFailure.wrap(f"consuming {', '.join(self.topics)}", exc) from exc
        kept = []
        for message in messages:
            err = message.error()
            if err is None:
                kept.append(message)
            elif err.fatal():
                raise KafkaFailure(f"consuming {', '.join(self.topics)}: {err.str()} ({err.name()})",
                                   code=err.name(), retriable=err.retriable(), fatal=True)
            else:  # librdkafka retries transport errors itself; it reports them as it goes
                log.warning("consumer: %s (%s)", err.str(), err.name())
        return kept

    def _hand_each(self, handler: RecordHandler, records: list) -> None:
        done = []
        for index, (message, record) in enumerate(records):
            if record is not None:
                try:
                    self._apply_one(handler, record)
                except BaseException as exc:
                    self._commit(done)
                    self._rewind([m for m, _ in records[index:]])
                    if isinstance(exc, Exception):
                        raise HandlerFailed(f"the handler failed on {record.kind} {_where(record.source)}: "
                                            f"{type(exc).__name__}: {exc}; nothing from it on is committed, it "
                                            "comes again", records=[record]) from exc
                    raise
            done.append(message)
        self._commit(done)

    def _apply_one(self, handler: RecordHandler, record: SettlementRecord) -> None:
        if self.dedupe is None:
            handler(record)
            self.stats.handled += 1
            return
        with self.dedupe.claim([record.dedupe_key]) as new:
            if record.dedupe_key in new:
                handler(record)
        if record.dedupe_key in new:
            self.stats.handled += 1
        else:
            self.stats.duplicates += 1

    def _hand_batch(self, handler: BatchHandler, records: list) -> None:
        batch = [record for _, record in records if record is not None]
        try:
            if batch:
                self._apply_batch(handler, batch)
        except BaseException as exc:
            self._rewind([m for m, _ in records])
            if isinstance(exc, Exception):
                raise HandlerFailed(f"the handler failed on a batch of {len(batch)} records: "
                                    f"{type(exc).__name__}: {exc}; none of it is committed, it comes again",
                                    records=batch) from exc
            raise
        self._commit([m for m, _ in records])

    def _apply_batch(self, handler: BatchHandler, batch: list) -> None:
        if self.dedupe is None:
            handler(batch)
            self.stats.handled += len(batch)
            return
        keys = list(dict.fromkeys(record.dedupe_key for record in batch))
        with self.dedupe.claim(keys) as new:
            fresh, taken = [], set()
            for record in batch:
                if record.dedupe_key in new and record.dedupe_key not in taken:
                    taken.add(record.dedupe_key)
                    fresh.append(record)
            if fresh:
                handler(fresh)
        self.stats.handled += len(fresh)
        self.stats.duplicates += len(batch) - len(fresh)

    # -- offsets

    def _commit(self, messages: list) -> None:
        ends: dict[tuple[str, int], int] = {}
        for message in messages:
            where = (message.topic(), message.partition())
            ends[where] = max(ends.get(where, -1), message.offset() + 1)
        if not ends:
            return
        offsets = [TopicPartition(topic, partition, offset) for (topic, partition), offset in ends.items()]
        for attempt in range(1, _COMMIT_ATTEMPTS + 1):
            try:
                self._consumer.commit(offsets=offsets, asynchronous=False)
                self.stats.commits += 1
                return
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                code = err.code() if isinstance(err, KafkaError) else None
                if code in _PARTITION_MOVED:
                    self.stats.commits_lost += 1
                    log.warning("consumer: offsets not committed, the partitions moved (%s): their records "
                                "come again, to this member or another", err.name())
                    return
                if isinstance(err, KafkaError) and err.retriable() and attempt < _COMMIT_ATTEMPTS:
                    time.sleep(0.2 * attempt)
                    continue
                raise KafkaFailure.wrap("committing the consumer's offsets", exc) from exc

    def _rewind(self, messages: list) -> None:
        """Seek each partition back to the first of `messages` in it: the next fetch starts there."""
        first: dict[tuple[str, int], int] = {}
        for message in messages:
            first.setdefault((message.topic(), message.partition()), message.offset())
        for (topic, partition), offset in first.items():
            try:
                self._consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as exc:  # the partition was revoked meanwhile: its new owner reads it
                log.warning("consumer: cannot rewind %s[%d] to %d: %s", topic, partition, offset, exc)


def _source(message) -> Source:
    return Source(message.topic(), message.partition(), message.offset())

