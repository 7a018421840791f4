"""The processor's configuration: defaults < config file < environment < flags; librdkafka settings pass
through; bad values are refused with the setting named."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka import config as cfg

pytestmark = pytest.mark.unit


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults() -> None:
    config = cfg.load(parse(), environ={})
    assert config.commit_interval_ms == 100 and config.group_id == "branch-settlement"
    assert config.commit_records == 20_000 and config.view_cache_mb == 96
    assert config.transactional_id.startswith("branch-settlement-")
    assert config.client_config() == {"bootstrap.servers": "127.0.0.1:9092", "logger": cfg.CLIENT_LOG}


def test_precedence_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "settle.toml"
    path.write_text('commit_interval_ms = 50\ncommit_events = 10\ngroup_id = "from-file"\nworker_slot = "w1"\n'
                    '[kafka]\n"security.protocol" = "SSL"\n"ssl.ca.location" = "/etc/ca.pem"\n')
    environ = {"SETTLE_CONFIG": str(path), "SETTLE_COMMIT_EVENTS": "20", "SETTLE_GROUP_ID": "from-env",
               "SETTLE_KAFKA_SASL_MECHANISM": "PLAIN"}
    config = cfg.load(parse("--group-id", "from-flag", "--kafka-config", "security.protocol=SASL_SSL"), environ)
    assert config.commit_interval_ms == 50  # file
    assert config.commit_events == 20  # environment over file
    assert config.group_id == "from-flag"  # flag over environment
    assert config.transactional_id == "branch-settlement-w1"
    scoped = cfg.load(parse("--worker-slot", "w1", "--topic-prefix", "staging."), environ={})
    assert scoped.transactional_id == "staging.branch-settlement-w1"  # environments never fence each other
    assert config.client_config() == {"logger": cfg.CLIENT_LOG, "bootstrap.servers": "127.0.0.1:9092",
                                      "security.protocol": "SASL_SSL",
                                      "ssl.ca.location": "/etc/ca.pem", "sasl.mechanism": "PLAIN"}


def test_the_config_object_is_frozen() -> None:
    config = cfg.load(parse(), environ={})
    with pytest.raises(AttributeError):
        config.commit_interval_ms = 5  # type: ignore[misc]


@pytest.mark.parametrize("argv, environ, message", [
    (("--commit-interval-ms", "0"), {}, "commit_interval_ms must be > 0"),
    ((), {"SETTLE_COMMIT_EVENTS": "many"}, "commit_events: expected an integer"),
    (("--tick-interval-ms", "-1"), {}, "tick_interval_ms must be >= 0"),
    (("--kafka-config", "bootstrap.servers=x:1"), {}, "--bootstrap-servers"),
    (("--kafka-config", "no-equals-sign"), {}, "expected KEY=VALUE"),
])
def test_bad_settings_are_refused_with_their_name(argv, environ, message) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg.load(parse(*argv), environ)


def test_unknown_and_unreadable_config_files_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("comit_interval_ms = 5\n")
    with pytest.raises(ConfigError, match="unknown settings comit_interval_ms"):
        cfg.load(parse("--config", str(bad)), environ={})
    with pytest.raises(ConfigError, match="config file"):
        cfg.load(parse("--config", str(tmp_path / "missing.toml")), environ={})


def test_every_setting_has_a_flag_and_an_environment_variable() -> None:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    text = parser.format_help()
    for field in cfg._SETTINGS:
        assert f"--{field.name.replace('_', '-')}" in text
        if field.name != "bootstrap_servers":
            assert cfg.env_name(field.name) in text
