"""Kafka failures, as branches of the project's error tree (processors/errors.py).

A wrapped librdkafka error keeps its code name and whether librdkafka called it retriable or fatal, so a
caller can decide without parsing messages.
"""

from __future__ import annotations

from confluent_kafka import KafkaException

from processors.errors import ConfigError, SettlementError


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
