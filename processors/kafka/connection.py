"""librdkafka client settings: bootstrap servers plus settings passed through untouched (TLS, SASL, ...).

Precedence, lowest first: defaults < settings files (--kafka-config-file, SETTLE_KAFKA_CONFIG_FILE) <
environment (SETTLE_BOOTSTRAP_SERVERS, SETTLE_KAFKA_<SETTING>, SETTLE_KAFKA_<SETTING>_FILE) < flags
(--bootstrap-servers, --kafka-config KEY=VALUE). Setting names are librdkafka's own
(https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md); nothing here interprets them, so
every security mechanism librdkafka supports works without code changes.

Secrets (a SASL password, a key's password) never come from the command line, where every user of the
machine can read them (`ps`, shell history): --kafka-config refuses them and names the places they go.
"""

from __future__ import annotations

import argparse
import logging
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
# A librdkafka properties file (key=value lines), the environment's form of --kafka-config-file.
CONFIG_FILE_ENV = "SETTLE_KAFKA_CONFIG_FILE"
# SETTLE_KAFKA_SASL_PASSWORD_FILE=/run/secrets/kafka: the value of sasl.password is that file's content.
FILE_SUFFIX = "_FILE"
# librdkafka's own log lines (`%3|...|FAIL|...` on stderr otherwise) go to this Python logger.
LIBRDKAFKA_LOGGER = "settle.librdkafka"
# Settings whose value is a secret: refused on the command line.
SECRET_SETTINGS = frozenset({"sasl.password", "ssl.key.password", "ssl.keystore.password", "ssl.key.pem",
                             "sasl.oauthbearer.client.secret", "sasl.oauthbearer.assertion.private.key.passphrase"})


def settings_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """librdkafka settings from SETTLE_KAFKA_<SETTING> variables, e.g. SETTLE_KAFKA_SASL_MECHANISM, and from
    SETTLE_KAFKA_<SETTING>_FILE variables naming a file that holds the value (SETTLE_KAFKA_SASL_PASSWORD_FILE).
    A value given directly wins over the same setting's file. SETTLE_KAFKA_CONFIG_FILE is not a setting: it
    names a settings file (`settings_from_files`)."""
    settings, from_files = {}, {}
    for name, value in environ.items():
        if not name.startswith(SETTING_ENV_PREFIX) or len(name) <= len(SETTING_ENV_PREFIX) or name == CONFIG_FILE_ENV:
            continue
        if name.endswith(FILE_SUFFIX) and len(name) > len(SETTING_ENV_PREFIX) + len(FILE_SUFFIX):
            key = name[len(SETTING_ENV_PREFIX):-len(FILE_SUFFIX)].lower().replace("_", ".")
            from_files[check_setting_name(key, source=name)] = _read_secret(value, source=name)
        else:
            key = name[len(SETTING_ENV_PREFIX):].lower().replace("_", ".")
            settings[check_setting_name(key, source=name)] = value
    return {**from_files, **settings}


def _read_secret(path: str, source: str) -> str:
    """A value kept in a file of its own (a mounted secret): its content without the final line break."""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{source}={path}: cannot read it: {_reason(err)}") from None
    return value[:-1] if value.endswith("\n") else value


def _reason(err: Exception) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else str(err)


def parse_settings(pairs: Iterable[str]) -> dict[str, str]:
    """librdkafka settings from KEY=VALUE strings (the --kafka-config flag); the last one of a key wins.
    Secrets are refused: the command line is readable by every user of the machine."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--kafka-config {pair!r}: expected KEY=VALUE, e.g. security.protocol=SSL")
        key = key.strip()
        if key in SECRET_SETTINGS:
            env = SETTING_ENV_PREFIX + key.upper().replace(".", "_")
            # The message names the setting, never the value.
            raise ConfigError(f"--kafka-config {key}=...: a secret on the command line can be read by every user "
                              f"of this machine (ps, shell history); put it in {env}, in a file named by "
                              f"{env}{FILE_SUFFIX}, or in a --kafka-config-file")
        settings[check_setting_name(key, source=f"--kafka-config {pair!r}")] = value
    return settings


def parse_properties(text: str, source: str) -> dict[str, str]:
    """librdkafka settings from a properties file's text: `key=value` lines; blank lines and lines starting
    with `#` or `!` are ignored; spaces around the key and before the value are not part of them."""
    settings = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#!":
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source}, line {number}: expected key=value, e.g. security.protocol=SASL_SSL")
        settings[check_setting_name(key.strip(), source=f"{source}, line {number}")] = value.lstrip()
    return settings


def settings_from_files(paths: Iterable[str]) -> dict[str, str]:
    """librdkafka settings from properties files (--kafka-config-file); a later file wins."""
    settings = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"--kafka-config-file {path}: cannot read it: {_reason(err)}") from None
        settings.update(parse_properties(text, source=path))
    return settings


def settings_from_args(args: argparse.Namespace | None, environ: Mapping[str, str]) -> dict[str, str]:
    """Every librdkafka setting of the config file, the `add_connection_arguments` flags and the environment, in
    precedence order: the config file's [kafka] table (--config, SETTLE_CONFIG: processors/kafka/config.py) <
    settings files (SETTLE_KAFKA_CONFIG_FILE, then --kafka-config-file) < SETTLE_KAFKA_* < --kafka-config."""
    from branch_settlement.processors.kafka import config  # it builds on this module

    settings = dict(config.file_settings(args, environ)[1])
    files = [environ[CONFIG_FILE_ENV]] if environ.get(CONFIG_FILE_ENV) else []
    files += list(getattr(args, "kafka_config_file", None) or [])
    settings.update(settings_from_files(files))
    settings.update(settings_from_env(environ))
    settings.update(parse_settings(getattr(args, "kafka_config", None) or []))
    return settings


def check_setting_name(key: str, source: str) -> str:
    """`key` itself, unless it names the cluster (only --bootstrap-servers and its environment do)."""
    if key in _RESERVED_SETTINGS:
        raise ConfigError(f"{source}: set the cluster with --bootstrap-servers or {BOOTSTRAP_SERVERS_ENV}")
    return key


def client_config(bootstrap_servers: str, settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """A librdkafka config dict for any client (admin, producer, consumer)."""
    if not bootstrap_servers.strip():
        raise ConfigError(f"no bootstrap servers: pass --bootstrap-servers or set {BOOTSTRAP_SERVERS_ENV}")
    config = dict(settings or {})
    for key in config:
        check_setting_name(key, source=f"setting {key!r}")
    config["bootstrap.servers"] = bootstrap_servers
    return config


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--bootstrap-servers and --kafka-config, for every command that talks to Kafka (with --config FILE:
    processors/cli/arguments.py)."""
    parser.add_argument(
        "--bootstrap-servers", metavar="HOST:PORT[,...]",
        help=f"Kafka brokers to bootstrap from (env {BOOTSTRAP_SERVERS_ENV}; config file key bootstrap_servers; "
             f"default {DEFAULT_BOOTSTRAP_SERVERS}, the broker of `make kafka-up`)")
    parser.add_argument(
        "--kafka-config", metavar="KEY=VALUE", action="append", default=[],
        help="a librdkafka setting passed through untouched, e.g. security.protocol=SASL_SSL, "
             "sasl.mechanism=SCRAM-SHA-512, ssl.ca.location=/etc/ca.pem; repeatable. "
             f"Also from the environment as {SETTING_ENV_PREFIX}<SETTING> (dots as underscores, "
             f"e.g. {SETTING_ENV_PREFIX}SASL_USERNAME), or read from a file named by "
             f"{SETTING_ENV_PREFIX}<SETTING>{FILE_SUFFIX}; the flag wins. Secrets (sasl.password, key "
             "passwords) are refused here: use the environment or a file")
    parser.add_argument(
        "--kafka-config-file", metavar="FILE", action="append", default=[],
        help="a librdkafka properties file, key=value lines (# comments), e.g. security.protocol, "
             f"sasl.username, sasl.password, ssl.ca.location; repeatable, a later file wins (env {CONFIG_FILE_ENV}). "
             f"Below {SETTING_ENV_PREFIX}* and --kafka-config in precedence")


def quiet_logger() -> logging.Logger:
    """The logger librdkafka's lines go to: silent (and not propagated) unless someone configured it."""
    log = logging.getLogger(LIBRDKAFKA_LOGGER)
    if not log.handlers:
        log.addHandler(logging.NullHandler())
        log.propagate = False
    return log


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict:
    """The client config for parsed `add_connection_arguments` flags, environment and defaults: the
    librdkafka settings, and `logger`, which sends librdkafka's own log lines to the `settle.librdkafka` logger
    (silent unless configured) instead of stderr: a command's one-line error says what went wrong, and a
    command that succeeds prints no client noise (a consumer closed during its coordinator's TLS handshake)."""
    from branch_settlement.processors.kafka import config  # it builds on this module

    environ = os.environ if environ is None else environ
    bootstrap_servers = (getattr(args, "bootstrap_servers", None) or environ.get(BOOTSTRAP_SERVERS_ENV)
                         or str(config.file_settings(args, environ)[0].get("bootstrap_servers") or "")
                         or DEFAULT_BOOTSTRAP_SERVERS)
    return {**client_config(bootstrap_servers, settings_from_args(args, environ)), "logger": quiet_logger()}
