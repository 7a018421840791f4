"""`settle run`, `settle produce`, `settle inspect`: the Kafka-facing commands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from branch_settlement.errors import SettlementError
from branch_settlement.processors.kafka import config as cfg
from branch_settlement.processors.cli import arguments
from branch_settlement.processors.kafka import connection, topics

log = logging.getLogger("settle")


def topic_names(prefix: str, spec_path: str = "") -> dict[str, str]:
    """Logical topic name -> physical name, from the topic spec."""
    spec = topics.load_spec(spec_path or None, prefix=prefix)
    return {t.logical_name: t.name for t in spec.topics}


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# -- settle run --------------------------------------------------------------------------------------------


def add_run(commands) -> None:
    p = commands.add_parser(
        "run", help="the exactly-once settlement processor",
        description="Consume branch-events as a member of the consumer group, fold each owned partition into "
                    "its RocksDB ledger, and publish results, releases, audit records and dead letters exactly "
                    "once (Kafka transactions with the input offsets). SIGTERM or Ctrl-C drains: the last "
                    "checkpoint is committed before exit.")
    cfg.add_arguments(p)
    p.set_defaults(run=_run, before_preflight=DRAIN.install)


class Drain:
    """SIGTERM or SIGINT asks `settle run` to drain. Installed before the preflight (main.py), so that a signal
    at any point of the start-up (preflight, restore, joining the group) stops the processor cleanly too:
    nothing is folded after it, and what was folded is committed before exit."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self, _args: argparse.Namespace | None = None) -> None:
        signal.signal(signal.SIGTERM, self._received)
        signal.signal(signal.SIGINT, self._received)

    def _received(self, signum, _frame) -> None:
        self.signal = signum
        log.info("received %s: draining", signal.Signals(signum).name)

    def requested(self) -> bool:
        return self.signal is not None


DRAIN = Drain()


def _run(args: argparse.Namespace) -> int:
    from branch_settlement.processors.kafka import wire
    from branch_settlement.processors.kafka.processor import Processor
    from branch_settlement.processors.kafka.ticks import FileClock

    DRAIN.install()  # already, when main() ran the preflight; again for callers of _run itself
    config = cfg.load(args)
    setup_logging(config.log_level)
    names = topic_names(config.topic_prefix, config.topic_spec)
    log.info("settle run: bootstrap %s, group %s, transactional.id %s, state %s", config.bootstrap_servers,
             config.group_id, config.transactional_id, os.path.abspath(config.state_dir))
    if DRAIN.requested():
        log.info("stopped before starting: %s received during start-up", signal.Signals(DRAIN.signal).name)
        return 0
    clock = FileClock(config.clock_file) if config.clock_file else time.time
    codec = wire.codec_for(config, writes=True)  # registers the schemas first when writing Confluent frames
    Processor(config, names, codec=codec, clock=clock).run(DRAIN.requested)
    log.info("stopped cleanly")
    return 0


# -- settle produce ----------------------------------------------------------------------------------------


def add_produce(commands) -> None:
    p = commands.add_parser(
        "produce", help="publish a JSON Lines file of events to branch-events",
        description="Publish events in their JSON form (`settle contract`, \"Events in\"), one per line, as an orchestrator's adapter "
                    "would: validated, Avro single-object encoded (or Confluent frames: --wire-format), keyed by parent_id (Kafka's murmur2 "
                    "partitioner), idempotent producer. Lines that are not valid events, and Tick lines (only "
                    "the processor advances ledger time), are reported with their line number and not sent; "
                    "the exit code is then 1.")
    p.add_argument("file", help="JSON Lines file of events; - for standard input")
    arguments.add_kafka_command(p)
    arguments.add_wire_format(p)
    arguments.add_progress(p)
    p.add_argument("--json", action="store_true",
                   help="print what was published as JSON (topic, partitions, published, not_sent: line and reason)")
    p.set_defaults(run=_produce)


def _produce(args: argparse.Namespace) -> int:
    from branch_settlement.processors.cli.inputs import input_file

    with input_file(args.file) as path:
        return _produce_path(args, path)


def _produce_path(args: argparse.Namespace, path: str) -> int:
    from branch_settlement.processors.crosscheck.progress import Progress, count_lines
    from branch_settlement.processors.kafka.clients import TICK_NOT_PRODUCIBLE, BranchEventProducer
    from branch_settlement.processors.ledger.validation import validate
    from branch_settlement.processors.kafka import wire
    from branch_settlement.processors.replay.replayer import read_jsonl

    codec = wire.codec_for(args, writes=True)
    producer = BranchEventProducer(connection.config_from_args(args),
                                   topic_names(args.topic_prefix, args.topic_spec)["branch-events"], codec)
    partitions = producer.partitions()
    sent, rejected = 0, 0
    refused: list[dict] = []
    # the file's lines, as far as read (events sent and lines refused), on stderr
    with Progress(count_lines(path), unit="lines", verb="sent", mode=args.progress) as progress:
        for item in read_jsonl(path, codec):
            if (sent + rejected) % 1000 == 0:
                progress.update(item.line - 1)
            # Refused here what the processor would refuse (the fold's own validation): an orchestrator learns it now.
            reason = item.reason if item.event is None else validate(item.event)
            if reason is None and item.event["type"] == "Tick":
                reason = TICK_NOT_PRODUCIBLE
            if reason is not None:
                rejected += 1
                refused.append({"line": item.line, "reason": reason})
                progress.write(f"line {item.line}: not sent: {reason}")
                continue
            producer.publish(item.event)
            sent += 1
        producer.flush()
        progress.complete()
    if args.json:
        print(json.dumps({"topic": producer.topic, "partitions": len(partitions), "published": sent,
                          "not_sent": refused}, indent=2))
        return 1 if rejected else 0
    print(f"published {sent} events to {producer.topic} ({len(partitions)} partitions)"
          + (f"; {rejected} lines not sent" if rejected else ""))
    return 1 if rejected else 0


# -- settle inspect ----------------------------------------------------------------------------------------


def add_inspect(commands) -> None:
    p = commands.add_parser(
        "inspect", help="one parent's balances and children, from the processor's projection",
        description="Read one parent's ledger from the RocksDB projections under --state-dir (read-only: safe "
                    "while the processor runs; shows what it has committed).")
    p.add_argument("parent_id")
    arguments.add_config(p)
    arguments.add_state_dir(p, "the processor's state directory")
    arguments.add_group(p, "the processor's consumer group")
    p.add_argument("--json", action="store_true", help="print the parent and its children as JSON")
    p.set_defaults(run=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    from branch_settlement.processors.cli.tables import table
    from branch_settlement.processors.kafka.partition import group_dir, stored_partitions
    from branch_settlement.processors.replay.report import balance_table
    from branch_settlement.projections import keys
    from branch_settlement.projections.store import RocksStore
    from branch_settlement.schemas.codec import default_codec

    codec = default_codec()
    for path in stored_partitions(args.state_dir, args.group_id).values():
        store = RocksStore(path, read_only=True)
        try:
            raw = store.get(keys.parent_key(args.parent_id))
            if raw is None:
                continue
            parent = codec.decode(raw)[1]
            children = [codec.decode(store.get(keys.child_key(args.parent_id, c)))[1] for c in parent["children"]]
        finally:
            store.close()
        if args.json:
            print(json.dumps({"parent": parent, "children": children}, indent=2))
            return 0
        print(f"parent {args.parent_id} ({parent['status']}) in {path.name}, "
              f"{parent['live_children']} live of at most {parent['max_live_children']}")
        print("\n".join(balance_table(parent["dimensions"])))
        print("\nchildren")
        quantities = lambda q: ", ".join(f"{dim} {n}" for dim, n in sorted(q.items())) or "none"
        rows = [(child["child_id"], child["state"], child["attempt_id"], child["lease_generation"],
                 quantities(child["reserved"]), quantities(child["consumed"])) for child in children]
        print("\n".join(table(("child", "state", "attempt", "generation", "reserved", "consumed"), rows)))
        if parent.get("loans"):
            print("\nloans (capacity lent to other workloads)")
            rows = [(loan["loan_id"], loan["borrower"], loan["state"], quantities(loan["quantities"]),
                     "yes" if loan["revocation_requested"] else "no", quantities(loan["usage"]))
                    for loan in parent["loans"]]
            print("\n".join(table(("loan", "borrower", "state", "lent", "asked back", "used"), rows)))
        return 0
    raise SettlementError(f"parent {args.parent_id!r} is in none of the projections under "
                          f"{group_dir(args.state_dir, args.group_id)}")
