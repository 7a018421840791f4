"""Least privilege on a real secured broker (deploy/kafka-secure.sh): TLS, SCRAM-SHA-512 and client certificates,
the StandardAuthorizer allowing nothing without an ACL, and the ACLs of deploy/acls.json applied with
`settle acls apply`. Each role does its work under its own principal and nothing more: the producer publishes
events, the processor settles them, the auditor re-folds and exports read-only; every write outside a role is
refused by the broker. A wrong password, a missing or wrong CA and a missing ACL are one line on stderr and a
non-zero exit for every Kafka command, within seconds.

The session fixture starts a secured broker of its own (free ports, a temporary run directory: a fresh CA,
certificates and passwords) with the script a developer uses, and stops it at the end; it reuses the jar cache
of deploy/kafka.sh.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from branch_settlement.processors.kafka.clients import read_outputs
from branch_settlement.processors.kafka.connection import parse_properties
from branch_settlement.processors.kafka.topics import load_spec
from tests.kafka.pipeline import example_events

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
SECURE_SH = REPO / "deploy" / "kafka-secure.sh"
# A cold machine installs Kafka from Maven Central first (deploy/kafka.sh install).
UP_TIMEOUT_S = 600
COMMAND_TIMEOUT_S = 120
# A refused connection, credential or ACL must be reported within this, never retried for ever.
FAST_FAILURE_S = 20
PRINCIPALS = ("admin", "producer", "processor", "auditor")
GROUP = "settle-secure"
SLOT = "w1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class SecureBroker:
    run_dir: Path
    port: int  # SASL_SSL
    ssl_port: int  # mutual TLS
    env: dict

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def bootstrap_tls(self) -> str:
        return f"127.0.0.1:{self.ssl_port}"

    def properties(self, principal: str, tls: bool = False) -> Path:
        return self.run_dir / "clients" / f"{principal}{'-tls' if tls else ''}.properties"

    def client(self, principal: str, tls: bool = False) -> dict:
        """librdkafka settings of a principal, from the files the script wrote, for direct clients."""
        settings = parse_properties(self.properties(principal, tls).read_text(), "test")
        return {**settings, "bootstrap.servers": self.bootstrap_tls if tls else self.bootstrap}

    def script(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SECURE_SH), command], env=self.env, capture_output=True, text=True,
                              timeout=UP_TIMEOUT_S)


@pytest.fixture(scope="session")
def secure_broker(tmp_path_factory) -> SecureBroker:
    run_dir = tmp_path_factory.mktemp("kafka-secure") / "run"
    port, ssl_port, controller_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "KAFKA_SECURE_PORT": str(port), "KAFKA_SECURE_SSL_PORT": str(ssl_port),
           "KAFKA_SECURE_CONTROLLER_PORT": str(controller_port), "KAFKA_SECURE_RUN_DIR": str(run_dir)}
    broker = SecureBroker(run_dir, port, ssl_port, env)
    up = broker.script("up")
    if up.returncode != 0:
        broker.script("down")
        pytest.fail(f"deploy/kafka-secure.sh up failed:\n{up.stdout}{up.stderr}", pytrace=False)
    try:
        yield broker
    finally:
        down = broker.script("down")
        assert down.returncode == 0, down.stdout + down.stderr


def settle(*args: str, env: dict | None = None, timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout_s,
                          cwd=REPO)


@dataclass(frozen=True)
class Deployment:
    broker: SecureBroker
    prefix: str
    names: dict

    def as_(self, principal: str, tls: bool = False) -> list[str]:
        """The connection flags of a principal, as an operator passes them: the settings in a file."""
        return ["--bootstrap-servers", self.broker.bootstrap_tls if tls else self.broker.bootstrap,
                "--kafka-config-file", str(self.broker.properties(principal, tls))]

    def run_args(self, state_dir: Path) -> list[str]:
        return ["run", "--topic-prefix", self.prefix, "--group-id", GROUP, "--worker-slot", SLOT,
                "--state-dir", str(state_dir), "--tick-interval-ms", "200", "--commit-interval-ms", "100",
                "--session-timeout-ms", "6000"]

    @property
    def transactional_id(self) -> str:
        return f"{self.prefix}branch-settlement-{SLOT}"


@pytest.fixture(scope="module")
def deployment(secure_broker: SecureBroker) -> Deployment:
    """This module's topics and the three roles' ACLs, provisioned by admin with the commands an operator runs."""
    prefix = f"sec.{uuid.uuid4().hex[:8]}."
    admin = ["--bootstrap-servers", secure_broker.bootstrap, "--kafka-config-file",
             str(secure_broker.properties("admin"))]
    topics = settle("topics", "apply", *admin, "--topic-prefix", prefix, "--partitions", "4")
    assert topics.returncode == 0, topics.stdout + topics.stderr
    applied = settle("acls", "apply", *admin, "--topic-prefix", prefix, "--group-id", GROUP)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "created" in applied.stdout and "missing" not in applied.stdout
    return Deployment(secure_broker, prefix, load_spec(prefix=prefix).names())


# -- the broker and its files -------------------------------------------------------------------------------


def test_the_script_is_idempotent_and_keeps_its_secrets_private(secure_broker: SecureBroker):
    again = secure_broker.script("up")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().startswith("kafka-secure: already running (pid ")
    status = secure_broker.script("status")
    assert status.returncode == 0
    assert f"SASL_SSL    {secure_broker.bootstrap}" in status.stdout
    assert f"SSL         {secure_broker.bootstrap_tls}" in status.stdout
    for principal in PRINCIPALS:
        for secret in (secure_broker.run_dir / "secrets" / f"{principal}.password",
                       secure_broker.run_dir / "tls" / f"{principal}.key", secure_broker.properties(principal)):
            assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
        assert len(secret.read_text()) > 0
    passwords = {(secure_broker.run_dir / "secrets" / f"{p}.password").read_text().strip() for p in PRINCIPALS}
    assert len(passwords) == len(PRINCIPALS) and all(len(p) >= 24 for p in passwords)
    config = (secure_broker.run_dir / "server.properties").read_text()
    assert "allow.everyone.if.no.acl.found=false" in config
    assert "org.apache.kafka.metadata.authorizer.StandardAuthorizer" in config
    assert not any(password in config for password in passwords)


def test_acls_check_agrees_and_apply_again_creates_nothing(deployment: Deployment):
    admin = [*deployment.as_("admin"), "--topic-prefix", deployment.prefix, "--group-id", GROUP]
    check = settle("acls", "check", *admin)
    assert check.returncode == 0, check.stdout + check.stderr
    again = settle("acls", "apply", *admin, "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    assert {row["status"] for row in json.loads(again.stdout)} == {"ok"}
    # Only a principal that manages ACLs may ask.
    refused = settle("acls", "check", *deployment.as_("producer"), "--topic-prefix", deployment.prefix)
    assert refused.returncode == 2 and "may not DESCRIBE the cluster" in refused.stderr


# -- what each role may not do ------------------------------------------------------------------------------


def _produce_refusals(config: dict, topics: list[str], idempotent: bool = False) -> dict[str, str | None]:
    """topic -> the delivery error of one record sent there (None: it was written)."""
    outcome: dict[str, str | None] = {}

    def delivered(err, _msg, topic: str) -> None:
        outcome[topic] = None if err is None else err.name()

    producer = Producer({**config, "enable.idempotence": idempotent, "acks": "all", "message.timeout.ms": 10_000,
                         "log_level": 0})
    for topic in topics:
        producer.produce(topic, key=b"k", value=b"not an event",
                         on_delivery=lambda err, msg, topic=topic: delivered(err, msg, topic))
    assert producer.flush(30) == 0
    return outcome


def _init_transactions_refusal(config: dict, transactional_id: str) -> str:
    producer = Producer({**config, "transactional.id": transactional_id, "log_level": 0})
    with pytest.raises(KafkaException) as refused:
        producer.init_transactions(15)
    return refused.value.args[0].name()


def _read_refusal(config: dict, topic: str, group: str) -> str:
    consumer = Consumer({**config, "group.id": group, "enable.auto.commit": False, "log_level": 0})
    try:
        consumer.assign([TopicPartition(topic, 0, -2)])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            for message in consumer.consume(10, 0.5):
                if message.error() and message.error().code() != KafkaError._PARTITION_EOF:
                    return message.error().name()
        return "no error"
    finally:
        consumer.close()


def test_the_producer_writes_only_the_input(deployment: Deployment):
    names = deployment.names
    producer = deployment.broker.client("producer")
    # Idempotent, as settle produce and BranchEventProducer are: WRITE on the topic is all it needs (KIP-679).
    assert _produce_refusals(producer, [names["branch-events"]], idempotent=True) == {names["branch-events"]: None}
    outcome = _produce_refusals(producer, list(names.values()))
    assert outcome.pop(names["branch-events"]) is None
    assert outcome == {topic: "TOPIC_AUTHORIZATION_FAILED" for topic in outcome}
    assert set(outcome) >= {names[t] for t in ("ledger-changelog", "ledger-ticks", "settlement-results",
                                               "capacity-releases", "settlement-audit", "branch-events-dlq")}
    # Not the processor: no transaction under its transactional.id, and nothing to read.
    assert _init_transactions_refusal(producer, deployment.transactional_id) == "TRANSACTIONAL_ID_AUTHORIZATION_FAILED"
    assert _read_refusal(producer, names["settlement-results"], "settle-audit-replay") in (
        "TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED")


def test_the_auditor_writes_nothing(deployment: Deployment, events: Path):
    auditor = deployment.broker.client("auditor")
    outcome = _produce_refusals(auditor, list(deployment.names.values()))
    assert outcome == {topic: "TOPIC_AUTHORIZATION_FAILED" for topic in deployment.names.values()}
    # With WRITE on no topic, not even an idempotent producer id (it would take a cluster ACL: IDEMPOTENT_WRITE).
    with pytest.raises(KafkaException) as refused:
        _produce_refusals(auditor, [deployment.names["branch-events"]], idempotent=True)
    assert refused.value.args[0].name() == "CLUSTER_AUTHORIZATION_FAILED"
    assert _init_transactions_refusal(auditor, deployment.transactional_id) == "TRANSACTIONAL_ID_AUTHORIZATION_FAILED"
    # Over its client certificate too: the certificate's CN is the same principal, with the same ACLs.
    assert _produce_refusals(deployment.broker.client("auditor", tls=True), [deployment.names["branch-events"]]) == {
        deployment.names["branch-events"]: "TOPIC_AUTHORIZATION_FAILED"}
    refused = settle("produce", str(events), *deployment.as_("auditor"),
                     "--topic-prefix", deployment.prefix)
    assert refused.returncode == 2  # an error: nothing was done
    assert refused.stderr.strip() == (f"settle produce: user 'auditor' may not WRITE topic {deployment.names['branch-events']} "
                                      f"on {deployment.broker.bootstrap}: grant it (the producer role of "
                                      "deploy/acls.json: `settle acls apply`)")


def test_the_processor_cannot_write_the_input(deployment: Deployment):
    """Ledger time comes only from the processor's own ticks on ledger-ticks: it may not append to the input."""
    outcome = _produce_refusals(deployment.broker.client("processor"), [deployment.names["branch-events"]])
    assert outcome == {deployment.names["branch-events"]: "TOPIC_AUTHORIZATION_FAILED"}


# -- the roles at work --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def events(tmp_path_factory, worked_example: Path) -> Path:
    """The worked example without its Ticks (only the processor makes ledger time now)."""
    return example_events(worked_example, tmp_path_factory.mktemp("events"))


def _outputs(deployment: Deployment, expected: int, timeout_s: float = 60) -> dict[str, list]:
    """The committed results, releases and dead letters by kind, read by the auditor (read_outputs, its own
    settle-reader-* group), once `expected` results and a dead letter are there."""
    auditor = deployment.broker.client("auditor")
    topics = [deployment.names[t] for t in ("settlement-results", "capacity-releases", "branch-events-dlq")]
    deadline = time.monotonic() + timeout_s
    while True:
        kinds: dict[str, list] = {"SettlementResult": [], "CapacityReleased": [], "DeadLetter": []}
        for record in read_outputs({**auditor, "log_level": 0}, topics, idle_timeout_s=1.0):
            kinds.setdefault(record.kind, []).append(record)
        events = [r for r in kinds["SettlementResult"] if r.record["event_type"] != "Tick"]
        if (len(events) >= expected and kinds["DeadLetter"]) or time.monotonic() > deadline:
            return kinds
        time.sleep(0.5)


class Processor:
    def __init__(self, deployment: Deployment, state_dir: Path, log_path: Path) -> None:
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "branch_settlement.processors.cli.main", *deployment.run_args(state_dir),
             *deployment.as_("processor")], stdout=self.log, stderr=subprocess.STDOUT, env=os.environ, cwd=REPO)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_each_role_does_its_work_under_its_own_principal(deployment: Deployment, events: Path, tmp_path):
    """The producer publishes (half over SASL_SSL, half over its client certificate), the processor settles
    under the processor principal, the auditor reads the results, re-folds the topic (the replay agrees with
    the outputs and the live ledgers) and exports it; then the projection, deleted, is restored from the
    changelog (the restore consumer's group <group>-restore) and agrees again."""
    lines = events.read_text().splitlines(keepends=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(lines[:6]))
    second.write_text("".join(lines[6:]))
    sent = settle("produce", str(first), *deployment.as_("producer"), "--topic-prefix", deployment.prefix)
    assert sent.returncode == 0 and sent.stderr == "", sent.stdout + sent.stderr
    sent = settle("produce", str(second), *deployment.as_("producer", tls=True), "--topic-prefix", deployment.prefix)
    assert sent.returncode == 0 and sent.stderr == "", sent.stdout + sent.stderr
    # And one record that is no event: the processor's dead letter for it goes to the dead letter topic.
    assert _produce_refusals(deployment.broker.client("producer"), [deployment.names["branch-events"]]) == {
        deployment.names["branch-events"]: None}

    state = tmp_path / "state"
    processor = Processor(deployment, state, tmp_path / "run.log")
    try:
        outputs = _outputs(deployment, expected=len(lines))
    finally:
        code = processor.stop()
    assert code == 0, processor.output()
    assert "stopped cleanly" in processor.output()
    assert "AUTHORIZATION_FAILED" not in processor.output(), processor.output()
    ticks = [r for r in outputs["SettlementResult"] if r.record["event_type"] == "Tick"]
    results = [r for r in outputs["SettlementResult"] if r.record["event_type"] != "Tick"]
    releases = outputs["CapacityReleased"]
    # its own ticks, written to ledger-ticks under the processor's principal (no WRITE on the input)
    assert ticks and {r.record["result"] for r in ticks} == {"ok"}
    assert len(results) == len(lines) and {r.record["result"] for r in results} == {"ok", "duplicate"}
    assert releases and {r.record["parent_id"] for r in releases} == {"wf-42"}
    assert outputs["DeadLetter"], "the undecodable record has no dead letter"

    auditor = [*deployment.as_("auditor"), "--topic-prefix", deployment.prefix]
    replay = settle("replay", "--topic", "branch-events", *auditor, "--group-id", GROUP, "--state-dir", str(state))
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "AGREES" in replay.stdout and replay.stderr == ""
    export = settle("export", "-o", str(tmp_path / "events.avro"), *auditor)
    assert export.returncode == 0 and export.stderr == "", export.stdout + export.stderr
    replayed = int(replay.stdout.split("replayed ", 1)[1].split(" ", 1)[0].replace(",", ""))
    assert replayed >= len(lines) + 1 and f"exported {replayed} records" in export.stdout
    offline = settle("replay", str(tmp_path / "events.avro"))
    assert offline.returncode == 0, offline.stdout + offline.stderr
    story = settle("audit", "wf-42", "--topic", "branch-events", *auditor)
    assert story.returncode == 0 and story.stderr == "", story.stdout + story.stderr

    # The projection deleted: the next start restores it from the changelog, under the same principal.
    import shutil

    shutil.rmtree(state)
    restarted = Processor(deployment, state, tmp_path / "run2.log")
    try:
        _wait_for(lambda: "assigned partitions" in restarted.output() or restarted.proc.poll() is not None, 60,
                  "the restarted processor did not take its partitions")
    finally:
        code = restarted.stop()
    assert code == 0, restarted.output()
    restored = [line for line in restarted.output().splitlines() if "restored:" in line]
    assert any(" 0 changelog records" not in line for line in restored), restarted.output()
    again = settle("replay", "--topic", "branch-events", *auditor, "--group-id", GROUP, "--state-dir", str(state))
    assert again.returncode == 0 and "AGREES" in again.stdout, again.stdout + again.stderr


def _new_principal(deployment: Deployment, name: str, tmp_path: Path) -> dict:
    """A SCRAM user made by admin on the running broker (the script makes the first four), and its settings:
    those of the producer's file with its own name and password."""
    from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    password = uuid.uuid4().hex
    admin = AdminClient({**deployment.broker.client("admin"), "log_level": 0})
    upsert = UserScramCredentialUpsertion(name, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192),
                                          password.encode())
    for future in admin.alter_user_scram_credentials([upsert], request_timeout=30).values():
        future.result()
    config = {**deployment.broker.client("producer"), "sasl.username": name, "sasl.password": password}
    deadline = time.monotonic() + 30
    while True:  # the credential reaches the SASL listener asynchronously
        try:
            Consumer({**config, "group.id": "probe", "log_level": 0}).list_topics(timeout=5)
            return config
        except KafkaException:
            assert time.monotonic() < deadline, f"the new user {name} is not accepted"
            time.sleep(0.5)


def _metadata_refusal(config: dict, topic: str) -> str:
    """The broker's answer to a principal asking for a topic's metadata (DESCRIBE, which reading needs)."""
    consumer = Consumer({**config, "group.id": "metadata", "log_level": 0})
    try:
        found = consumer.list_topics(topic, timeout=15).topics[topic]
        return found.error.name() if found.error is not None else "no error"
    finally:
        consumer.close()


def _group_refusal(config: dict, topic: str, group: str) -> str:
    """The error of a consumer joining `group` (subscribing, as SettlementConsumer does)."""
    consumer = Consumer({**config, "group.id": group, "enable.auto.commit": False, "log_level": 0})
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for message in consumer.consume(10, 0.5):
                if message.error() and message.error().code() != KafkaError._PARTITION_EOF:
                    return message.error().name()
        return "no error"
    finally:
        consumer.close()


def test_a_downstream_consumer_and_a_result_waiter_with_their_roles_only(deployment: Deployment, events: Path,
                                                                         tmp_path):
    """The consumer role (User:consumer) reads the releases with SettlementConsumer in a group under its
    prefix and commits; the waiter role (User:waiter) waits for the results of what the producer published.
    The consumer writes nothing, reads neither the input nor the changelog, and joins no other group."""
    from branch_settlement.processors.kafka.acls import DEFAULT_CONSUMER_GROUP_PREFIX
    from branch_settlement.processors.kafka.clients import BranchEventProducer, ResultWaiter
    from branch_settlement.processors.kafka.consumers import CapacityReleased, SettlementConsumer
    from branch_settlement.schemas.codec import default_codec

    names = deployment.names
    consumer_config = {**_new_principal(deployment, "consumer", tmp_path), "log_level": 0}
    waiter_config = {**_new_principal(deployment, "waiter", tmp_path), "log_level": 0}
    parent = f"wf-{uuid.uuid4().hex[:8]}"
    codec = default_codec()
    batch = [codec.event_from_json(json.loads(line.replace("wf-42", parent)))
             for line in events.read_text().splitlines() if line.strip()]

    processor = Processor(deployment, tmp_path / "state", tmp_path / "run.log")
    try:
        with ResultWaiter(waiter_config, results_topic=names["settlement-results"]) as waiter:
            expected = waiter.expect(batch)
            producer = BranchEventProducer({**deployment.broker.client("producer"), "log_level": 0},
                                           names["branch-events"], codec)
            for event in batch:
                producer.publish(event)
            producer.flush(30)
            results = waiter.wait(expected, timeout_s=90)
        assert [r.event_id for r in results] == [e["event_id"] for e in batch]
    finally:
        assert processor.stop() == 0, processor.output()

    group = f"{DEFAULT_CONSUMER_GROUP_PREFIX}quota-{uuid.uuid4().hex[:6]}"
    consumer = SettlementConsumer(consumer_config, group_id=group, topics=[names["capacity-releases"]])
    mine: list = []
    try:
        deadline = time.monotonic() + 60
        while not mine and time.monotonic() < deadline:
            consumer.poll(lambda record: mine.append(record) if getattr(record, "parent_id", None) == parent
                          else None, timeout_s=1.0)
        assert mine and all(isinstance(r, CapacityReleased) for r in mine if r.kind == "CapacityReleased")
        committed = consumer.committed()
        assert committed and all(offset > 0 for offset in committed.values()), committed
    finally:
        consumer.close()

    # what it may not do: write anywhere, read the input or the changelog, use a group outside its prefix
    outcome = _produce_refusals(consumer_config, list(names.values()))
    assert outcome == {topic: "TOPIC_AUTHORIZATION_FAILED" for topic in names.values()}
    for topic in ("ledger-changelog", "branch-events", "ledger-ticks"):
        assert _metadata_refusal(consumer_config, names[topic]) == "TOPIC_AUTHORIZATION_FAILED", topic
    assert _group_refusal(consumer_config, names["capacity-releases"], "quota-service") == \
        "GROUP_AUTHORIZATION_FAILED"
    # the waiter only reads results
    assert _metadata_refusal(waiter_config, names["capacity-releases"]) == "TOPIC_AUTHORIZATION_FAILED"
    assert _metadata_refusal(waiter_config, names["settlement-results"]) == "no error"


# -- failures are one line, at once -------------------------------------------------------------------------


def _commands(deployment: Deployment, principal_of, tmp_path: Path, events: Path) -> dict[str, list[str]]:
    prefix = ["--topic-prefix", deployment.prefix]
    return {
        "topics": ["topics", "describe", *principal_of("admin"), *prefix],
        "acls": ["acls", "check", *principal_of("admin"), *prefix],
        "produce": ["produce", str(events), *principal_of("producer"), *prefix],
        "run": [*deployment.run_args(tmp_path / "state"), *principal_of("processor")],
        "replay": ["replay", "--topic", "branch-events", *principal_of("auditor"), *prefix],
        "export": ["export", "-o", str(tmp_path / "x.avro"), *principal_of("auditor"), *prefix],
        "audit": ["audit", "wf-42", "--topic", "branch-events", *principal_of("auditor"), *prefix],
    }


def _assert_one_line(done: subprocess.CompletedProcess, command: str, elapsed_s: float, *expected: str) -> None:
    assert done.returncode != 0, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"settle {command}"), done.stderr
    for text in expected:
        assert text in lines[0], done.stderr
    assert "Traceback" not in done.stderr and "%3|" not in done.stderr
    assert elapsed_s < FAST_FAILURE_S, f"{command} took {elapsed_s:.1f} s to fail"


COMMANDS = ("topics", "acls", "produce", "run", "replay", "export", "audit")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_wrong_password_is_one_line_at_once(deployment: Deployment, events: Path, tmp_path, command):
    commands = _commands(deployment, deployment.as_, tmp_path, events)
    started = time.monotonic()
    # The environment's password wins over the file's.
    done = settle(*commands[command], env={"SETTLE_KAFKA_SASL_PASSWORD": "not-the-password"})
    _assert_one_line(done, command, time.monotonic() - started, "refused the SASL credentials of user",
                     "invalid credentials")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_ca_file_is_one_line_at_once(deployment: Deployment, events: Path, tmp_path, command):
    missing = tmp_path / "no-such-ca.pem"
    commands = _commands(deployment, lambda p: [*deployment.as_(p), "--kafka-config", f"ssl.ca.location={missing}"],
                         tmp_path, events)
    started = time.monotonic()
    done = settle(*commands[command])
    _assert_one_line(done, command, time.monotonic() - started, f"ssl.ca.location {missing}: no such file")


@pytest.mark.parametrize("command", ("produce", "run", "replay"))
def test_a_ca_that_did_not_sign_the_broker_is_one_line_at_once(deployment: Deployment, events: Path, tmp_path, command):
    # A certificate that is no CA of the broker's: the producer's own.
    wrong = deployment.broker.run_dir / "tls" / "producer.crt"
    commands = _commands(deployment, lambda p: [*deployment.as_(p), "--kafka-config", f"ssl.ca.location={wrong}"],
                         tmp_path, events)
    started = time.monotonic()
    done = settle(*commands[command])
    _assert_one_line(done, command, time.monotonic() - started, "TLS handshake with", "not signed by the CA")


@pytest.mark.parametrize("command, principal, refusal", [
    ("run", "producer", "may not READ topic"),
    ("run", "auditor", "may not WRITE topic"),
    ("produce", "processor", "may not WRITE topic"),
    ("replay", "producer", "may not READ topic"),
    ("export", "processor", "may not READ topic"),
    ("audit", "producer", "may not READ topic"),
])
def test_a_role_without_the_acls_is_refused_before_it_starts(deployment: Deployment, events: Path, tmp_path, command,
                                                             principal, refusal):
    commands = _commands(deployment, lambda p: deployment.as_(principal), tmp_path, events)
    started = time.monotonic()
    done = settle(*commands[command])
    _assert_one_line(done, command, time.monotonic() - started, f"user '{principal}' {refusal}", "settle acls apply")


def test_the_processor_outside_its_group_is_refused_before_it_starts(deployment: Deployment, tmp_path):
    args = [*deployment.run_args(tmp_path / "state"), *deployment.as_("processor")]
    args[args.index(GROUP)] = "someone-elses-group"
    started = time.monotonic()
    done = settle(*args)
    _assert_one_line(done, "run", time.monotonic() - started,
                     "user 'processor' may not READ consumer group someone-elses-group")


def test_a_client_certificate_is_required_on_the_ssl_listener(deployment: Deployment, events: Path, tmp_path):
    ca = deployment.broker.run_dir / "tls" / "ca.pem"
    started = time.monotonic()
    done = settle("produce", str(events), "--bootstrap-servers", deployment.broker.bootstrap_tls,
                  "--kafka-config", "security.protocol=SSL", "--kafka-config", f"ssl.ca.location={ca}",
                  "--topic-prefix", deployment.prefix)
    _assert_one_line(done, "produce", time.monotonic() - started, "refused this client's TLS certificate")


def test_a_plaintext_client_on_a_tls_listener_is_told_so(deployment: Deployment, tmp_path):
    started = time.monotonic()
    done = settle("topics", "describe", "--bootstrap-servers", deployment.broker.bootstrap,
                  "--topic-prefix", deployment.prefix)
    _assert_one_line(done, "topics", time.monotonic() - started, "probably expects TLS")


def test_a_password_on_the_command_line_is_refused(deployment: Deployment, events: Path, tmp_path):
    password = (deployment.broker.run_dir / "secrets" / "producer.password").read_text().strip()
    done = settle("produce", str(events), *deployment.as_("producer"), "--kafka-config",
                  f"sasl.password={password}", "--topic-prefix", deployment.prefix)
    _assert_one_line(done, "produce", 0, "SETTLE_KAFKA_SASL_PASSWORD_FILE")
    assert password not in done.stderr


def test_the_password_from_its_own_file(deployment: Deployment, events: Path, tmp_path):
    """SETTLE_KAFKA_SASL_PASSWORD_FILE: the rest of the settings from the environment, the secret from a file."""
    client = deployment.broker.client("producer")
    env = {"SETTLE_BOOTSTRAP_SERVERS": deployment.broker.bootstrap, "SETTLE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
           "SETTLE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "SETTLE_KAFKA_SASL_USERNAME": "producer",
           "SETTLE_KAFKA_SSL_CA_LOCATION": client["ssl.ca.location"],
           "SETTLE_KAFKA_SASL_PASSWORD_FILE": str(deployment.broker.run_dir / "secrets" / "producer.password")}
    sent = settle("produce", str(events), "--topic-prefix", deployment.prefix, env=env)
    assert sent.returncode == 0 and sent.stderr == "", sent.stdout + sent.stderr
