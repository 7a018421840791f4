"""One config file for every command of a deployment (`--config FILE` or SETTLE_CONFIG, the TOML format of
`settle run`): defaults < file < environment < flags for each setting a command has, its [kafka] table under
the librdkafka settings of the environment and flags; an unknown key or an unreadable file is one line and
exit 2. And one name per flag across commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from branch_settlement.processors.cli import main as cli_main
from branch_settlement.processors.kafka import config as cfg
from branch_settlement.processors.kafka import connection

pytestmark = pytest.mark.unit

# every command that talks to Kafka or takes settings, as it is given its config file
COMMANDS = [["run"], ["produce", "-"], ["replay", "--topic", "branch-events"], ["replay", "events.jsonl"],
            ["export", "-o", "x.avro"], ["audit", "P", "--topic", "branch-events"], ["audit", "P", "events.jsonl"],
            ["topics", "apply"], ["topics", "describe"], ["acls", "apply"], ["acls", "check"], ["acls", "show"],
            ["inspect", "P"]]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("SETTLE_CONFIG", "SETTLE_TOPIC_PREFIX", "SETTLE_TOPIC_SPEC", "SETTLE_GROUP_ID", "SETTLE_STATE_DIR",
                 "SETTLE_BOOTSTRAP_SERVERS", "SETTLE_KAFKA_CONFIG_FILE", "SETTLE_TRANSACTIONAL_ID_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    for name in list(__import__("os").environ):
        if name.startswith("SETTLE_KAFKA_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settle.toml"
    path.write_text(text)
    return path


DEPLOYMENT = """\
bootstrap_servers = "kafka-1:9093,kafka-2:9093"
topic_prefix = "file."
group_id = "file-group"
state_dir = "/var/lib/settle"
commit_interval_ms = 250

[kafka]
"security.protocol" = "SASL_SSL"
"sasl.mechanism" = "SCRAM-SHA-512"
"enable.ssl.certificate.verification" = true
"""


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_command_takes_the_config_file(argv, tmp_path: Path) -> None:
    args = cli_main.build_parser().parse_args([*argv, "--config", str(write(tmp_path, DEPLOYMENT))])
    cfg.resolve_arguments(args, environ={})
    assert args.config
    for name, value in (("topic_prefix", "file."), ("group_id", "file-group")):
        if hasattr(args, name):
            assert getattr(args, name) == value, name


def test_precedence_defaults_file_environment_flags(tmp_path: Path, monkeypatch, capsys) -> None:
    path = write(tmp_path, DEPLOYMENT)

    def producer_topic(*argv: str) -> str:
        assert cli_main.main(["acls", "show", "--json", "--config", str(path), *argv]) == 0
        return next(acl["name"] for acl in json.loads(capsys.readouterr().out) if acl["role"] == "producer")

    assert producer_topic() == "file.branch-events"
    monkeypatch.setenv("SETTLE_TOPIC_PREFIX", "env.")
    assert producer_topic() == "env.branch-events"
    assert producer_topic("--topic-prefix", "flag.") == "flag.branch-events"
    monkeypatch.delenv("SETTLE_TOPIC_PREFIX")
    monkeypatch.setenv("SETTLE_CONFIG", str(path))  # the file named by the environment
    assert cli_main.main(["acls", "show", "--json"]) == 0
    names = {acl["name"] for acl in json.loads(capsys.readouterr().out)}
    assert "file.branch-events" in names and "file-group" in names
    # no file at all: the defaults
    monkeypatch.delenv("SETTLE_CONFIG")
    assert producer_topic.__call__ and cli_main.main(["acls", "show", "--json"]) == 0
    assert "branch-events" in {acl["name"] for acl in json.loads(capsys.readouterr().out)}


def test_the_client_config_takes_the_files_connection_below_environment_and_flags(tmp_path: Path) -> None:
    path = write(tmp_path, DEPLOYMENT)
    args = argparse.Namespace(config=str(path), bootstrap_servers=None, kafka_config=[], kafka_config_file=[])
    client = connection.config_from_args(args, environ={})
    assert client["bootstrap.servers"] == "kafka-1:9093,kafka-2:9093"
    assert client["security.protocol"] == "SASL_SSL" and client["enable.ssl.certificate.verification"] == "true"
    environ = {"SETTLE_BOOTSTRAP_SERVERS": "env:9093", "SETTLE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256"}
    client = connection.config_from_args(args, environ=environ)
    assert client["bootstrap.servers"] == "env:9093" and client["sasl.mechanism"] == "SCRAM-SHA-256"
    args.bootstrap_servers, args.kafka_config = "flag:9093", ["security.protocol=SSL"]
    client = connection.config_from_args(args, environ=environ)
    assert client["bootstrap.servers"] == "flag:9093" and client["security.protocol"] == "SSL"
    properties = tmp_path / "client.properties"
    properties.write_text("sasl.mechanism=PLAIN\n")
    args.kafka_config_file = [str(properties)]  # a properties file is above the config file's [kafka]
    assert connection.config_from_args(args, environ={})["sasl.mechanism"] == "PLAIN"


def test_settle_run_reads_the_same_file(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    config = cfg.load(parser.parse_args(["--config", str(write(tmp_path, DEPLOYMENT))]), environ={})
    assert (config.bootstrap_servers, config.topic_prefix, config.group_id, config.commit_interval_ms) == (
        "kafka-1:9093,kafka-2:9093", "file.", "file-group", 250)
    assert config.kafka["security.protocol"] == "SASL_SSL"


@pytest.mark.parametrize("text, says", [
    ("topic_prefx = 'x.'\n", "unknown settings topic_prefx"),
    ("this is not toml\n", "not valid TOML"),
    ("[kafka]\n'bootstrap.servers' = 'x:1'\n", "--bootstrap-servers"),
])
@pytest.mark.parametrize("argv", [["acls", "show"], ["inspect", "P"], ["replay", "events.jsonl"],
                                  ["produce", "events.jsonl"], ["topics", "describe"]], ids=" ".join)
def test_a_bad_file_is_one_line_and_exit_2(argv, text, says, tmp_path: Path, capsys) -> None:
    (tmp_path / "events.jsonl").write_text("")
    code = cli_main.main([*argv[:1], *[str(tmp_path / a) if a == "events.jsonl" else a for a in argv[1:]],
                          "--config", str(write(tmp_path, text))])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_an_unreadable_file_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert cli_main.main(["acls", "show", "--config", str(tmp_path / "nowhere.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("settle acls: config file ") and "cannot read it" in err and len(err.splitlines()) == 1


def test_inspect_looks_where_the_file_says(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, f"state_dir = '{tmp_path / 'state'}'\ngroup_id = 'grp'\n")
    assert cli_main.main(["inspect", "P", "--config", str(path)]) == 2
    assert str(tmp_path / "state" / "grp") in capsys.readouterr().err


def _options(parser: argparse.ArgumentParser, path: str = "settle"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.help is not argparse.SUPPRESS:
            for option in action.option_strings:
                yield path, option, action.dest


def test_one_name_per_setting_across_commands() -> None:
    by_dest: dict[str, set[str]] = {}
    for _, option, dest in _options(cli_main.build_parser()):
        if option.startswith("--"):
            by_dest.setdefault(dest, set()).add(option)
    assert by_dest["topic_spec"] == {"--topic-spec"} and by_dest["acl_spec"] == {"--acl-spec"}
    assert by_dest["config"] == {"--config"} and by_dest["group_id"] == {"--group-id"}
    assert by_dest.pop("progress") == {"--progress", "--no-progress"}  # a pair, one setting
    shared = {dest: names for dest, names in by_dest.items() if len(names) > 1}
    assert not shared, shared
    visible = {option for _, option, _ in _options(cli_main.build_parser())}
    assert "--spec" not in visible


def test_the_old_spec_flags_still_parse() -> None:
    parser = cli_main.build_parser()
    assert parser.parse_args(["topics", "apply", "--spec", "t.json"]).topic_spec == "t.json"
    assert parser.parse_args(["acls", "show", "--spec", "a.json"]).acl_spec == "a.json"
