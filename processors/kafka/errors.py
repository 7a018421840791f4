"""Kafka failures, as branches of the project's error tree (branch_settlement/errors.py).

A wrapped librdkafka error keeps its code name and whether librdkafka called it retriable or fatal, so a
caller can decide without parsing messages.
"""

from __future__ import annotations

from confluent_kafka import KafkaException

from branch_settlement.errors import ConfigError, SettlementError


class KafkaFailure(SettlementError):
    """A Kafka request failed. Raised by the admin helpers in this package.

    `code` is librdkafka's error name (e.g. "_TRANSPORT", "TOPIC_AUTHORIZATION_FAILED"); `retriable` and
    `fatal` are librdkafka's verdict. Operator: read the message; a retriable failure may pass on its own.
    """

    def __init__(self, message: str, code: str = "", retriable: bool = False, fatal: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retriable = retriable
        self.fatal = fatal

    @classmethod
    def wrap(cls, what: str, exc: KafkaException) -> KafkaFailure:
        """`what` says what was attempted, in words an operator recognises."""
        err = exc.args[0] if exc.args else None
        if err is None or not hasattr(err, "name"):
            return cls(f"{what}: {exc}")
        return cls(f"{what}: {err.str()} ({err.name()})", code=err.name(),
                   retriable=err.retriable(), fatal=err.fatal())


class BrokerUnreachable(KafkaFailure):
    """No broker answered a metadata request in time. Raised before anything was created or changed.

    Operator: check the bootstrap servers and the network path, and the TLS/SASL settings passed to
    librdkafka; for the local broker, run `make kafka-up` (or `bash deploy/kafka.sh status`).
    """


class TopicSpecError(ConfigError):
    """The topic spec file (deploy/topics.json) is missing or invalid, or an override does not fit it.

    Raised when the spec is loaded, before any request. Operator: fix the file or the flag named in the message.
    """


class TransactionCallStuck(KafkaFailure):
    """A transactional call did not return within its timeout plus a margin. Raised by `bounded`; the call
    goes on in the background on a producer that must not be used again. The caller treats it like a fatal
    producer error (before the commit) or an unknown commit outcome (during the commit or its abort)."""


class TooManyStuckCalls(KafkaFailure):
    """Several given-up producers are still blocked in librdkafka. Raised by `check_stuck_budget`.
    Operator: the process exits non-zero; its supervisor restarts it, and the restore picks up from the
    committed offsets. Check the brokers' health if it repeats."""


class PublishFailed(KafkaFailure):
    """Events were not acknowledged by the broker. Raised by `BranchEventProducer.flush`; the message counts
    them and names the first error. Operator: the events were not published: publish them again (the
    idempotency keys make a second delivery harmless)."""


class RestoreIncomplete(KafkaFailure):
    """The changelog did not reach the committed input offset in time. Raised by restore; the partition is
    not processed. Operator: check the changelog topic (retention, compaction of a recreated topic)."""


class ProducerFenced(KafkaFailure):
    """Another process started with this worker's transactional.id, or the broker fenced a fresh producer
    while aborting its crashed predecessor's transaction. Raised by the checkpoint before anything was
    committed; the work was discarded. The processor recreates its producer a few times, then stops.
    Operator: give every worker its own worker_slot (SETTLE_WORKER_SLOT)."""


class FatalProducerError(KafkaFailure):
    """librdkafka declared the transactional producer unusable before the commit was attempted. Raised by
    the checkpoint after the work was discarded; the processor recreates its producer and replays."""


class CommitOutcomeUnknown(KafkaFailure):
    """The commit was sent but neither confirmed nor cleanly aborted (e.g. a coordinator failover during
    EndTxn): the transaction may have committed. Raised by the checkpoint; the processor must not trust
    its in-memory state: it recreates the producer (which settles the pending transaction) and reloads
    every partition from the committed offsets and the changelog."""


class ProjectionsNotFound(ConfigError):
    """`--state-dir`/`--group-id` name no processor's projections. Raised by `settle inspect` and the live-ledger
    comparison of `settle replay --topic`. Operator: pass the state directory and group id the processor runs with."""


class TickNotProducible(ConfigError):
    """A Tick given to the event producer. Only the processor advances ledger time (its own ticks, on
    ledger-ticks); a Tick on the input topic would be answered `tick_not_accepted`. Raised by
    BranchEventProducer.publish and `settle produce` before anything is sent. Caller: leave ticks out; for
    a simulated clock, run the processor with --clock-file."""


class KafkaAuthenticationFailed(KafkaFailure):
    """The broker refused the client's SASL credentials (a wrong user or password, a mechanism it does not
    offer). Raised by the connection preflight (processors/kafka/preflight.py) before any other request.
    Operator: check sasl.username and the password, set in SETTLE_KAFKA_SASL_PASSWORD, a
    SETTLE_KAFKA_SASL_PASSWORD_FILE or a --kafka-config-file (never on the command line), and sasl.mechanism."""


class KafkaTlsFailed(KafkaFailure):
    """The TLS handshake failed: the broker's certificate is not signed by a CA in ssl.ca.location (or has
    another name), or the broker refused the client's certificate. Raised by the connection preflight.
    Operator: point ssl.ca.location at the cluster's CA; for a mutual-TLS listener, give
    ssl.certificate.location and ssl.key.location of a certificate that CA signed."""


class KafkaSettingRejected(KafkaFailure):
    """librdkafka refused a client setting when the client was made: an unknown setting, a bad value, a
    certificate, key or CA file it cannot read. Raised by the connection preflight and the command line.
    Operator: fix the setting the message names (--kafka-config, --kafka-config-file, SETTLE_KAFKA_*)."""


class KafkaNotAuthorized(KafkaFailure):
    """The broker's authorizer refused an operation this command needs: an ACL is missing for the
    principal (TOPIC_AUTHORIZATION_FAILED, GROUP_AUTHORIZATION_FAILED,
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED, CLUSTER_AUTHORIZATION_FAILED). Raised by the preflight, before
    anything is read or written, or by the command when the broker refuses later. Operator: grant the role's
    ACLs (`settle acls apply`, deploy/acls.json) or run the command as the principal whose role it is."""


class AclSpecError(ConfigError):
    """The ACL spec (deploy/acls.json) is missing or invalid, or names a topic the topic spec does not have.
    Raised when the spec is loaded, before any request. Operator: fix the file or the flag the message names."""


class RecordTooLarge(KafkaFailure):
    """A record the processor must write is larger than the producer or the topic accepts (message.max.bytes,
    max.message.bytes): by construction the fold's records fit the defaults (docs/processor.md, "Input
    limits"), so a setting below them was chosen. Raised into the processor's log when its partition stops:
    the checkpoint was aborted, nothing of it committed, the other partitions go on. Operator: raise the
    setting the message names to at least the record's size, then restart."""


class HandlerFailed(SettlementError):
    """A downstream service's handler raised on a record (or a batch) handed over by `SettlementConsumer`
    (processors/kafka/consumers.py); the handler's exception is the cause, `records` what it was given.
    Raised by the consumer's poll and run after committing what was handled before it and nothing from it on,
    with the consumer rewound there: the record comes again, to the next poll or after a restart. Caller:
    fix the cause and restart; with a SeenKeys store whatever was applied already is skipped."""

    def __init__(self, message: str, records: list | None = None) -> None:
        super().__init__(message)
        self.records = list(records or [])


class UndecodableOutput(SettlementError):
    """A record on an output topic that this client cannot read as a CapacityReleased, ParentSettled or
    SettlementResult: written with a schema newer than the client's, corrupt, or of another kind (an
    AuditRecord, a DeadLetter, an event). `source` names its topic, partition and offset. Raised by
    `decode_output` and by `SettlementConsumer`, which commits nothing past it (unless it was given an
    on_undecodable callback). Operator: upgrade the client to the processor's schemas, or subscribe only to
    capacity-releases and settlement-results."""

    def __init__(self, message: str, source=None) -> None:
        super().__init__(message)
        self.source = source


class ResultTimeout(SettlementError, TimeoutError):
    """No result came in time for an event that was published and acknowledged. Raised by
    `ResultWaiter.wait` and `BranchEventProducer.publish_and_wait`; `pending` lists the events still without
    a result, `results` those found. The event may still be settled later: the processor may be stopped,
    behind, or its partition stopped. Caller: wait again, look the result up (read_outputs), or publish the
    event again: the same idempotency key is answered `duplicate` if it was applied. Operator: check that
    `settle run` runs and its lag (settle_consumer_lag_records)."""

    def __init__(self, message: str, pending: list | None = None, results: list | None = None) -> None:
        super().__init__(message)
        self.pending = list(pending or [])
        self.results = list(results or [])
