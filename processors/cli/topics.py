"""`settle topics apply|describe`: provision the topics of deploy/topics.json and show how the cluster compares.

Exit codes: 0 every topic present and as specified; 1 drift (or, for describe, a topic missing); 2 the cluster
could not be asked (unreachable, refused, bad settings or spec). Register with `add_parser(subparsers)`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from confluent_kafka.admin import AdminClient

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka import preflight, topics
from branch_settlement.processors.cli import arguments
from branch_settlement.processors.kafka.connection import config_from_args
from branch_settlement.processors.kafka.errors import KafkaFailure

EXIT_OK = 0
EXIT_DRIFT = 1
EXIT_UNAVAILABLE = 2

_APPLY_HELP = """\
Create every topic of the spec that the cluster lacks, with the spec's partitions and configs. Existing
topics are compared with the spec and never changed: a differing partition count, cleanup.policy,
retention or any other config the spec names is reported as drift (exit 1). Safe to run any number of
times. Exit 0: all topics present and as specified; 1: drift; 2: the cluster could not be reached or
refused a request."""

_DESCRIBE_HELP = """\
Show each topic of the spec next to what the cluster has (partitions and every config the spec names),
creating nothing. Exit 0: all present and as specified; 1: something missing or drifted; 2: the cluster
could not be reached."""


def add_parser(subparsers) -> None:
    """Register `topics` (with `apply` and `describe`) on the `settle` command's subparsers."""
    parser = subparsers.add_parser(
        "topics", help="create the Kafka topics from the spec, or compare the cluster with it",
        description="Topics as code: deploy/topics.json declares every topic (partitions, cleanup policy, "
                    "retention). See `settle topics apply --help`.")
    commands = parser.add_subparsers(dest="topics_command", metavar="SUBCOMMAND", required=True)
    apply_parser = commands.add_parser("apply", help="create missing topics, report drift",
                                       description=_APPLY_HELP)
    describe_parser = commands.add_parser("describe", help="compare the cluster with the spec, change nothing",
                                          description=_DESCRIBE_HELP)
    for sub, run in ((apply_parser, run_apply), (describe_parser, run_describe)):
        _add_arguments(sub)
        sub.set_defaults(run=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    arguments.add_kafka_command(parser)
    parser.add_argument("--spec", dest="topic_spec", help=argparse.SUPPRESS)  # its old name
    parser.add_argument(
        "--partitions", type=int, metavar="N",
        help="partitions of every topic that does not fix its own count (default: the spec's "
             "default_partitions). Choose once: it cannot change later without moving keys")
    parser.add_argument(
        "--replication-factor", type=int, default=topics.BROKER_DEFAULT_REPLICATION_FACTOR, metavar="N",
        help="replicas per partition for new topics, also checked on existing ones (default: the broker's "
             "default.replication.factor, not checked)")
    parser.add_argument(
        "--timeout-ms", type=int, default=15_000, metavar="MS",
        help="how long to wait for each request to the cluster (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_apply(args: argparse.Namespace) -> int:
    return _run(args, topics.apply)


def run_describe(args: argparse.Namespace) -> int:
    return _run(args, topics.check)


def _run(args: argparse.Namespace, action) -> int:
    where = f"settle topics {args.topics_command}"
    try:
        config = config_from_args(args)
        spec = topics.load_spec(args.topic_spec or None, prefix=args.topic_prefix, partitions=args.partitions,
                                replication_factor=args.replication_factor)
        # Connection, TLS and credentials first, within the timeout: one line that says what is wrong.
        preflight.check(config, timeout=args.timeout_ms / 1000)
    except (ConfigError, KafkaFailure) as err:
        print(f"{where}: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        reports = action(_admin(config), spec, timeout_s=args.timeout_ms / 1000)
    except ConfigError as err:
        print(f"{where}: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KafkaFailure as err:
        print(f"{where}: {err} [bootstrap servers: {config['bootstrap.servers']}]", file=sys.stderr)
        if err.code in ("_TRANSPORT", "_TIMED_OUT", "_ALL_BROKERS_DOWN"):
            print(f"{where}: is the broker running? Local broker: `make kafka-up`; another cluster: "
                  "--bootstrap-servers and its TLS/SASL settings via --kafka-config (docs/kafka.md)",
                  file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.json:
        print(json.dumps([_as_json(report) for report in reports], indent=2))
    else:
        _print_reports(reports, full=action is topics.check)
    healthy = {topics.STATUS_OK, topics.STATUS_CREATED}
    return EXIT_OK if all(report.status in healthy for report in reports) else EXIT_DRIFT


def _admin(config: dict[str, str]) -> AdminClient:
    # librdkafka would print every failed connection attempt on stderr; the one clear error message above
    # says it better. Its log goes to the `settle.librdkafka` logger, silent unless logging is configured.
    librdkafka_log = logging.getLogger("settle.librdkafka")
    if not librdkafka_log.handlers:
        librdkafka_log.addHandler(logging.NullHandler())
        librdkafka_log.propagate = False
    return AdminClient({**config, "logger": librdkafka_log})


def _print_reports(reports: list[topics.TopicReport], full: bool) -> None:
    """apply prints what it did and what is wrong; describe prints every topic."""
    for report in reports:
        if full or report.status != topics.STATUS_OK:
            print(f"{report.status:8} {report.spec.name}  (partitions {report.spec.partitions}, "
                  f"{_config_text(report.spec.config)})")
        if full and report.partitions_observed is not None:
            print(f"{'':8} cluster: partitions {report.partitions_observed}, "
                  f"{_config_text(report.config_observed)}")
        for problem in report.problems:
            print(f"{'':8} {problem}")
    counts = {}
    for report in reports:
        counts[report.status] = counts.get(report.status, 0) + 1
    print(f"{len(reports)} topics: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))


def _config_text(config) -> str:
    return " ".join(f"{key}={value}" for key, value in sorted(config.items())) or "broker defaults"


def _as_json(report: topics.TopicReport) -> dict:
    return {"topic": report.spec.name, "status": report.status, "partitions": report.spec.partitions,
            "config": dict(report.spec.config), "partitions_observed": report.partitions_observed,
            "config_observed": dict(report.config_observed), "problems": list(report.problems)}
