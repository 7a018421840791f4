"""The ACL set as code (deploy/acls.json) and the preflight's mapping of librdkafka failures, without a broker.
What each command needs (processors/cli/preflight.py) must be granted by its role, and no role may have more
than the least-privilege story says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from branch_settlement.processors.cli import preflight as command_needs
from branch_settlement.processors.crosscheck.readers import GROUP_ID as AUDIT_GROUP
from branch_settlement.processors.kafka import acls, preflight, topics
from branch_settlement.processors.kafka.errors import (AclSpecError, BrokerUnreachable, KafkaAuthenticationFailed,
                                                       KafkaFailure, KafkaNotAuthorized, KafkaSettingRejected,
                                                       KafkaTlsFailed)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PREFIX = "stage."
SPEC = topics.load_spec(prefix=PREFIX)
NAMES = SPEC.names()
DOCUMENT = json.loads(acls.DEFAULT_SPEC_PATH.read_text())


def resolved(**kwargs) -> acls.AclSet:
    return acls.resolve(DOCUMENT, SPEC, kwargs.pop("principals", None), group_id="grp", transactional_id_prefix="txn",
                        topic_prefix=PREFIX, **kwargs)


def grants(acl_set: acls.AclSet, role: str) -> dict[tuple[str, str, str], set[str]]:
    """(kind, name, pattern) -> operations, for one role."""
    table: dict[tuple[str, str, str], set[str]] = {}
    for acl in acl_set.of_role(role):
        table.setdefault((acl.kind, acl.name, acl.pattern), set()).add(acl.operation)
    return table


def test_the_producer_may_only_write_the_input():
    assert grants(resolved(), "producer") == {("topic", NAMES["branch-events"], "literal"): {"WRITE", "DESCRIBE"}}


def test_the_processor_reads_the_input_and_writes_everything_else_it_owns():
    table = grants(resolved(), "processor")
    topic = {name: ops for (kind, name, _), ops in table.items() if kind == "topic"}
    assert topic.pop(NAMES["branch-events"]) == {"READ", "DESCRIBE"}  # no WRITE: ledger time is its own ticks
    assert topic.pop(NAMES["ledger-changelog"]) == {"READ", "WRITE", "DESCRIBE"}
    assert topic == {NAMES[t]: {"WRITE", "DESCRIBE"} for t in ("ledger-ticks", "settlement-results", "capacity-releases",
                                                              "settlement-audit", "branch-events-dlq")}
    assert table[("group", "grp", "literal")] == {"READ", "DESCRIBE"}
    assert table[("group", "grp" + acls.RESTORE_GROUP_SUFFIX, "literal")] == {"DESCRIBE"}
    assert table[("transactional_id", f"{PREFIX}txn-", "prefixed")] == {"WRITE", "DESCRIBE"}
    assert len(table) == len(NAMES) + 3


def test_the_auditor_reads_every_topic_and_writes_nothing():
    table = grants(resolved(), "auditor")
    assert {name: ops for (kind, name, _), ops in table.items() if kind == "topic"} == {
        name: {"READ", "DESCRIBE"} for name in NAMES.values()}
    assert table[("group", AUDIT_GROUP, "literal")] == {"DESCRIBE"}
    assert table[("group", "settle-reader-", "prefixed")] == {"DESCRIBE"}
    assert table[("group", "grp", "literal")] == {"DESCRIBE"}  # the processors' committed offsets, read only
    assert not [acl for acl in resolved().of_role("auditor") if acl.operation != "DESCRIBE" and acl.kind != "topic"]
    assert {acl.operation for acl in resolved().of_role("auditor")} == {"READ", "DESCRIBE"}


def test_the_consumer_reads_releases_and_results_in_its_groups_and_writes_nothing():
    table = grants(resolved(), "consumer")
    assert table == {("topic", NAMES["capacity-releases"], "literal"): {"READ", "DESCRIBE"},
                     ("topic", NAMES["settlement-results"], "literal"): {"READ", "DESCRIBE"},
                     ("group", acls.DEFAULT_CONSUMER_GROUP_PREFIX, "prefixed"): {"READ", "DESCRIBE"}}
    custom = grants(resolved(consumer_group_prefix="quota-"), "consumer")
    assert custom[("group", "quota-", "prefixed")] == {"READ", "DESCRIBE"}


def test_the_consumer_apis_group_ids_are_the_ones_granted():
    """ResultWaiter's group.id is settle-result-waiter-<uuid> (clients.py); SettlementConsumer takes the
    service's own group_id, which the consumer role grants under its prefix."""
    source = (REPO / "processors" / "kafka" / "clients.py").read_text()
    waiter = grants(resolved(), "waiter")
    [(kind, prefix, pattern)] = [key for key in waiter if key[0] == "group"]
    assert (kind, pattern) == ("group", "prefixed") and f'"group.id": f"{prefix}{{uuid.uuid4()}}"' in source
    assert waiter[("group", prefix, "prefixed")] == {"DESCRIBE"}  # it assigns and commits nothing
    assert waiter[("topic", NAMES["settlement-results"], "literal")] == {"READ", "DESCRIBE"}
    assert len(waiter) == 2
    # the producer role itself stays write-only (a waiting orchestrator is given both roles)
    assert not [acl for acl in resolved().of_role("producer") if acl.operation == "READ"]


def test_the_processors_transactional_id_is_in_its_prefix():
    from branch_settlement.processors.kafka.config import ProcessorConfig

    config = ProcessorConfig(topic_prefix=PREFIX, transactional_id_prefix="txn", worker_slot="pod-3")
    prefix = next(acl.name for acl in resolved().of_role("processor") if acl.kind == "transactional_id")
    assert config.transactional_id.startswith(prefix)


def test_the_restore_consumers_group_is_the_one_granted():
    source = (REPO / "processors" / "kafka" / "restore.py").read_text()
    assert f'f"{{group_id}}{acls.RESTORE_GROUP_SUFFIX}"' in source


@pytest.mark.parametrize("role, needs", [
    ("processor", command_needs.processor_needs(NAMES, "grp")),
    ("producer", command_needs.producer_needs(NAMES)),
    ("auditor", command_needs.audit_replay_needs(NAMES, "grp")),
    ("auditor", command_needs.export_needs(NAMES)),
])
def test_each_commands_needs_are_granted_by_its_role(role, needs):
    table = grants(resolved(), role)
    literal = {(kind, name): ops for (kind, name, pattern), ops in table.items() if pattern == "literal"}
    for topic, operations in needs.topics.items():
        assert operations <= literal.get(("topic", topic), set()), (role, topic)
    for group, operations in needs.groups.items():
        assert operations <= literal.get(("group", group), set()), (role, group)
    assert not needs.cluster and needs.role == role


def test_no_role_has_a_cluster_acl_or_a_wildcard():
    for acl in resolved().acls:
        assert acl.kind in acls.RESOURCES and acl.name != "*" and acl.host == "*"
        assert acl.operation not in ("ALL", "ALTER", "ALTER_CONFIGS", "CREATE", "DELETE", "IDEMPOTENT_WRITE")


def test_principals_are_the_defaults_or_the_given_ones():
    assert resolved().principals == {"producer": ("User:producer",), "processor": ("User:processor",),
                                     "auditor": ("User:auditor",), "consumer": ("User:consumer",),
                                     "waiter": ("User:waiter",)}
    both = resolved(principals={"producer": ["User:orchestrator-a", "User:orchestrator-b"]})
    assert {acl.principal for acl in both.of_role("producer")} == {"User:orchestrator-a", "User:orchestrator-b"}
    assert len(both.of_role("producer")) == 4


@pytest.mark.parametrize("change, message", [
    (lambda d: d["roles"].update(janitor={"grants": []}), "unknown roles janitor"),
    (lambda d: d["roles"]["producer"]["grants"].append({"topic": "nope", "operations": ["READ"]}), "not in the topic spec"),
    (lambda d: d["roles"]["producer"]["grants"].append({"topic": "branch-events", "operations": ["FLY"]}), "operations"),
    (lambda d: d["roles"]["producer"]["grants"].append({"group": "{nope}", "operations": ["READ"]}), "unknown placeholder"),
    (lambda d: d["roles"]["producer"]["grants"].append({"group": "g", "topic": "branch-events", "operations": ["READ"]}),
     "exactly one"),
    (lambda d: d["roles"]["producer"].update(principal="producer"), "not TYPE:NAME"),
    (lambda d: d["roles"].pop("auditor"), "role auditor"),
])
def test_a_bad_spec_is_refused_with_the_reason(change, message):
    document = json.loads(json.dumps(DOCUMENT))
    change(document)
    with pytest.raises(AclSpecError, match=message):
        acls.resolve(document, SPEC)


def test_an_extra_acl_is_one_on_what_the_spec_covers():
    wanted = resolved()
    own = acls.Acl("User:producer", "topic", NAMES["ledger-changelog"], "literal", "WRITE")
    wide = acls.Acl("User:auditor", "topic", PREFIX, "prefixed", "ALL")
    star = acls.Acl("User:auditor", "topic", "*", "literal", "WRITE")
    cluster = acls.Acl("User:producer", "broker", "kafka-cluster", "literal", "IDEMPOTENT_WRITE")
    slot = acls.Acl("User:processor", "transactional_id", f"{PREFIX}txn-pod-1", "literal", "WRITE")
    elsewhere = acls.Acl("User:auditor", "topic", "other-deployment.branch-events", "literal", "WRITE")
    assert all(acls._covered(acl, wanted) for acl in (own, wide, star, cluster, slot))
    assert not acls._covered(elsewhere, wanted)


# -- the preflight's words -----------------------------------------------------------------------------------


@pytest.mark.parametrize("code, kind", [
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaNotAuthorized),
    (KafkaError.GROUP_AUTHORIZATION_FAILED, KafkaNotAuthorized),
    (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, KafkaNotAuthorized),
    (KafkaError._AUTHENTICATION, KafkaAuthenticationFailed),
    (KafkaError._SSL, KafkaTlsFailed),
    (KafkaError._INVALID_ARG, KafkaSettingRejected),
    (KafkaError._TRANSPORT, BrokerUnreachable),
    (KafkaError._ALL_BROKERS_DOWN, BrokerUnreachable),
    (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaFailure),
])
def test_librdkafka_failures_become_one_line_errors_of_their_kind(code, kind):
    error = preflight.kafka_error(KafkaException(KafkaError(code, "sasl_ssl://10.0.0.1:9093/1: it went wrong "
                                                                  "(after 12ms in state UP)")), "doing it",
                                  {"bootstrap.servers": "10.0.0.1:9093", "sasl.username": "u",
                                   "security.protocol": "SASL_SSL"})
    assert type(error) is kind and error.code == KafkaError(code).name()
    text = str(error)
    assert text.startswith("doing it: ") and "\n" not in text
    assert "sasl_ssl://" not in text and "after 12ms" not in text and "it went wrong" in text


def test_a_missing_or_unreadable_file_setting_is_named(tmp_path):
    with pytest.raises(KafkaSettingRejected, match=r"ssl.ca.location .*ca.pem: no such file"):
        preflight.check_local_files({"ssl.ca.location": str(tmp_path / "ca.pem")})
    with pytest.raises(KafkaSettingRejected, match=r"ssl.key.location .*: no such file"):
        preflight.check_local_files({"ssl.key.location": str(tmp_path / "k.pem")})
    preflight.check_local_files({"ssl.ca.location": "probe"})


def test_the_preflight_deadline_comes_from_the_environment():
    assert preflight.timeout_s({}) == preflight.DEFAULT_TIMEOUT_S
    assert preflight.timeout_s({preflight.TIMEOUT_ENV: "2500"}) == 2.5
    with pytest.raises(KafkaSettingRejected, match="milliseconds"):
        preflight.timeout_s({preflight.TIMEOUT_ENV: "soon"})


def _settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_acls_show_needs_no_broker():
    shown = _settle("acls", "show", "--topic-prefix", PREFIX, "--group-id", "grp", "--json")
    assert shown.returncode == 0, shown.stderr
    rows = json.loads(shown.stdout)
    assert len(rows) == len(resolved(principals=None).acls)
    assert {"role": "producer", "principal": "User:producer", "resource": "topic", "name": NAMES["branch-events"],
            "pattern": "literal", "operation": "WRITE", "host": "*", "permission": "ALLOW"} in rows


def test_a_password_flag_is_refused_by_every_kafka_command_before_any_request():
    for command in (["run"], ["produce", "x.jsonl"], ["replay", "--topic", "branch-events"], ["export", "-o", "x"],
                    ["topics", "apply"], ["acls", "check"], ["audit", "wf-42", "--topic", "branch-events"]):
        done = _settle(*command, "--bootstrap-servers", "127.0.0.1:1", "--kafka-config", "sasl.password=hunter2")
        assert done.returncode != 0, command
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "secret on the command line" in lines[0] and "hunter2" not in lines[0], done.stderr


def test_the_command_line_does_not_depend_on_the_acl_spec(monkeypatch, tmp_path) -> None:
    """Only `settle acls` reads the ACL spec: without one every other command (and --help) still works."""
    from branch_settlement.processors.cli import main as cli_main
    from branch_settlement.processors.kafka import acls as acls_mod

    monkeypatch.setattr(acls_mod, "DEFAULT_SPEC_PATH", tmp_path / "missing.json")
    events = tmp_path / "events.jsonl"
    events.write_text('{"type": "Tick", "event_id": "t", "idempotency_key": "tick/0/5", "parent_id": "", '
                      '"occurred_at_ms": 0, "now_ms": 5}\n')
    assert cli_main.main(["replay", "--json", str(events)]) == 0
    assert cli_main.main(["acls", "show"]) == 2  # the one command that needs it says so (an error)
