"""A faust-streaming agent for a downstream quota service: consumes capacity-releases, both record kinds.

    pip install 'branch-settlement[faust]'
    SETTLE_BOOTSTRAP_SERVERS=127.0.0.1:9092 SETTLE_FAUST_DB=quota.db python examples/faust_releases.py worker

What it does. The app decodes the topic's values with a faust codec for the project's Avro single-object
encoding (`settlement-avro`, built on branch_settlement.schemas.codec.default_codec through
processors/kafka/consumers.py): each value is a typed `CapacityReleased` or `ParentSettled`. The agent applies
a `CapacityReleased` to the service's SQLite database (the quantity credited to its destination: `parent`,
back to the workflow's budget, or `global_pool`) and marks the parent done on `ParentSettled`. Each record is
applied in one database transaction together with its dedupe key (`SqliteSeenKeys`: the release key, or
`<parent_id>/settled`), so a record that comes again is skipped: effectively-once for the database.

Its limits, stated:
- faust's own exactly-once (`processing_guarantee="exactly_once"`) is not used: it is about faust's own
  output topics and tables, which this agent does not have. The guarantee here is at-least-once delivery plus
  the dedupe by key in the service's own transaction.
- faust reads `read_uncommitted` unless its exactly-once is on; the processor aborts transactions (every
  rebalance, every fenced or failed checkpoint) and an aborted release must never be applied. The app's
  transport (`ReadCommittedTransport`) therefore sets `read_committed` on the consumer faust creates. That
  reaches into aiokafka's consumer before it starts (`_isolation_level`); the app refuses to start if the
  attribute is not there (another aiokafka), rather than read uncommitted records.
- A faust agent acks an event when its body moves on, also when it raised: a failed record's offset would be
  committed, the release lost. The agent therefore iterates `stream.noack()` and acks each event only after
  its transaction committed. A failure is retried in place (the agent's partitions wait), and after
  `RETRIES` failures the worker stops with the error: its unacked record is not committed, and is the first
  one handed over after the restart.
- One agent instance takes the topic's partitions in turn, so a retry holds all of them; a slow database
  slows every partition. Connection settings: `bootstrap.servers` and the TLS/SASL subset that aiokafka
  takes (`faust_settings`); a librdkafka setting it cannot map is refused, never silently dropped.
- It consumes the topic from the earliest offset for a new group (`SETTLE_FAUST_GROUP` is the app id,
  so the consumer group; keep it stable: the committed offsets are where a restart goes on from).

Environment: SETTLE_BOOTSTRAP_SERVERS (default 127.0.0.1:9092), SETTLE_KAFKA_* as for every client
(processors/kafka/connection.py), SETTLE_TOPIC_PREFIX, SETTLE_FAUST_GROUP (default quota-service),
SETTLE_FAUST_DB (default quota.db), SETTLE_FAUST_DATADIR (faust's own state directory).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import ssl
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import faust
from faust.serializers import codecs
from faust.transport.drivers import aiokafka as faust_aiokafka

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka import connection
from branch_settlement.processors.kafka.consumers import (CapacityReleased, LoanRevocationRequested, ParentSettled,
                                                          SettlementRecord, SqliteSeenKeys, decode_output,
                                                          encode_output)
from branch_settlement.processors.kafka.errors import UndecodableOutput

log = logging.getLogger("settle.faust")

CODEC_NAME = "settlement-avro"
RETRIES = 5


# -- the codec -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Undecodable:
    """A value the codec could not decode (a schema newer than this client's, corruption). The codec returns
    it instead of raising: faust acks a record whose value fails to decode before the agent sees it, which
    would commit past a release never applied. The agent stops on it, unacked."""
    error: UndecodableOutput
    data: bytes


class SettlementAvroCodec(codecs.Codec):
    """Avro single-object encoding of the processor's outputs <-> typed records (CapacityReleased,
    ParentSettled, SettlementResult); `Undecodable` for bytes that are none of them."""

    def _loads(self, s: bytes) -> SettlementRecord | Undecodable:
        try:
            return decode_output(s)
        except UndecodableOutput as exc:
            return Undecodable(exc, bytes(s))

    def _dumps(self, obj: SettlementRecord) -> bytes:
        return encode_output(obj)


codecs.register(CODEC_NAME, SettlementAvroCodec())


# -- read_committed, whatever faust's processing guarantee -------------------------------------------------

class ReadCommittedConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport):
        consumer = super()._create_worker_consumer(transport)
        if not hasattr(consumer, "_isolation_level"):
            raise ConfigError("this aiokafka's consumer has no _isolation_level: cannot make faust read "
                              "read_committed; refusing to read uncommitted releases")
        consumer._isolation_level = "read_committed"
        return consumer


class ReadCommittedConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self):
        return ReadCommittedConsumerThread(self, loop=self.loop, beacon=self.beacon)


class ReadCommittedTransport(faust_aiokafka.Transport):
    Consumer = ReadCommittedConsumer


class SettlementApp(faust.App):
    """A faust App whose consumer transport reads read_committed."""

    def _new_transport(self):
        return ReadCommittedTransport(self.conf.broker_consumer, self)


# -- connection settings ---------------------------------------------------------------------------------

_MAPPED = {"bootstrap.servers", "security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username",
           "sasl.password", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.key.password",
           "client.id", "logger", "log_level"}


def faust_settings(client_config: Mapping[str, Any]) -> dict[str, Any]:
    """faust's `broker` and `broker_credentials` for a librdkafka client config (connection.client_config):
    PLAINTEXT, SSL (a CA, a client certificate), SASL_PLAINTEXT and SASL_SSL with PLAIN or SCRAM. Any other
    setting is refused: aiokafka does not read librdkafka's settings, and a dropped TLS or SASL setting
    would connect differently from every other client of the deployment."""
    unknown = sorted(set(client_config) - _MAPPED)
    if unknown:
        raise ConfigError(f"faust example: cannot pass {', '.join(unknown)} to aiokafka; map it in faust_settings")
    servers = [s.strip() for s in str(client_config["bootstrap.servers"]).split(",") if s.strip()]
    protocol = str(client_config.get("security.protocol", "PLAINTEXT")).upper()
    ssl_context = None
    if protocol in ("SSL", "SASL_SSL"):
        ssl_context = ssl.create_default_context(cafile=client_config.get("ssl.ca.location"))
        if client_config.get("ssl.certificate.location"):
            ssl_context.load_cert_chain(client_config["ssl.certificate.location"],
                                        client_config.get("ssl.key.location"),
                                        client_config.get("ssl.key.password"))
    credentials = None
    if protocol.startswith("SASL_"):
        mechanism = str(client_config.get("sasl.mechanism", client_config.get("sasl.mechanisms", "PLAIN"))).upper()
        if mechanism not in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            raise ConfigError(f"faust example: sasl.mechanism {mechanism} is not mapped")
        credentials = faust.SASLCredentials(username=client_config.get("sasl.username"),
                                            password=client_config.get("sasl.password"),
                                            mechanism=mechanism, ssl_context=ssl_context)
    elif protocol == "SSL":
        credentials = faust.SSLCredentials(ssl_context)
    elif protocol != "PLAINTEXT":
        raise ConfigError(f"faust example: security.protocol {protocol} is not mapped")
    settings: dict[str, Any] = {"broker": ";".join(f"kafka://{s}" for s in servers)}
    if credentials is not None:
        settings["broker_credentials"] = credentials
    return settings


# -- the service's database ------------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS credited (parent_id TEXT, destination TEXT, dimension TEXT, quantity INTEGER,
                                     release_key TEXT UNIQUE);
CREATE TABLE IF NOT EXISTS settled_parents (parent_id TEXT PRIMARY KEY, outcome TEXT);
"""


def open_store(path: str) -> SqliteSeenKeys:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for statement in filter(str.strip, SCHEMA.split(";")):
        conn.execute(statement)
    return SqliteSeenKeys(conn)


def apply_record(store: SqliteSeenKeys, record: SettlementRecord,
                 before_commit: Callable[[SettlementRecord], None] | None = None) -> bool:
    """Apply one record to the service's database, its dedupe key in the same transaction: True, or False
    when it was applied before (nothing written). `before_commit` runs after the writes, inside the
    transaction (tests inject a failure there: the writes roll back with the key)."""
    with store.claim([record.dedupe_key]) as new:
        if not new:
            return False
        db = store.connection
        if isinstance(record, CapacityReleased):
            db.execute("INSERT INTO credited VALUES (?, ?, ?, ?, ?)", (record.parent_id, record.destination,
                                                                        record.dimension, record.quantity,
                                                                        record.release_key))
        elif isinstance(record, ParentSettled):
            db.execute("INSERT INTO settled_parents VALUES (?, ?)", (record.parent_id, record.outcome))
        elif isinstance(record, LoanRevocationRequested):
            pass  # for the borrower: it credits nothing (the loan's return comes as a CapacityReleased)
        else:  # a SettlementResult: not on this topic
            raise ConfigError(f"unexpected {record.kind} on the releases topic")
        if before_commit is not None:
            before_commit(record)
        return True


# -- the app ---------------------------------------------------------------------------------------------

def make_app(client_config: Mapping[str, Any], *, group_id: str, releases_topic: str, db_path: str,
             datadir: str | None = None, fail_first: str | None = None) -> faust.App:
    """The faust app: `group_id` is its id (the consumer group). `fail_first`: a dedupe key whose first
    application fails after its writes (rolled back with them), to show the retry (tests)."""
    app = SettlementApp(group_id, **faust_settings(client_config), value_serializer=CODEC_NAME,
                        processing_guarantee="at_least_once", consumer_auto_offset_reset="earliest",
                        topic_allow_declare=False, topic_disable_leader=True, web_enabled=False,
                        datadir=datadir or tempfile.mkdtemp(prefix="faust-"), broker_commit_every=100,
                        broker_commit_interval=1.0)
    topic = app.topic(releases_topic, key_type=bytes, key_serializer="raw", value_serializer=CODEC_NAME)
    store = open_store(db_path)
    failures = {fail_first} if fail_first else set()

    def inject(record: SettlementRecord) -> None:
        if record.dedupe_key in failures:
            failures.discard(record.dedupe_key)
            raise RuntimeError(f"injected failure on {record.dedupe_key}")

    @app.agent(topic)
    async def releases(stream):
        async for event in stream.noack().events():
            record = event.value
            if isinstance(record, Undecodable):
                log.critical("stopping: %s", record.error)
                await app.crash(record.error)  # not acked: nothing past it is committed
                return
            for attempt in range(1, RETRIES + 1):
                try:
                    applied = apply_record(store, record, inject)
                    break
                except Exception as exc:  # rolled back: retried in place, the partitions wait
                    log.warning("applying %s %s failed (attempt %d of %d): %s", record.kind,
                                record.dedupe_key, attempt, RETRIES, exc)
                    if attempt == RETRIES:
                        await app.crash(exc)  # not acked: it comes first after the restart
                        return
                    await asyncio.sleep(0.2 * attempt)
            log.info("%s %s %s", "applied" if applied else "already applied:", record.kind, record.dedupe_key)
            await stream.ack(event)

    return app


def app_from_env(environ: Mapping[str, str] = os.environ) -> faust.App:
    bootstrap = environ.get(connection.BOOTSTRAP_SERVERS_ENV) or connection.DEFAULT_BOOTSTRAP_SERVERS
    config = connection.client_config(bootstrap, connection.settings_from_args(None, environ))
    prefix = environ.get("SETTLE_TOPIC_PREFIX", "")
    return make_app(config, group_id=environ.get("SETTLE_FAUST_GROUP", "quota-service"),
                    releases_topic=prefix + "capacity-releases", db_path=environ.get("SETTLE_FAUST_DB", "quota.db"),
                    datadir=environ.get("SETTLE_FAUST_DATADIR"), fail_first=environ.get("SETTLE_FAUST_FAIL_FIRST"))


if __name__ == "__main__":
    app_from_env().main()
