"""The Confluent wire format (schemas/confluent.py): what it frames and what it leaves single-object, reading
both formats, the shared vectors, registration with the compatibility check first, and what a registry that
does not know an id or does not answer does to a record."""

from __future__ import annotations

import io
import json

import fastavro
import pytest

from branch_settlement.schemas.codec import SCHEMA_DIR, CodecError, default_codec
from branch_settlement.schemas.confluent import (EXTERNAL_TYPES, ConfluentCodec, SchemaRegistryError,
                                                 SchemaRegistryUnavailable, StaticSchemas, frame,
                                                 standalone_schemas)
from tests.interop.vectors import VECTORS, build, render, scenario_records, snapshot_registry

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def confluent() -> ConfluentCodec:
    codec = ConfluentCodec(snapshot_registry())
    codec.check_and_register()
    return codec


def vectors() -> list[dict]:
    return [json.loads(line) for line in VECTORS.read_text().splitlines()]


def test_the_committed_vectors_are_what_the_codecs_write_today() -> None:
    assert VECTORS.read_text() == render(build()), "regenerate: python -m tests.interop.vectors"
    assert sorted(v["name"] for v in vectors()) == sorted(EXTERNAL_TYPES)


def test_every_vector_reads_back_in_both_formats(confluent) -> None:
    single = default_codec()
    for vector in vectors():
        name = vector["name"]
        framed, plain = bytes.fromhex(vector["confluent"]), bytes.fromhex(vector["single_object"])
        assert framed[:1] == b"\x00" and int.from_bytes(framed[1:5], "big") == vector["schema_id"]
        assert framed[5:] == plain[10:], "the same Avro body under another header"
        assert confluent.decode(framed) == single.decode(plain) == confluent.decode(plain)
        record = single.decode(plain)[1]
        assert confluent.encode(name, record) == framed and confluent.encoder(name)(record) == framed
        if vector["fullname"].startswith("io.branchsettlement.events."):
            assert confluent.decode_event(framed) == single.decode_event(plain)


def test_the_processors_own_records_stay_single_object(confluent) -> None:
    """Ticks, the ledger and its changelog are read by nobody else, and a restore needs no registry."""
    single = default_codec()
    tick = single.event_from_json({"type": "Tick", "event_id": "t", "idempotency_key": "tick/0/1", "parent_id": "",
                                   "occurred_at_ms": 1, "now_ms": 1})
    assert confluent.encode_event(tick) == single.encode_event(tick)
    for name in confluent.names:
        if name not in EXTERNAL_TYPES:
            with pytest.raises(CodecError, match="no schema id"):
                confluent.schema_id(name)


def test_before_registration_nothing_is_framed() -> None:
    codec = ConfluentCodec(snapshot_registry())
    record = scenario_records()["SettlementResult"]
    assert codec.encode("SettlementResult", record) == default_codec().encode("SettlementResult", record)


def test_an_id_the_registry_does_not_know_is_a_codec_error(confluent) -> None:
    """A codec error: the processor makes the record a dead letter; the partition goes on."""
    body = bytes.fromhex(vectors()[0]["confluent"])[5:]
    with pytest.raises(CodecError, match="schema id 999 is not in the schema registry"):
        confluent.decode(frame(999, body))
    with pytest.raises(CodecError, match="truncated Confluent frame"):
        confluent.decode(b"\x00\x00\x01")


def test_a_schema_of_another_record_is_a_codec_error() -> None:
    foreign = json.dumps({"type": "record", "name": "com.example.Order", "fields": [{"name": "id", "type": "long"}]})
    codec = ConfluentCodec(StaticSchemas({7: foreign}))
    with pytest.raises(CodecError, match="schema id 7 is com.example.Order, not a record of branch settlement"):
        codec.decode(frame(7, b"\x02"))
    with pytest.raises(CodecError, match="not an event"):
        ConfluentCodec(snapshot_registry()).decode_event(
            bytes.fromhex(next(v for v in vectors() if v["name"] == "SettlementResult")["confluent"]))


def test_an_unreachable_registry_is_not_the_records_fault() -> None:
    """Not a CodecError (that would dead-letter a good record): it propagates, the processor stops without
    committing, and its restart reads the record again."""

    class Down(StaticSchemas):
        def schema_by_id(self, schema_id):
            raise SchemaRegistryUnavailable("schema registry at http://127.0.0.1:1 did not answer")

    codec = ConfluentCodec(Down({}))
    with pytest.raises(SchemaRegistryUnavailable):
        codec.decode_event(frame(3, b"\x00"))


def test_an_older_version_in_the_registry_is_resolved_into_the_current_schema() -> None:
    """A producer that registered ChildFailed before retry_attempt_id and usage_uncertain existed: its frames are
    read with the current schema, the new fields at their defaults."""
    old_schema = (SCHEMA_DIR / "history" / "ChildFailed.v1.avsc").read_text()
    codec = ConfluentCodec(StaticSchemas({41: old_schema}))
    current = default_codec().event_from_json({
        "type": "ChildFailed", "event_id": "e1", "idempotency_key": "P/C/A1/1", "parent_id": "P", "occurred_at_ms": 1,
        "child_id": "C", "attempt_id": "A1", "lease_generation": 1, "activated": True, "usage": {"tokens": 3},
        "reason": "oom"})
    v1 = {k: v for k, v in current.items() if k not in ("type", "usage_uncertain", "retry_attempt_id")}
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(json.loads(old_schema)), v1)
    event = codec.decode_event(frame(41, body.getvalue()))
    assert event == current and list(event) == list(current)


def test_registration_checks_every_subject_before_registering_any() -> None:
    class Strict(StaticSchemas):
        registered: list = []

        def incompatibilities(self, subject, schema):
            return ["READER_FIELD_MISSING_DEFAULT_VALUE: reason"] if subject.endswith(".CapacityReleased") else []

        def register(self, subject, schema):
            self.registered.append(subject)
            return super().register(subject, schema)

    source = Strict(snapshot_registry().schemas)
    with pytest.raises(SchemaRegistryError, match=r"io\.branchsettlement\.outputs\.CapacityReleased: "
                                                  "READER_FIELD_MISSING_DEFAULT_VALUE"):
        ConfluentCodec(source).check_and_register()
    assert source.registered == []


def test_subjects_are_full_record_names_and_schemas_stand_alone(confluent) -> None:
    registrations = ConfluentCodec(snapshot_registry()).check_and_register()
    assert {r.subject for r in registrations} == {default_codec().version(n).fullname for n in EXTERNAL_TYPES}
    for name, text in standalone_schemas().items():
        fastavro.parse_schema(json.loads(text))  # no reference to another file left
    assert '"default"' in standalone_schemas()["ChildFailed"], "defaults are kept: compatibility needs them"
