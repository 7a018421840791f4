"""Connection settings from files and the environment, and secrets kept off the command line (no broker)."""

from __future__ import annotations

import argparse

import pytest

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka import config as cfg
from branch_settlement.processors.kafka.connection import add_connection_arguments, config_from_args

pytestmark = pytest.mark.unit


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_connection_arguments(parser)
    return parser.parse_args(argv)


def test_a_properties_file_gives_settings_below_the_environment_and_the_flags(tmp_path):
    path = tmp_path / "client.properties"
    path.write_text("# the SASL_SSL listener\n\nsecurity.protocol=SASL_SSL\n  sasl.username = producer\n"
                    "sasl.password=s3cret=with=equals\n! old style comment\nsasl.mechanism=PLAIN\n")
    config = config_from_args(_args("--kafka-config-file", str(path)), environ={})
    assert config.pop("logger").name == "settle.librdkafka"
    assert config == {
        "bootstrap.servers": "127.0.0.1:9092", "security.protocol": "SASL_SSL", "sasl.username": "producer",
        "sasl.password": "s3cret=with=equals", "sasl.mechanism": "PLAIN"}
    environ = {"SETTLE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256"}
    config = config_from_args(_args("--kafka-config-file", str(path), "--kafka-config", "sasl.mechanism=SCRAM-SHA-512"),
                              environ=environ)
    assert config["sasl.mechanism"] == "SCRAM-SHA-512"
    assert config_from_args(_args("--kafka-config-file", str(path)), environ=environ)["sasl.mechanism"] == "SCRAM-SHA-256"
    # The environment's form of the flag; a file on the command line comes after it.
    other = tmp_path / "other.properties"
    other.write_text("sasl.username=auditor\n")
    assert config_from_args(_args(), environ={"SETTLE_KAFKA_CONFIG_FILE": str(path)})["sasl.username"] == "producer"
    assert config_from_args(_args("--kafka-config-file", str(other)),
                            environ={"SETTLE_KAFKA_CONFIG_FILE": str(path)})["sasl.username"] == "auditor"


def test_a_setting_read_from_its_own_file(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("from-a-file\n")
    environ = {"SETTLE_KAFKA_SASL_PASSWORD_FILE": str(secret)}
    assert config_from_args(_args(), environ=environ)["sasl.password"] == "from-a-file"
    # A value given directly wins over the same setting's file.
    both = {**environ, "SETTLE_KAFKA_SASL_PASSWORD": "direct"}
    assert config_from_args(_args(), environ=both)["sasl.password"] == "direct"


@pytest.mark.parametrize("setting", ["sasl.password", "ssl.key.password", "sasl.oauthbearer.client.secret"])
def test_a_secret_on_the_command_line_is_refused_and_not_repeated(setting):
    with pytest.raises(ConfigError) as refused:
        config_from_args(_args("--kafka-config", f"{setting}=hunter2"), environ={})
    message = str(refused.value)
    assert "hunter2" not in message
    env = "SETTLE_KAFKA_" + setting.upper().replace(".", "_")
    assert env in message and f"{env}_FILE" in message and "--kafka-config-file" in message


@pytest.mark.parametrize("content, problem", [
    ("security.protocol\n", "line 1: expected key=value"),
    ("security.protocol=SSL\nbootstrap.servers=elsewhere:9092\n", "line 2: set the cluster with --bootstrap-servers"),
])
def test_a_bad_properties_file_names_its_line(tmp_path, content, problem):
    path = tmp_path / "bad.properties"
    path.write_text(content)
    with pytest.raises(ConfigError, match=problem):
        config_from_args(_args("--kafka-config-file", str(path)), environ={})


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--kafka-config-file .*nope.properties: cannot read it: No such file"):
        config_from_args(_args("--kafka-config-file", str(tmp_path / "nope.properties")), environ={})
    with pytest.raises(ConfigError, match=r"SETTLE_KAFKA_SASL_PASSWORD_FILE=.*gone: cannot read it"):
        config_from_args(_args(), environ={"SETTLE_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "gone")})


def test_the_processor_reads_the_same_sources(tmp_path):
    """settle run's settings come through config.load: the same file, environment and flag rules."""
    path = tmp_path / "processor.properties"
    path.write_text("security.protocol=SASL_SSL\nsasl.username=processor\nsasl.password=pw\n")
    secret = tmp_path / "key-password"
    secret.write_text("kp")
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    config = cfg.load(parser.parse_args(["--kafka-config-file", str(path)]),
                      environ={"SETTLE_KAFKA_SSL_KEY_PASSWORD_FILE": str(secret)})
    assert dict(config.kafka) == {"security.protocol": "SASL_SSL", "sasl.username": "processor",
                                  "sasl.password": "pw", "ssl.key.password": "kp"}
    with pytest.raises(ConfigError, match="secret on the command line"):
        cfg.load(parser.parse_args(["--kafka-config", "sasl.password=pw"]), environ={})
