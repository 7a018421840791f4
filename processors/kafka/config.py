"""The processor's configuration: one frozen object, built once at start-up; and the one config file format
of a deployment, which every command reads (`read_file`, `resolve_arguments`): `settle run` all of it, the
others the settings they have flags for (topic_prefix, topic_spec, group_id, state_dir, bootstrap_servers,
the [kafka] table, ...), ignoring the rest.

Precedence, lowest first: defaults < config file (TOML, `--config FILE` or SETTLE_CONFIG) < environment
(SETTLE_<SETTING>, e.g. SETTLE_COMMIT_INTERVAL_MS) < flags (--commit-interval-ms). librdkafka settings pass
through untouched: a `[kafka]` table in the file, SETTLE_KAFKA_<SETTING> variables, --kafka-config KEY=VALUE.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import tomllib
from dataclasses import dataclass, field
from typing import Mapping

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka import connection

CONFIG_FILE_ENV = "SETTLE_CONFIG"
ENV_PREFIX = "SETTLE_"


CLIENT_LOG = logging.getLogger("settle.client")


def _default_worker_slot() -> str:
    return socket.gethostname()


@dataclass(frozen=True)
class ProcessorConfig:
    bootstrap_servers: str = connection.DEFAULT_BOOTSTRAP_SERVERS
    group_id: str = "branch-settlement"
    topic_prefix: str = ""
    topic_spec: str = ""
    state_dir: str = ".run/state"
    # A stable id per worker slot (host name, pod ordinal): a restarted worker fences its predecessor at once.
    worker_slot: str = field(default_factory=_default_worker_slot)
    transactional_id_prefix: str = "branch-settlement"
    commit_interval_ms: int = 100
    commit_events: int = 2_000
    # Records buffered (outputs and ledger changes): a burst of expiries commits in slices, not in one huge transaction.
    commit_records: int = 20_000
    # Ticks folded into each owned partition (SPEC §7) and written to ledger-ticks; 0 turns them off.
    tick_interval_ms: int = 1_000
    # Ledger time from this file (milliseconds since the epoch, rewritten by a simulation or a demo) instead of
    # the system clock.
    clock_file: str = ""
    session_timeout_ms: int = 10_000
    max_poll_interval_ms: int = 60_000
    transaction_timeout_ms: int = 30_000
    metrics_port: int = 0
    # Decoded ledger records kept in memory by the whole process, every partition together, in MB as estimated
    # from their encoded size (RocksDB holds the rest): what bounds the processor's memory whatever the size of
    # the ledger, and whatever one checkpoint touches.
    view_cache_mb: int = 96
    log_level: str = "INFO"
    # The framing of the records others read and write (docs/wire-formats.md): the single-object encoding, or
    # the Confluent wire format with ids from a Schema Registry (registered and checked at start-up).
    wire_format: str = "single-object"
    schema_registry_url: str = ""
    schema_registry_ca_location: str = ""
    schema_registry_username: str = ""
    schema_registry_password_file: str = ""
    kafka: Mapping[str, str] = field(default_factory=dict)

    @property
    def transactional_id(self) -> str:
        # Scoped by the topic prefix like everything else of an environment: two environments on one cluster
        # (or two test runs) with the same worker slot must not fence each other's producers.
        return f"{self.topic_prefix}{self.transactional_id_prefix}-{self.worker_slot}"

    def client_config(self) -> dict:
        """The processor's clients' settings; librdkafka's own log lines go through the processor's logging
        (logger settle.client: its format, its level) instead of raw to stderr."""
        return {**connection.client_config(self.bootstrap_servers, self.kafka), "logger": CLIENT_LOG}

    def validate(self) -> "ProcessorConfig":
        for name in ("commit_interval_ms", "commit_events", "commit_records", "session_timeout_ms",
                     "max_poll_interval_ms", "transaction_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("tick_interval_ms", "metrics_port", "view_cache_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.worker_slot or not self.group_id:
            raise ConfigError("worker_slot and group_id must not be empty")
        check_wire_format(self.wire_format, self.schema_registry_url)
        return self


WIRE_FORMATS = ("single-object", "confluent")


def check_wire_format(wire_format: str, schema_registry_url: str) -> None:
    if wire_format not in WIRE_FORMATS:
        raise ConfigError(f"wire_format must be one of {', '.join(WIRE_FORMATS)}, got {wire_format!r}")
    if wire_format == "confluent" and not schema_registry_url:
        raise ConfigError("wire_format confluent needs a schema_registry_url (--schema-registry-url): the schema "
                          "ids come from the registry")


HELP = {
    "bootstrap_servers": "Kafka brokers to bootstrap from",
    "group_id": "consumer group of the processors: one writer per partition within it",
    "topic_prefix": "prefix of every topic name (isolated environments, tests)",
    "topic_spec": "topic spec file",
    "state_dir": "directory of the RocksDB projections, one per input partition",
    "worker_slot": "stable id of this worker slot (host name, pod ordinal); part of transactional.id",
    "transactional_id_prefix": "transactional.id = TOPIC_PREFIX + PREFIX-WORKER_SLOT",
    "commit_records": "checkpoint once this many records (outputs and ledger changes) are buffered, right after "
                      "the event that buffered them (bounds a transaction and its memory)",
    "commit_interval_ms": "checkpoint (commit the transaction) at least this often while events flow",
    "view_cache_mb": "MB of decoded ledger records cached by the whole process, all partitions together "
                     "(estimated from their encoded size; bounds memory, RocksDB holds the rest)",
    "commit_events": "checkpoint after this many events, whatever the interval",
    "tick_interval_ms": "fold a Tick into each owned partition this often (written to ledger-ticks: only the "
                        "processor advances ledger time); 0 = never",
    "clock_file": "take the time for ticks from this file (milliseconds since the epoch; write it atomically, "
                  "e.g. by rename) instead of the system clock: for simulations and demos. Whoever can write "
                  "it sets ledger time",
    "session_timeout_ms": "consumer group session timeout",
    "max_poll_interval_ms": "consumer max.poll.interval.ms",
    "transaction_timeout_ms": "producer transaction.timeout.ms",
    "metrics_port": "serve Prometheus metrics on this port; 0 = off",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "wire_format": "framing of the events and outputs written: single-object (Avro single-object encoding) or "
                   "confluent (Confluent wire format, schema ids from --schema-registry-url); both are read",
    "schema_registry_url": "Schema Registry (Confluent-compatible REST API, e.g. http://registry:8081) whose ids "
                           "the Confluent frames carry; or file:PATH, a registry snapshot (JSON); needed to read "
                           "Confluent frames and to write them",
    "schema_registry_ca_location": "CA file to verify an https Schema Registry",
    "schema_registry_username": "user name for the Schema Registry's HTTP basic auth",
    "schema_registry_password_file": "file holding the password for the Schema Registry's basic auth",
}
_SETTINGS = [f for f in dataclasses.fields(ProcessorConfig) if f.name != "kafka"]


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """--config FILE: the one TOML file of a deployment, read by every command (`read_file`)."""
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML config file of the deployment: these settings (those of `settle run --help`, "
                             f"as snake_case keys) and a [kafka] table of librdkafka settings (env {CONFIG_FILE_ENV}); "
                             "below the environment and the flags")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser)
    for f in _SETTINGS:
        if f.name == "bootstrap_servers":
            continue  # from add_connection_arguments
        default = {"worker_slot": "host name", "clock_file": "the system clock", "topic_prefix": "none",
                   "topic_spec": "deploy/topics.json, installed with the package"}.get(f.name, f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), metavar=f.name.split("_")[-1].upper(),
                            help=f"{HELP[f.name]} (env {env_name(f.name)}; default: {default})")
    connection.add_connection_arguments(parser)


def setting_help(name: str, text: str | None = None) -> str:
    """A shared setting's help for a command other than `settle run`: what it is, where else it comes from."""
    default = {"topic_spec": "deploy/topics.json, installed with the package"}.get(
        name, {f.name: f.default for f in _SETTINGS}[name])
    return (f"{text or HELP[name]} (env {env_name(name)}; config file key {name}; "
            f"default: {default if default != '' else 'none'})")


def _convert(name: str, value, kind) -> object:
    try:
        return int(value) if kind in (int, "int") else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None


def config_path(args: argparse.Namespace | None, environ: Mapping[str, str]) -> str | None:
    return getattr(args, "config", None) or environ.get(CONFIG_FILE_ENV) or None


def read_file(path: str) -> tuple[dict[str, object], dict[str, str]]:
    """The settings of a config file and its [kafka] table: the one reader of the format, for every command.
    An unreadable file, bad TOML or an unknown key is a ConfigError (one line)."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot read it: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path}: not valid TOML: {err}") from None
    kafka = document.pop("kafka", {})
    if not isinstance(kafka, dict):
        raise ConfigError(f"config file {path}: kafka must be a table of librdkafka settings ([kafka])")
    unknown = sorted(set(document) - {f.name for f in _SETTINGS})
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {', '.join(unknown)} (known: "
                          f"{', '.join(f.name for f in _SETTINGS)} and a [kafka] table)")
    tables = sorted(k for k, v in document.items() if isinstance(v, dict))
    if tables:
        raise ConfigError(f"config file {path}: {', '.join(tables)} must be a value, not a table")
    for key in kafka:
        connection.check_setting_name(str(key), source=f"config file {path}, [kafka] {key}")
    return document, {str(k): _kafka_value(v) for k, v in kafka.items()}


def _kafka_value(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def file_settings(args: argparse.Namespace | None, environ: Mapping[str, str] | None = None
                  ) -> tuple[dict[str, object], dict[str, str]]:
    """The config file's settings and [kafka] table (`--config` or SETTLE_CONFIG), or two empty dicts."""
    path = config_path(args, os.environ if environ is None else environ)
    return read_file(path) if path else ({}, {})


def resolve_arguments(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Fill in every setting of the file format that a command has a flag for and was not given: from
    SETTLE_<SETTING>, else the config file, else the default (defaults < file < environment < flags, as for
    `settle run`). bootstrap_servers and the librdkafka settings are resolved where the client config is made
    (connection.config_from_args). The file is read (and an unknown key refused) whenever one is named."""
    environ = os.environ if environ is None else environ
    values, _ = file_settings(args, environ)
    for f in _SETTINGS:
        if f.name == "bootstrap_servers" or not hasattr(args, f.name) or getattr(args, f.name) is not None:
            continue
        if env_name(f.name) in environ:
            value = environ[env_name(f.name)]
        elif f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()
        setattr(args, f.name, _convert(f.name, value, f.type))
    return args


def load(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> ProcessorConfig:
    environ = os.environ if environ is None else environ
    values, _ = file_settings(args, environ)
    for f in _SETTINGS:
        if env_name(f.name) in environ:
            values[f.name] = environ[env_name(f.name)]
        flag = getattr(args, f.name, None) if args is not None else None
        if flag is not None:
            values[f.name] = flag
    # the file's [kafka] table < settings files < SETTLE_KAFKA_* < --kafka-config
    kafka = connection.settings_from_args(args, environ)
    typed = {f.name: _convert(f.name, values[f.name], f.type) for f in _SETTINGS if f.name in values}
    return ProcessorConfig(kafka=kafka, **typed).validate()
