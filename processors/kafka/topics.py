"""Topics as code: load the declarative spec (deploy/topics.json), compare it with a cluster, create what is
missing.

An existing topic that differs from the spec (partition count, or any config the spec names) is *drift*. It is
reported, never accepted silently and never "fixed": a partition count cannot change without moving keys to
other partitions, and a config change on a live topic is an operator's decision, not a provisioning side effect.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from branch_settlement.processors.kafka.errors import BrokerUnreachable, KafkaFailure, TopicSpecError

SPEC_ENV = "SETTLE_TOPIC_SPEC"
TOPIC_PREFIX_ENV = "SETTLE_TOPIC_PREFIX"
# The spec is deploy/topics.json: in a source tree beside the deployment files, installed as package data
# (branch_settlement/deploy/), the same path from here.
DEFAULT_SPEC_PATH = Path(__file__).resolve().parents[2] / "deploy" / "topics.json"
# -1 asks the broker for its default.replication.factor: 1 on the local broker, the cluster's choice elsewhere.
BROKER_DEFAULT_REPLICATION_FACTOR = -1
# Kafka's own rule for topic names (kafka.common.internals.Topic).
# How often apply polls the metadata while freshly created topics propagate to the brokers.
METADATA_POLL_INTERVAL_S = 0.05
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")

STATUS_OK = "ok"
STATUS_CREATED = "created"
STATUS_MISSING = "missing"
STATUS_DRIFT = "drift"


@dataclass(frozen=True)
class TopicSpec:
    """One topic as the spec wants it. `name` is the physical name (the prefix already applied)."""

    name: str
    logical_name: str
    partitions: int
    config: Mapping[str, str]
    description: str = ""


@dataclass(frozen=True)
class Spec:
    topics: tuple[TopicSpec, ...]
    replication_factor: int = BROKER_DEFAULT_REPLICATION_FACTOR

    def topic(self, logical_name: str) -> TopicSpec:
        for topic in self.topics:
            if topic.logical_name == logical_name:
                return topic
        raise KeyError(logical_name)

    def names(self) -> dict[str, str]:
        """Logical name -> physical name, e.g. {"branch-events": "t1.branch-events"}."""
        return {topic.logical_name: topic.name for topic in self.topics}


@dataclass(frozen=True)
class TopicReport:
    """What the cluster has for one topic of the spec. `problems` is empty unless the status is drift."""

    spec: TopicSpec
    status: str
    partitions_observed: int | None = None
    config_observed: Mapping[str, str | None] = field(default_factory=dict)
    problems: tuple[str, ...] = ()


def load_spec(path: str | os.PathLike | None = None, prefix: str = "", partitions: int | None = None,
              replication_factor: int = BROKER_DEFAULT_REPLICATION_FACTOR) -> Spec:
    """Read the spec. `prefix` goes in front of every topic name (isolated names for tests and for several
    deployments on one cluster); `partitions` replaces `default_partitions`."""
    path = Path(path or os.environ.get(SPEC_ENV) or DEFAULT_SPEC_PATH)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TopicSpecError(f"no topic spec at {path}: pass --topic-spec or set {SPEC_ENV}") from None
    except (OSError, ValueError) as err:
        raise TopicSpecError(f"cannot read the topic spec {path}: {err}") from None
    if partitions is not None and partitions < 1:
        raise TopicSpecError(f"--partitions must be at least 1, not {partitions}")
    if replication_factor != BROKER_DEFAULT_REPLICATION_FACTOR and replication_factor < 1:
        raise TopicSpecError(f"--replication-factor must be at least 1, not {replication_factor}")
    return parse_spec(document, source=str(path), prefix=prefix, partitions=partitions,
                      replication_factor=replication_factor)


def parse_spec(document: object, source: str = "spec", prefix: str = "", partitions: int | None = None,
               replication_factor: int = BROKER_DEFAULT_REPLICATION_FACTOR) -> Spec:
    def bad(message: str) -> TopicSpecError:
        return TopicSpecError(f"{source}: {message}")

    if not isinstance(document, dict) or not isinstance(document.get("topics"), list):
        raise bad("expected an object with a list `topics`")
    default_partitions = partitions or document.get("default_partitions")
    if not _positive_int(default_partitions):
        raise bad("`default_partitions` must be a positive integer")
    topics = []
    for entry in document["topics"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise bad(f"each topic needs a `name`: {entry!r}")
        logical_name = entry["name"]
        count = entry.get("partitions", default_partitions)
        config = entry.get("config", {})
        if not _positive_int(count):
            raise bad(f"{logical_name}: `partitions` must be a positive integer")
        # Kafka configs are strings on the wire; a JSON number here would compare unequal forever.
        if not isinstance(config, dict) or not all(isinstance(v, str) for v in config.values()):
            raise bad(f"{logical_name}: `config` must map setting names to strings")
        topics.append(TopicSpec(name=prefix + logical_name, logical_name=logical_name, partitions=count,
                                config=dict(config), description=entry.get("description", "")))
    names = [topic.name for topic in topics]
    if len(set(names)) != len(names):
        raise bad("a topic name appears twice")
    for name in names:
        if not _TOPIC_NAME.fullmatch(name) or name in (".", ".."):
            raise bad(f"{name!r} is not a valid Kafka topic name (letters, digits, '.', '_', '-'; at most 249)")
    return Spec(topics=tuple(topics), replication_factor=replication_factor)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check(admin: AdminClient, spec: Spec, timeout_s: float = 15.0) -> list[TopicReport]:
    """Compare the cluster with the spec, changing nothing. One report per topic, in spec order."""
    metadata = _list_topics(admin, timeout_s)
    present = [topic for topic in spec.topics if topic.name in metadata.topics]
    configs = _describe_configs(admin, [topic.name for topic in present], timeout_s)
    reports = []
    for topic in spec.topics:
        if topic.name not in metadata.topics:
            reports.append(TopicReport(spec=topic, status=STATUS_MISSING))
        else:
            reports.append(_compare(topic, spec.replication_factor, metadata.topics[topic.name],
                                    configs[topic.name]))
    return reports


def apply(admin: AdminClient, spec: Spec, timeout_s: float = 15.0) -> list[TopicReport]:
    """Create the topics the cluster lacks; report drift on the others. Idempotent: a second run creates
    nothing and reports every topic ok (or the same drift)."""
    reports = check(admin, spec, timeout_s)
    missing = [report.spec for report in reports if report.status == STATUS_MISSING]
    if not missing:
        return reports
    raced = _create(admin, missing, spec.replication_factor, timeout_s)
    # The controller has committed the topics, but a broker's metadata cache follows a moment later; wait,
    # so that a caller can use them at once and so that a re-check below sees them.
    _await_metadata(admin, [topic.name for topic in missing], timeout_s)
    recheck = {}
    if raced:
        # Someone else created these between our check and our create: theirs may differ from the spec.
        narrowed = replace(spec, topics=tuple(topic for topic in spec.topics if topic.name in raced))
        recheck = {report.spec.name: report for report in check(admin, narrowed, timeout_s)}
    return [recheck.get(report.spec.name)
            or (replace(report, status=STATUS_CREATED) if report.status == STATUS_MISSING else report)
            for report in reports]


def has_drift(reports: list[TopicReport]) -> bool:
    return any(report.status == STATUS_DRIFT for report in reports)


def _compare(topic: TopicSpec, replication_factor: int, metadata, observed_config: Mapping[str, object]
             ) -> TopicReport:
    problems = []
    partitions_observed = len(metadata.partitions)
    if partitions_observed != topic.partitions:
        problems.append(f"partitions: {partitions_observed} on the cluster, {topic.partitions} in the spec "
                        "(not changed: keys would move to other partitions; recreate the topic or change the spec)")
    if replication_factor != BROKER_DEFAULT_REPLICATION_FACTOR:
        replicas = {len(partition.replicas) for partition in metadata.partitions.values()}
        if replicas != {replication_factor}:
            problems.append(f"replication factor: {sorted(replicas)} on the cluster, {replication_factor} wanted")
    config_observed = {}
    for key, wanted in sorted(topic.config.items()):
        entry = observed_config.get(key)
        value = None if entry is None else entry.value
        config_observed[key] = value
        if value != wanted:
            problems.append(f"{key}: {value!r} on the cluster, {wanted!r} in the spec")
    return TopicReport(spec=topic, status=STATUS_DRIFT if problems else STATUS_OK,
                       partitions_observed=partitions_observed, config_observed=config_observed,
                       problems=tuple(problems))


def _list_topics(admin: AdminClient, timeout_s: float):
    try:
        return admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise BrokerUnreachable.wrap("no metadata from the Kafka cluster", exc) from None


def _await_metadata(admin: AdminClient, names: list[str], timeout_s: float) -> None:
    """Return once every topic of `names` is in the metadata with a leader for each partition."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        metadata = _list_topics(admin, timeout_s)
        if all(name in metadata.topics and metadata.topics[name].partitions
               and all(partition.leader >= 0 for partition in metadata.topics[name].partitions.values())
               for name in names):
            return
        if time.monotonic() > deadline_s:
            raise KafkaFailure(f"topics created but not in the cluster metadata after {timeout_s}s: "
                               f"{', '.join(sorted(names))}", code="_TIMED_OUT", retriable=True)
        time.sleep(METADATA_POLL_INTERVAL_S)


def _describe_configs(admin: AdminClient, names: list[str], timeout_s: float) -> dict[str, dict]:
    if not names:
        return {}
    futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name) for name in names],
                                     request_timeout=timeout_s)
    configs = {}
    for resource, future in futures.items():
        try:
            configs[resource.name] = future.result()
        except KafkaException as exc:
            raise KafkaFailure.wrap(f"cannot read the config of topic {resource.name}", exc) from None
    return configs


def _create(admin: AdminClient, topics: list[TopicSpec], replication_factor: int, timeout_s: float
            ) -> set[str]:
    """Create `topics`; returns the names that existed by the time the broker got the request."""
    new_topics = [NewTopic(topic.name, num_partitions=topic.partitions, replication_factor=replication_factor,
                           config=dict(topic.config)) for topic in topics]
    futures = admin.create_topics(new_topics, operation_timeout=timeout_s, request_timeout=timeout_s)
    raced = set()
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args and exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                raced.add(name)
            else:
                raise KafkaFailure.wrap(f"cannot create topic {name}", exc) from None
    return raced


def delete_topics(admin: AdminClient, names: list[str], timeout_s: float = 15.0) -> None:
    """Delete `names`; a topic that is already gone is not an error. For tests and teardown only."""
    if not names:
        return
    futures = admin.delete_topics(names, operation_timeout=timeout_s, request_timeout=timeout_s)
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args and exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise KafkaFailure.wrap(f"cannot delete topic {name}", exc) from None
