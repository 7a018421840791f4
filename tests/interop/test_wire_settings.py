"""Which codec a command gets from its settings (processors/kafka/wire.py), the registry snapshot file, and
the wire-format settings in every command's flags, environment and config file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from branch_settlement.errors import ConfigError
from branch_settlement.processors.cli.main import build_parser
from branch_settlement.processors.kafka import config as cfg
from branch_settlement.processors.kafka import wire
from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.confluent import EXTERNAL_TYPES, ConfluentCodec
from tests.interop.vectors import scenario_records, snapshot_registry

pytestmark = pytest.mark.unit


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """The vectors' registry (ids 1, 2, ... in name order) as a snapshot file."""
    path = tmp_path / "registry.json"
    schemas = snapshot_registry().schemas
    wire.write_snapshot(str(path), [(i, default_codec().version(name).fullname, schemas[i])
                                    for i, name in enumerate(sorted(EXTERNAL_TYPES), start=1)])
    return path


def settings(**values) -> argparse.Namespace:
    return argparse.Namespace(**{"wire_format": None, "schema_registry_url": None, **values})


def test_without_a_registry_the_default_codec(snapshot) -> None:
    assert wire.codec_for(settings(), writes=True) is default_codec()


def test_a_reader_with_a_registry_reads_frames_and_writes_single_object(snapshot) -> None:
    codec = wire.codec_for(settings(schema_registry_url=f"file:{snapshot}"), writes=False)
    assert isinstance(codec, ConfluentCodec)
    record = scenario_records()["SettlementResult"]
    assert codec.encode("SettlementResult", record) == default_codec().encode("SettlementResult", record)
    writer = wire.codec_for(settings(schema_registry_url=f"file:{snapshot}", wire_format="confluent"), writes=True)
    framed = writer.encode("SettlementResult", record)
    assert framed[:1] == b"\x00" and codec.decode(framed) == default_codec().decode(
        default_codec().encode("SettlementResult", record))


def test_a_writer_of_confluent_frames_registers_first(snapshot) -> None:
    codec = wire.codec_for(settings(schema_registry_url=f"file:{snapshot}", wire_format="confluent"), writes=True)
    assert {name: codec.schema_id(name) for name in EXTERNAL_TYPES} == {
        name: i for i, name in enumerate(sorted(EXTERNAL_TYPES), start=1)}


def test_bad_wire_settings_are_one_line(tmp_path) -> None:
    with pytest.raises(ConfigError, match="wire_format confluent needs a schema_registry_url"):
        wire.codec_for(settings(wire_format="confluent"), writes=True)
    with pytest.raises(ConfigError, match="wire_format must be one of single-object, confluent"):
        wire.codec_for(settings(wire_format="avro"), writes=False)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schemas": [{"id": "x"}]}')
    with pytest.raises(ConfigError, match="schema registry snapshot .*bad.json: expected"):
        wire.codec_for(settings(schema_registry_url=f"file:{bad}"), writes=False)
    with pytest.raises(ConfigError, match="No such file"):
        wire.codec_for(settings(schema_registry_url=f"file:{tmp_path / 'none.json'}"), writes=False)
    with pytest.raises(ConfigError, match="wire_format must be one of"):
        cfg.ProcessorConfig(wire_format="json").validate()


def test_every_command_that_reads_or_writes_records_has_the_wire_settings(tmp_path, snapshot) -> None:
    """Flags, environment and the deployment's config file, with the same precedence as every setting."""
    parser = build_parser()
    config = tmp_path / "settle.toml"
    config.write_text(f'wire_format = "confluent"\nschema_registry_url = "file:{snapshot}"\n')
    for argv in (["produce", "events.jsonl"], ["replay", "events.jsonl"], ["replay", "--topic", "branch-events"],
                 ["export", "-o", "x.avro"], ["audit", "P", "--topic", "branch-events"]):
        args = cfg.resolve_arguments(parser.parse_args([*argv, "--config", str(config)]), environ={})
        assert (args.wire_format, args.schema_registry_url) == ("confluent", f"file:{snapshot}"), argv
        args = cfg.resolve_arguments(parser.parse_args([*argv, "--config", str(config), "--wire-format",
                                                        "single-object"]), environ={})
        assert args.wire_format == "single-object", argv
    run = cfg.load(parser.parse_args(["run", "--config", str(config)]), environ={"SETTLE_WIRE_FORMAT": "confluent"})
    assert (run.wire_format, run.schema_registry_url) == ("confluent", f"file:{snapshot}")
