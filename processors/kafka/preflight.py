"""Before a command talks to Kafka: one bounded round of requests that proves the connection (TLS), the
credentials (SASL) and the ACLs the command needs, and turns whatever is wrong into one line.

librdkafka never gives up by itself: a client with a wrong password or an untrusted CA retries forever and
prints `%3|...|FAIL|` lines on stderr, and a consumer whose group is not authorized gets an error per poll
while it goes on. So every Kafka command first runs `check` with a deadline: an admin client (its log routed
to Python logging, silent) asks for metadata, and its error callback says why nothing came back
(_AUTHENTICATION, _SSL, a refused client certificate, a connection refused). With the connection proven it
asks the broker which operations this principal may perform on the command's topics and groups (KIP-430:
authorized operations, no side effect) and refuses to start what the broker would refuse half way.

`kafka_error` maps any librdkafka error (a KafkaException, a KafkaError) to the project's one-line errors
(processors/kafka/errors.py), for the failures that happen later.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient

from branch_settlement.processors.kafka.connection import LIBRDKAFKA_LOGGER
from branch_settlement.processors.kafka.errors import (BrokerUnreachable, KafkaAuthenticationFailed, KafkaFailure,
                                                       KafkaNotAuthorized, KafkaSettingRejected, KafkaTlsFailed)

DEFAULT_TIMEOUT_S = 15.0
TIMEOUT_ENV = "SETTLE_CONNECT_TIMEOUT_MS"
# How long one metadata request may wait before the error callback is read again.
_PROBE_S = 0.25
# Settings that name local files librdkafka reads when the client is made ("probe" asks it to find the system's).
_FILE_SETTINGS = ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.keystore.location",
                  "ssl.crl.location")

# What to grant, per librdkafka authorization error.
_GRANTS = {
    "TOPIC_AUTHORIZATION_FAILED": "grant this principal its role's topic ACLs",
    "GROUP_AUTHORIZATION_FAILED": "grant this principal its role's consumer group ACLs",
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": "the processor role grants WRITE on the transactional ids prefixed "
                                             "TOPIC_PREFIX + TRANSACTIONAL_ID_PREFIX-: run with those, or grant them",
    "CLUSTER_AUTHORIZATION_FAILED": "this needs a cluster ACL no role of branch-settlement has: run it as a super user",
    "DELEGATION_TOKEN_AUTHORIZATION_FAILED": "grant this principal the delegation token ACLs",
}
AUTHORIZATION_CODES = frozenset(_GRANTS)
UNREACHABLE_CODES = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN", "_TIMED_OUT", "_RESOLVE", "_MSG_TIMED_OUT"})
# What a broker answers when it wants a client certificate and got none it trusts (TLS alerts 42, 48, 116).
_CLIENT_CERT_REFUSED = re.compile(r"alert (bad certificate|unknown ca|certificate required)|"
                                  r"SSL alert number (42|48|116)", re.I)
# librdkafka's decoration of a broker error: "sasl_ssl://127.0.0.1:9192/bootstrap: ... (after 315ms in state AUTH_REQ)".
_BROKER_PREFIX = re.compile(r"(?:^|(?<=: ))(?:[a-z_]+://)?[^\s/:]+(?::\d+)?/(?:bootstrap|\d+): ")
_AFTER = re.compile(r" \(after \d+ms in state [A-Z_]+(?:, \d+ identical error\(s\) suppressed)?\)")


@dataclass(frozen=True)
class Needs:
    """What a command does on the cluster, to be checked before it starts: per physical topic name and per
    consumer group, the ACL operations (AclOperation names: READ, WRITE, DESCRIBE, ...) its principal needs.
    `role` names the role of deploy/acls.json that grants them, for the message."""

    topics: Mapping[str, frozenset[str]] = field(default_factory=dict)
    groups: Mapping[str, frozenset[str]] = field(default_factory=dict)
    cluster: frozenset[str] = frozenset()
    role: str = ""
    hint: str = ""  # what to do when refused, instead of granting the role's ACLs


def timeout_s(environ: Mapping[str, str] | None = None) -> float:
    environ = os.environ if environ is None else environ
    value = environ.get(TIMEOUT_ENV)
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        return max(int(value), 1) / 1000
    except ValueError:
        raise KafkaSettingRejected(f"{TIMEOUT_ENV}={value!r}: expected milliseconds") from None


def check(client_config: Mapping[str, str], needs: Needs | None = None, timeout: float | None = None,
          should_stop: Callable[[], bool] = lambda: False) -> None:
    """Raise the one-line error that says why a command could not work with this config, or return: the
    brokers answer, trust and are trusted, accept the credentials, and allow every operation of `needs`.
    Returns early, unchecked, once `should_stop()` (a drain asked during start-up: the command does not start)."""
    timeout = timeout_s() if timeout is None else timeout
    check_local_files(client_config)
    errors: list[KafkaError] = []
    logs = _LogLines()
    try:
        admin = AdminClient({**client_config, "logger": logs.logger, "error_cb": errors.append})
    except KafkaException as exc:
        raise kafka_error(exc, "cannot make a Kafka client", client_config) from None
    deadline = time.monotonic() + timeout
    _connect(admin, errors, logs.lines, client_config, deadline, timeout, should_stop)
    if needs is not None and not should_stop():
        _check_cluster(admin, needs, client_config, deadline)
        _check_topics(admin, needs, client_config, deadline)
        _check_groups(admin, needs, client_config, deadline)


def check_local_files(client_config: Mapping[str, str]) -> None:
    """A CA, certificate or key file that is not there is named as such, before librdkafka says `BIO lib`."""
    for key in _FILE_SETTINGS:
        path = client_config.get(key)
        if not path or (key == "ssl.ca.location" and path == "probe"):
            continue
        if not os.path.exists(path):
            raise KafkaSettingRejected(f"{key} {path}: no such file", code="_INVALID_ARG")
        if not os.access(path, os.R_OK):
            raise KafkaSettingRejected(f"{key} {path}: not readable by this user", code="_INVALID_ARG")


class _LogLines(logging.Handler):
    """librdkafka's log lines of one client, kept: some causes are only logged (a connection closed at once)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        # A logger of its own, outside the logging tree: nothing it gets is printed anywhere.
        self.logger = logging.Logger(f"{LIBRDKAFKA_LOGGER}.preflight")
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < 1000:
            self.lines.append(record.getMessage())


def _connect(admin: AdminClient, errors: list[KafkaError], logs: list[str], config: Mapping[str, str],
             deadline: float, timeout: float, should_stop: Callable[[], bool]) -> None:
    """Metadata from any broker, or the error that explains why none came: an authentication or TLS failure
    at once (retrying cannot mend it), an unreachable cluster at the deadline."""
    while not should_stop():
        try:
            admin.list_topics(timeout=min(_PROBE_S, max(deadline - time.monotonic(), 0.01)))
            return
        except KafkaException as exc:
            last = exc.args[0] if exc.args else None
        admin.poll(0)  # serves the error and log callbacks
        for err in errors:
            decisive = _decisive(err, config)
            if decisive is not None:
                raise decisive
        plaintext = config.get("security.protocol", "plaintext").lower() in ("plaintext", "sasl_plaintext")
        if plaintext and any("Disconnected" in line and "in state APIVERSION_QUERY" in line for line in logs):
            raise KafkaTlsFailed(
                f"the broker at {config.get('bootstrap.servers')} closed the connection at the first request: it "
                f"probably expects TLS, and security.protocol is {config.get('security.protocol', 'PLAINTEXT')} "
                "(set security.protocol=SSL or SASL_SSL, and ssl.ca.location)", code="_TRANSPORT")
        if time.monotonic() >= deadline:
            cause = next((e for e in reversed(errors) if e.name() not in ("_ALL_BROKERS_DOWN",)), last)
            reason = _clean(cause.str()) if isinstance(cause, KafkaError) else "no answer"
            raise BrokerUnreachable(
                f"no metadata from the Kafka cluster at {config.get('bootstrap.servers')} within {timeout:g} s "
                f"({reason}): is it running, and is this its address? Local broker: `make kafka-up` (secured: "
                "`make kafka-secure-up`; docs/kafka.md)",
                code=cause.name() if isinstance(cause, KafkaError) else "_TIMED_OUT", retriable=True)


def _decisive(err: KafkaError, config: Mapping[str, str]) -> KafkaFailure | None:
    """The failure an error-callback error proves, if it proves one that waiting will not mend."""
    name, text = err.name(), err.str()
    if name == "_AUTHENTICATION" or name == "SASL_AUTHENTICATION_FAILED":
        return _authentication_failed(text, config, name)
    if name == "_SSL":
        return _tls_failed(text, config, name)
    if name == "_TRANSPORT" and _CLIENT_CERT_REFUSED.search(text):
        return _client_certificate_refused(text, config, name)
    return None


def _authentication_failed(text: str, config: Mapping[str, str], code: str) -> KafkaAuthenticationFailed:
    user = config.get("sasl.username")
    who = f"user {user!r}" if user else "this client (no sasl.username)"
    return KafkaAuthenticationFailed(
        f"the brokers at {config.get('bootstrap.servers')} refused the SASL credentials of {who} "
        f"({config.get('sasl.mechanism', 'GSSAPI')}): {_clean(text)}. Check sasl.username and its password "
        "(SETTLE_KAFKA_SASL_PASSWORD, SETTLE_KAFKA_SASL_PASSWORD_FILE or a --kafka-config-file)", code=code)


def _tls_failed(text: str, config: Mapping[str, str], code: str) -> KafkaTlsFailed:
    reason = _clean(text)
    if "certificate verify failed" in reason:
        ca = config.get("ssl.ca.location")
        hint = (f"the broker's certificate is not signed by the CA in ssl.ca.location ({ca})" if ca and ca != "probe"
                else "the broker's certificate is not signed by a CA this machine trusts: set ssl.ca.location "
                     "to the cluster's CA")
        return KafkaTlsFailed(f"TLS handshake with {config.get('bootstrap.servers')} failed: {hint} "
                              "(or names another host)", code=code)
    return KafkaTlsFailed(f"TLS handshake with {config.get('bootstrap.servers')} failed: {reason}", code=code)


def _client_certificate_refused(text: str, config: Mapping[str, str], code: str) -> KafkaTlsFailed:
    cert = config.get("ssl.certificate.location")
    given = f"the certificate {cert}" if cert else "no client certificate (ssl.certificate.location is not set)"
    return KafkaTlsFailed(
        f"the broker at {config.get('bootstrap.servers')} refused this client's TLS certificate: {given}; this "
        "listener requires one signed by the cluster's CA (ssl.certificate.location, ssl.key.location)", code=code)


def _who(config: Mapping[str, str]) -> str:
    if config.get("sasl.username") and "sasl" in config.get("security.protocol", "").lower():
        return f"user {config['sasl.username']!r}"
    if config.get("ssl.certificate.location"):
        return f"the client certificate {config['ssl.certificate.location']}"
    return "this client"


def _refused(config: Mapping[str, str], needs: Needs, what: str, operations, code: str) -> KafkaNotAuthorized:
    role = f" (the {needs.role} role of deploy/acls.json: `settle acls apply`)" if needs.role else ""
    hint = needs.hint or f"grant it{role}"
    return KafkaNotAuthorized(f"{_who(config)} may not {'/'.join(sorted(operations))} {what} on "
                              f"{config.get('bootstrap.servers')}: {hint}", code=code)


def _check_topics(admin: AdminClient, needs: Needs, config: Mapping[str, str], deadline: float) -> None:
    if not needs.topics:
        return
    futures = admin.describe_topics(TopicCollection(list(needs.topics)), include_authorized_operations=True,
                                    request_timeout=max(deadline - time.monotonic(), 1.0))
    for name, future in futures.items():
        wanted = needs.topics[name]
        try:
            description = future.result()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            code = err.name() if isinstance(err, KafkaError) else ""
            if code == "TOPIC_AUTHORIZATION_FAILED":
                raise _refused(config, needs, f"topic {name}", wanted, code) from None
            if code == "UNKNOWN_TOPIC_OR_PART":
                raise KafkaFailure(f"topic {name} does not exist on {config.get('bootstrap.servers')}: create "
                                   "the topics first (`settle topics apply`, with the same --topic-prefix)",
                                   code=code) from None
            raise kafka_error(exc, f"cannot describe topic {name}", config) from None
        allowed = _names(description.authorized_operations)
        if allowed is not None and not wanted <= allowed:
            raise _refused(config, needs, f"topic {name}", wanted - allowed, "TOPIC_AUTHORIZATION_FAILED")


def _check_cluster(admin: AdminClient, needs: Needs, config: Mapping[str, str], deadline: float) -> None:
    if not needs.cluster:
        return
    try:
        description = admin.describe_cluster(include_authorized_operations=True,
                                             request_timeout=max(deadline - time.monotonic(), 1.0)).result()
    except KafkaException as exc:
        raise kafka_error(exc, "cannot describe the cluster", config) from None
    # An empty set comes back as None: a principal with no cluster ACL, or a broker too old to say.
    allowed = _names(description.authorized_operations) or frozenset()
    if not needs.cluster <= allowed:
        raise _refused(config, needs, "the cluster", needs.cluster - allowed, "CLUSTER_AUTHORIZATION_FAILED")


# A group's coordinator may be loading or moving (the first request of a fresh cluster creates
# __consumer_offsets): asked again until the deadline.
_GROUP_RETRIABLE = frozenset({"NOT_COORDINATOR", "COORDINATOR_LOAD_IN_PROGRESS", "COORDINATOR_NOT_AVAILABLE",
                              "_TIMED_OUT", "_TRANSPORT"})


def _check_groups(admin: AdminClient, needs: Needs, config: Mapping[str, str], deadline: float) -> None:
    pending = dict(needs.groups)
    while pending:
        futures = admin.describe_consumer_groups(list(pending), include_authorized_operations=True,
                                                 request_timeout=max(deadline - time.monotonic(), 1.0))
        for name, future in futures.items():
            wanted = pending[name]
            try:
                description = future.result()
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                code = err.name() if isinstance(err, KafkaError) else ""
                if code == "GROUP_AUTHORIZATION_FAILED":
                    raise _refused(config, needs, f"consumer group {name}", wanted, code) from None
                if code in _GROUP_RETRIABLE and time.monotonic() < deadline:
                    continue
                raise kafka_error(exc, f"cannot describe consumer group {name}", config) from None
            allowed = _names(description.authorized_operations)
            if allowed is not None and not wanted <= allowed:
                raise _refused(config, needs, f"consumer group {name}", wanted - allowed,
                               "GROUP_AUTHORIZATION_FAILED")
            del pending[name]
        if pending:
            time.sleep(_PROBE_S)


def _names(operations) -> frozenset[str] | None:
    """AclOperation names; None when the broker did not say (too old, or no authorizer to ask)."""
    if operations is None:
        return None
    return frozenset(op.name for op in operations)


def _clean(text: str) -> str:
    """librdkafka's error text without the broker address in front and the state timing behind."""
    return _AFTER.sub("", _BROKER_PREFIX.sub("", text.strip()))


def kafka_error(exc: KafkaException | KafkaError, what: str, config: Mapping[str, str] | None = None) -> KafkaFailure:
    """A librdkafka failure as the project's one-line error of its kind. `what` says what was attempted."""
    config = config or {}
    err = exc if isinstance(exc, KafkaError) else (exc.args[0] if exc.args else None)
    if not isinstance(err, KafkaError):
        return KafkaFailure(f"{what}: {exc}")
    name, text = err.name(), err.str()
    flags = {"code": name, "retriable": err.retriable(), "fatal": err.fatal()}
    if name in AUTHORIZATION_CODES:
        return KafkaNotAuthorized(f"{what}: not authorized ({name}): {_clean(text)}; {_GRANTS[name]} "
                                  "(`settle acls apply`, deploy/acls.json)", **flags)
    if name in ("_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED"):
        return KafkaAuthenticationFailed(f"{what}: {_authentication_failed(text, config, name)}", **flags)
    if name == "_SSL":
        return KafkaTlsFailed(f"{what}: {_tls_failed(text, config, name)}", **flags)
    if name == "_INVALID_ARG":
        return KafkaSettingRejected(f"{what}: {_clean(text)}", **flags)
    if name in UNREACHABLE_CODES:
        return BrokerUnreachable(f"{what}: {_clean(text)} ({name}) [bootstrap servers: "
                                 f"{config.get('bootstrap.servers', '?')}]", **flags)
    return KafkaFailure(f"{what}: {_clean(text)} ({name})", **flags)
