"""The processor's configuration: one frozen object, built once at start-up.

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
        return self


HELP = {
    "bootstrap_servers": "Kafka brokers to bootstrap from",
    "group_id": "consumer group of the processors: one writer per partition within it",
    "topic_prefix": "prefix of every topic name (isolated environments, tests)",
    "topic_spec": "topic spec file (default: deploy/topics.json)",
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
}
_SETTINGS = [f for f in dataclasses.fields(ProcessorConfig) if f.name != "kafka"]


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML config file with these settings and a [kafka] table (env {CONFIG_FILE_ENV})")
    for f in _SETTINGS:
        if f.name == "bootstrap_servers":
            continue  # from add_connection_arguments
        default = {"worker_slot": "host name", "clock_file": "the system clock"}.get(f.name, f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), metavar=f.name.split("_")[-1].upper(),
                            help=f"{HELP[f.name]} (env {env_name(f.name)}; default: {default})")
    connection.add_connection_arguments(parser)


def _convert(name: str, value, kind) -> object:
    try:
        return int(value) if kind in (int, "int") else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None


def load(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> ProcessorConfig:
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    kafka: dict[str, str] = {}
    path = getattr(args, "config", None) or environ.get(CONFIG_FILE_ENV)
    if path:
        try:
            with open(path, "rb") as f:
                document = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"config file {path}: {err}") from None
        kafka.update({str(k): str(v) for k, v in document.pop("kafka", {}).items()})
        known = {f.name for f in _SETTINGS}
        unknown = sorted(set(document) - known)
        if unknown:
            raise ConfigError(f"config file {path}: unknown settings {', '.join(unknown)}")
        values.update(document)
    for f in _SETTINGS:
        if env_name(f.name) in environ:
            values[f.name] = environ[env_name(f.name)]
        flag = getattr(args, f.name, None) if args is not None else None
        if flag is not None:
            values[f.name] = flag
    kafka.update(connection.settings_from_args(args, environ))  # settings files < SETTLE_KAFKA_* < --kafka-config
    typed = {f.name: _convert(f.name, values[f.name], f.type) for f in _SETTINGS if f.name in values}
    return ProcessorConfig(kafka=kafka, **typed).validate()
