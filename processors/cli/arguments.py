"""The flags several commands share, defined once: a command adds a group with one line, and a new group
(e.g. the Schema Registry's) is one function here and one line per command.

Every setting named here is a setting of the deployment's config file (processors/kafka/config.py): its flag
defaults to None and `settle` fills it in after parsing (main.py, config.resolve_arguments), so that the
precedence is the same for every command: defaults < config file (--config, SETTLE_CONFIG) < environment
(SETTLE_<SETTING>) < flags.
"""

from __future__ import annotations

import argparse

from branch_settlement.processors.kafka import config as cfg
from branch_settlement.processors.kafka import connection


def add_config(parser: argparse.ArgumentParser) -> None:
    """--config FILE: the deployment's TOML file, the same for every command."""
    cfg.add_config_argument(parser)


def add_kafka(parser: argparse.ArgumentParser) -> None:
    """A command that talks to Kafka: --config, --bootstrap-servers, --kafka-config, --kafka-config-file."""
    add_config(parser)
    connection.add_connection_arguments(parser)


def add_topic_names(parser: argparse.ArgumentParser) -> None:
    """--topic-prefix and --topic-spec: which topics, by the spec's logical names."""
    parser.add_argument("--topic-prefix", metavar="PREFIX", help=cfg.setting_help("topic_prefix"))
    parser.add_argument("--topic-spec", metavar="FILE", help=cfg.setting_help("topic_spec"))


def add_group(parser: argparse.ArgumentParser, text: str | None = None) -> None:
    """--group-id: the processors' consumer group."""
    parser.add_argument("--group-id", metavar="GROUP", help=cfg.setting_help("group_id", text))


def add_state_dir(parser: argparse.ArgumentParser, text: str | None = None) -> None:
    parser.add_argument("--state-dir", metavar="DIR", help=cfg.setting_help("state_dir", text))


def add_kafka_command(parser: argparse.ArgumentParser) -> None:
    """What every command reading or writing the project's topics has: the config file, the connection, the
    topic names."""
    add_kafka(parser)
    add_topic_names(parser)


def add_wire_format(parser: argparse.ArgumentParser) -> None:
    """--wire-format and the Schema Registry's settings (docs/wire-formats.md): a command that reads or writes
    events or outputs."""
    group = parser.add_argument_group("wire format (docs/wire-formats.md)")
    group.add_argument("--wire-format", choices=cfg.WIRE_FORMATS, help=cfg.setting_help("wire_format"))
    group.add_argument("--schema-registry-url", metavar="URL", help=cfg.setting_help("schema_registry_url"))
    group.add_argument("--schema-registry-ca-location", metavar="FILE",
                       help=cfg.setting_help("schema_registry_ca_location"))
    group.add_argument("--schema-registry-username", metavar="USER", help=cfg.setting_help("schema_registry_username"))
    group.add_argument("--schema-registry-password-file", metavar="FILE",
                       help=cfg.setting_help("schema_registry_password_file"))


__all__ = ["add_config", "add_kafka", "add_topic_names", "add_group", "add_state_dir", "add_kafka_command",
           "add_progress", "add_wire_format"]


def add_progress(parser: argparse.ArgumentParser) -> None:
    """--progress / --no-progress: the long commands' progress on stderr (processors/crosscheck/progress.py)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--progress", dest="progress", action="store_const", const="bar", default="auto",
                       help="show a progress bar on stderr even when it is not a terminal (default: a bar on a "
                            "terminal; elsewhere a plain line every few seconds)")
    group.add_argument("--no-progress", dest="progress", action="store_const", const="off",
                       help="show no progress at all")
