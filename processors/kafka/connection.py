"""librdkafka client settings: bootstrap servers plus settings passed through untouched (TLS, SASL, ...).

Precedence, lowest first: defaults < environment (SETTLE_BOOTSTRAP_SERVERS, SETTLE_KAFKA_<SETTING>) < flags
(--bootstrap-servers, --kafka-config KEY=VALUE). Setting names are librdkafka's own
(https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md); nothing here interprets them, so
every security mechanism librdkafka supports works without code changes.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping

from branch_settlement.errors import ConfigError

DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
BOOTSTRAP_SERVERS_ENV = "SETTLE_BOOTSTRAP_SERVERS"
# SETTLE_KAFKA_SECURITY_PROTOCOL=SASL_SSL becomes security.protocol=SASL_SSL. librdkafka names use dots,
# which environment variable names cannot hold; a name that needs an underscore goes through --kafka-config.
SETTING_ENV_PREFIX = "SETTLE_KAFKA_"
# One way to name the cluster: a pass-through bootstrap.servers would silently compete with the flag.
_RESERVED_SETTINGS = frozenset({"bootstrap.servers", "metadata.broker.list"})


def settings_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """librdkafka settings from SETTLE_KAFKA_<SETTING> variables, e.g. SETTLE_KAFKA_SASL_MECHANISM."""
    settings = {}
    for name, value in environ.items():
        if name.startswith(SETTING_ENV_PREFIX) and len(name) > len(SETTING_ENV_PREFIX):
            key = name[len(SETTING_ENV_PREFIX):].lower().replace("_", ".")
            settings[_checked_key(key, source=name)] = value
    return settings


def parse_settings(pairs: Iterable[str]) -> dict[str, str]:
    """librdkafka settings from KEY=VALUE strings (the --kafka-config flag); the last one of a key wins."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--kafka-config {pair!r}: expected KEY=VALUE, e.g. security.protocol=SSL")
        settings[_checked_key(key.strip(), source=f"--kafka-config {pair!r}")] = value
    return settings


def _checked_key(key: str, source: str) -> str:
    if key in _RESERVED_SETTINGS:
        raise ConfigError(f"{source}: set the cluster with --bootstrap-servers or {BOOTSTRAP_SERVERS_ENV}")
    return key


def client_config(bootstrap_servers: str, settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """A librdkafka config dict for any client (admin, producer, consumer)."""
    if not bootstrap_servers.strip():
        raise ConfigError(f"no bootstrap servers: pass --bootstrap-servers or set {BOOTSTRAP_SERVERS_ENV}")
    config = dict(settings or {})
    for key in config:
        _checked_key(key, source=f"setting {key!r}")
    config["bootstrap.servers"] = bootstrap_servers
    return config


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--bootstrap-servers and --kafka-config, for every command that talks to Kafka."""
    parser.add_argument(
        "--bootstrap-servers", metavar="HOST:PORT[,...]",
        help=f"Kafka brokers to bootstrap from (env {BOOTSTRAP_SERVERS_ENV}; "
             f"default {DEFAULT_BOOTSTRAP_SERVERS}, the broker of `make kafka-up`)")
    parser.add_argument(
        "--kafka-config", metavar="KEY=VALUE", action="append", default=[],
        help="a librdkafka setting passed through untouched, e.g. security.protocol=SASL_SSL, "
             "sasl.mechanism=SCRAM-SHA-512, ssl.ca.location=/etc/ca.pem; repeatable. "
             f"Also from the environment as {SETTING_ENV_PREFIX}<SETTING> (dots as underscores, "
             f"e.g. {SETTING_ENV_PREFIX}SASL_USERNAME); the flag wins")


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The client config for parsed `add_connection_arguments` flags, environment and defaults."""
    environ = os.environ if environ is None else environ
    bootstrap_servers = (args.bootstrap_servers or environ.get(BOOTSTRAP_SERVERS_ENV)
                         or DEFAULT_BOOTSTRAP_SERVERS)
    settings = settings_from_env(environ)
    settings.update(parse_settings(args.kafka_config))
    return client_config(bootstrap_servers, settings)
