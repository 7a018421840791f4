"""What each Kafka command needs of the cluster, checked before it starts (processors/kafka/preflight.py).

`settle` runs the preflight of the command it was given before the command itself (main.py: each Kafka
command's parser has a `preflight` default): the brokers must answer within the deadline, over TLS they
trust and that trusts them, with credentials they accept, and the principal must be allowed every
operation the command performs on its topics and groups. A wrong password, a missing CA file or a missing
ACL is one line and exit 2 instead of a command that retries for ever or fails half way.

The operations are the commands' own (what their clients do), not a role's: deploy/acls.json grants each
role at least these (tests/kafka/test_acls_unit.py holds the two together).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from branch_settlement.processors.crosscheck.readers import GROUP_ID as AUDIT_READER_GROUP
from branch_settlement.processors.kafka import connection, preflight, topics
from branch_settlement.processors.kafka.acls import RESTORE_GROUP_SUFFIX
from branch_settlement.processors.ledger.outputs import OUTPUT_TOPICS
from branch_settlement.processors.kafka.ticks import TICKS_TOPIC

# AUDIT_READER_GROUP: the group.id of the topic replay's and the export's readers. They assign partitions and
# commit nothing, so the coordinator lookup (DESCRIBE) is all they do with it.


def _names(prefix: str, spec_path: str) -> dict[str, str]:
    return topics.load_spec(spec_path or None, prefix=prefix).names()


def processor_needs(names: Mapping[str, str], group_id: str) -> preflight.Needs:
    """settle run: consumes the input, restores from and writes its changelog, writes its ticks and the
    outputs; its group commits offsets in the transaction; the restore consumer only assigns."""
    needed = {names["branch-events"]: frozenset({"READ"}),
              names["ledger-changelog"]: frozenset({"READ", "WRITE"})}
    for logical in (*OUTPUT_TOPICS, TICKS_TOPIC):
        if logical in names:
            needed[names[logical]] = frozenset({"WRITE"})
    groups = {group_id: frozenset({"READ"}), f"{group_id}{RESTORE_GROUP_SUFFIX}": frozenset({"DESCRIBE"})}
    return preflight.Needs(topics=needed, groups=groups, role="processor")


def producer_needs(names: Mapping[str, str]) -> preflight.Needs:
    """settle produce: writes the input (idempotent: WRITE is enough since KIP-679) and reads its metadata."""
    return preflight.Needs(topics={names["branch-events"]: frozenset({"WRITE", "DESCRIBE"})}, role="producer")


def audit_replay_needs(names: Mapping[str, str], group_id: str = "branch-settlement") -> preflight.Needs:
    """settle replay --topic: reads the input, the ticks and every output, with the readers' group, and the
    offsets the processors' group (`group_id`) committed, to tell their lag from missing outputs (OffsetFetch:
    DESCRIBE on that group; it neither joins nor commits)."""
    needed = {names[logical]: frozenset({"READ"})
              for logical in ("branch-events", TICKS_TOPIC, *OUTPUT_TOPICS) if logical in names}
    groups = {AUDIT_READER_GROUP: frozenset({"DESCRIBE"}), group_id: frozenset({"DESCRIBE"})}
    return preflight.Needs(topics=needed, groups=groups, role="auditor")


def export_needs(names: Mapping[str, str]) -> preflight.Needs:
    """settle export and settle audit --topic: read the input and the ticks, with the readers' group."""
    needed = {names[logical]: frozenset({"READ"}) for logical in ("branch-events", TICKS_TOPIC) if logical in names}
    return preflight.Needs(topics=needed, groups={AUDIT_READER_GROUP: frozenset({"DESCRIBE"})}, role="auditor")


# -- one function per command, given its parsed arguments ---------------------------------------------------


def run(args: argparse.Namespace) -> None:
    from branch_settlement.processors.cli.kafka_commands import DRAIN
    from branch_settlement.processors.kafka import config as cfg

    config = cfg.load(args)
    names = _names(config.topic_prefix, config.topic_spec)
    preflight.check(config.client_config(), processor_needs(names, config.group_id), should_stop=DRAIN.requested)


def produce(args: argparse.Namespace) -> None:
    preflight.check(connection.config_from_args(args), producer_needs(_names(args.topic_prefix, args.topic_spec)))


def replay(args: argparse.Namespace) -> None:
    if not getattr(args, "topic", None) or getattr(args, "file", None):
        return  # a file replay asks no broker; a wrong combination is the command's to refuse
    preflight.check(connection.config_from_args(args),
                    audit_replay_needs(_names(args.topic_prefix, args.topic_spec), args.group_id))


def export(args: argparse.Namespace) -> None:
    preflight.check(connection.config_from_args(args), export_needs(_names(args.topic_prefix, args.topic_spec)))


def audit(args: argparse.Namespace) -> None:
    if not getattr(args, "topic", None) or getattr(args, "file", None):
        return  # a parent's history from a file asks no broker
    names = _names(args.topic_prefix, args.topic_spec)
    preflight.check(connection.config_from_args(args), export_needs(names))  # the input and its ticks, read


# command name -> its preflight (main.py sets it as the command parser's `preflight` default)
BY_COMMAND = {"run": run, "produce": produce, "replay": replay, "export": export, "audit": audit}
