"""The codec: single-object encoding, evolution by fingerprint, the canonical JSON form, container files."""

import copy
import io
import json
import shutil
import struct

import fastavro
import pytest
from fastavro.schema import load_schema, to_parsing_canonical_form
from hypothesis import given, settings
from hypothesis import strategies as st

from branch_settlement.schemas import (EVENT_TYPES, LEDGER_TYPES, OUTPUT_TYPES, SCHEMA_DIR, Codec, CodecError,
                                       default_codec)
from branch_settlement.schemas.registry import schema_fingerprint

pytestmark = pytest.mark.unit

ALL_TYPES = EVENT_TYPES + OUTPUT_TYPES + LEDGER_TYPES
COMMON = {"idempotency_key": "wf-42/B/B1/1", "parent_id": "wf-42", "occurred_at_ms": 1764410400110}
CHILD = {"child_id": "B", "attempt_id": "B1"}

# One typical event per type, in the JSON form of SPEC section 12 (optional fields sometimes left out).
TYPICAL_EVENTS = [
    {"type": "ParentReserved", "event_id": "e1", **COMMON, "lease_ttl_ms": 3600000,
     "capacity": {"tokens": {"quantity": 100, "kind": "logical"}, "gpu_slots": {"quantity": 2, "kind": "physical"}},
     "policy": {"max_live_children": 8, "reconciliation_timeout_ms": 600000, "lending_limit": {"tokens": 10}}},
    {"type": "ChildReserved", "event_id": "e2", **COMMON, "child_id": "B", "branch_id": "B", "attempt_id": "B1",
     "quantities": {"tokens": 20, "gpu_slots": 1}},
    {"type": "ChildActivated", "event_id": "e3", **COMMON, **CHILD, "lease_generation": 1, "lease_ttl_ms": 60000},
    {"type": "LeaseRenewed", "event_id": "e4", **COMMON, **CHILD, "lease_generation": 2, "lease_ttl_ms": 60000},
    {"type": "UsageReported", "event_id": "e5", **COMMON, **CHILD, "lease_generation": 1,
     "usage_report_id": "r-1", "usage": {"tokens": 5}},
    {"type": "ChildCompleted", "event_id": "e6", **COMMON, **CHILD, "lease_generation": 1, "usage": {"tokens": 12}},
    {"type": "ChildSkipped", "event_id": "e7", **COMMON, **CHILD, "reason": "pruned by router"},
    {"type": "CancelRequested", "event_id": "e8", **COMMON, **CHILD},
    {"type": "CancelAcknowledged", "event_id": "e9", **COMMON, **CHILD, "lease_generation": 1,
     "usage_uncertain": True},
    {"type": "ChildFailed", "event_id": "e10", **COMMON, **CHILD, "lease_generation": 1, "activated": True,
     "usage": {"tokens": 3}, "reason": "oom", "retry_attempt_id": "B2"},
    {"type": "SpeculativeWinner", "event_id": "e11", **COMMON, "branch_id": "B", "winner_attempt_id": "B1"},
    {"type": "ReservationTransferred", "event_id": "e12", **COMMON, "child_id": "B", "from_attempt_id": "B1",
     "to_attempt_id": "B2"},
    {"type": "ReconciliationResolved", "event_id": "e13", **COMMON, **CHILD, "usage": {"tokens": 5},
     "resolution": "late_report"},
    {"type": "UsageAdjustment", "event_id": "e14", **COMMON, **CHILD, "usage": {"tokens": 1}, "reason": "audit"},
    {"type": "SchedulerReleaseConfirmed", "event_id": "e15", **COMMON, **CHILD, "dimension": "gpu_slots"},
    {"type": "ParentClosed", "event_id": "e16", **COMMON, "outcome": "succeeded"},
    {"type": "Tick", "event_id": "e17", "idempotency_key": "tick/0/1764410461000", "parent_id": "",
     "occurred_at_ms": 1764410400130, "now_ms": 1764410461000},
    {"type": "LoanRequested", "event_id": "e18", "idempotency_key": "wf-42/loan/L1/request", "parent_id": "wf-42",
     "occurred_at_ms": 1764410400140, "loan_id": "L1", "borrower": "batch-7", "quantities": {"tokens": 10}},
    {"type": "LoanReturned", "event_id": "e19", "idempotency_key": "wf-42/loan/L1/return", "parent_id": "wf-42",
     "occurred_at_ms": 1764410400150, "loan_id": "L1", "usage": {"tokens": 4}},
]
BY_TYPE = {event["type"]: event for event in TYPICAL_EVENTS}

# Reference fingerprints from Apache Avro share/test/data/schema-tests.txt (Java signed longs).
AVRO_FINGERPRINT_VECTORS = [
    ("int", 8247732601305521295),
    ("string", -8142146995180207161),
    ({"fields": [], "type": "record", "name": "foo", "namespace": "x.y"}, 5916914534497305771),
    ({"fields": [{"type": {"type": "boolean"}, "name": "f1"}], "type": "record", "name": "foo"}, 7843277075252814651),
    # Vector 026 without its `"default": "true"`, which fastavro rejects for a boolean; the canonical form drops
    # defaults anyway, so the fingerprint is the same.
    ({"type": "record", "name": "foo", "fields": [
        {"type": "boolean", "aliases": [], "name": "f1"},
        {"order": "descending", "name": "f2", "doc": "Hello", "type": "int"}]}, -4860222112080293046),
    ({"values": "string", "type": "map"}, -8732877298790414990),
    ({"name": "PigValue", "type": "record", "fields": [{"name": "value", "type": ["null", "int", "long", "PigValue"]}]},
     -1759257747318642341),
]


@pytest.fixture(scope="module")
def codec():
    return default_codec()


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO as the Avro specification writes it out (the 'fingerprint64' function)."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def sample(schema, named, label="x"):
    """A representative value of a parsed schema: every field set, unions on their non-null branch."""
    if isinstance(schema, list):
        return sample(next(branch for branch in schema if branch != "null"), named, label)
    if isinstance(schema, str):
        primitives = {"string": f"{label}-1", "long": 1764410400123, "int": 7, "boolean": True,
                      "bytes": b"\x00\xffdigest", "null": None}
        return primitives[schema] if schema in primitives else sample(named[schema], named, label)
    kind = schema["type"]
    if kind == "record":
        return {field["name"]: sample(field["type"], named, field["name"]) for field in schema["fields"]}
    if kind == "map":
        return {"tokens": sample(schema["values"], named, label), "gpu_slots": sample(schema["values"], named, label)}
    if kind == "array":
        return [sample(schema["items"], named, label), sample(schema["items"], named, label + "b")]
    return sample(kind, named, label)


def strategy(schema, named):
    """A hypothesis strategy for any value of a parsed schema."""
    if isinstance(schema, list):
        return st.one_of([strategy(branch, named) for branch in schema])
    if isinstance(schema, str):
        primitives = {
            "string": st.text(max_size=12),
            "long": st.integers(-(2**63), 2**63 - 1),
            "int": st.integers(-(2**31), 2**31 - 1),
            "boolean": st.booleans(),
            "bytes": st.binary(max_size=12),
            "null": st.none(),
        }
        return primitives[schema] if schema in primitives else strategy(named[schema], named)
    kind = schema["type"]
    if kind == "record":
        return st.fixed_dictionaries({field["name"]: strategy(field["type"], named) for field in schema["fields"]})
    if kind == "map":
        return st.dictionaries(st.text(max_size=8), strategy(schema["values"], named), max_size=3)
    if kind == "array":
        return st.lists(strategy(schema["items"], named), max_size=3)
    return strategy(kind, named)


def parsed(codec, name):
    return codec.version(name).parsed


def single_object(schema_path, record) -> bytes:
    """Single-object encoding done by hand with plain fastavro, as another Avro client would."""
    schema = load_schema(str(schema_path))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema, record)
    return b"\xc3\x01" + schema_fingerprint(schema) + body.getvalue()


# -- single-object encoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_TYPES)
def test_every_schema_round_trips_a_representative_record(codec, name):
    schema = parsed(codec, name)
    record = sample(schema, schema["__named_schemas"])
    assert codec.decode(codec.encode(name, record)) == (name, record)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_schema_round_trips_any_valid_record(codec, data):
    name = data.draw(st.sampled_from(ALL_TYPES))
    schema = parsed(codec, name)
    record = data.draw(strategy(schema, schema["__named_schemas"]))
    assert codec.decode(codec.encode(name, record)) == (name, record)


@pytest.mark.parametrize("vector", AVRO_FINGERPRINT_VECTORS, ids=lambda v: str(v[1]))
def test_fingerprint_is_crc64_avro_of_the_canonical_form_little_endian(vector):
    schema, java_fingerprint = vector
    assert schema_fingerprint(schema) == struct.pack("<q", java_fingerprint)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_header_is_marker_then_fingerprint_of_the_expanded_canonical_form(codec, name):
    schema = parsed(codec, name)
    data = codec.encode(name, sample(schema, schema["__named_schemas"]))
    canonical = to_parsing_canonical_form(schema)
    assert canonical.count('"name":"io.branchsettlement.ledger.Balance"') == (
        name in ("Balance", "CapacityReleased", "ParentSettled", "LedgerParent")
    ), "a referenced named type is part of the canonical form, defined once"
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == crc64_avro(canonical.encode()).to_bytes(8, "little")


@pytest.mark.parametrize("name", ["ParentSettled", "CapacityReleased", "LedgerParent", "ChildReserved"])
def test_bytes_from_another_avro_client_decode(codec, name):
    """Plain fastavro `load_schema` finds the shared Balance by its file name and fingerprints the whole schema."""
    record = sample(parsed(codec, name), parsed(codec, name)["__named_schemas"])
    data = single_object(SCHEMA_DIR / f"{name}.avsc", record)
    assert data == codec.encode(name, record)
    assert codec.decode(data) == (name, record)


def test_encoding_is_deterministic(codec):
    for event in TYPICAL_EVENTS:
        canonical = codec.event_from_json(event)
        assert codec.encode_event(canonical) == codec.encode_event(copy.deepcopy(canonical))
    shuffled = dict(BY_TYPE["ChildReserved"], quantities={"gpu_slots": 1, "tokens": 20})
    assert codec.encode_event(codec.event_from_json(shuffled)) == codec.encode_event(
        codec.event_from_json(BY_TYPE["ChildReserved"])
    ), "map entries are sorted by the JSON normalization"


# -- evolution --------------------------------------------------------------------------------------------------


def test_event_written_with_an_older_version_is_read_with_the_current_one(codec):
    v1 = {key: value for key, value in codec.event_from_json(BY_TYPE["ChildFailed"]).items()
          if key not in ("type", "usage_uncertain", "retry_attempt_id")}
    data = single_object(SCHEMA_DIR / "history" / "ChildFailed.v1.avsc", v1)
    assert data[2:10] != codec.version("ChildFailed").fingerprint
    event = codec.decode_event(data)
    assert event == {"type": "ChildFailed", **v1, "usage_uncertain": False, "retry_attempt_id": None}
    assert list(event) == list(codec.event_from_json(BY_TYPE["ChildFailed"]))


def test_a_new_version_reads_what_the_packaged_one_wrote(tmp_path, codec):
    """Adding a field with a default and keeping the old file in history/ is all that evolution takes."""
    shutil.copytree(SCHEMA_DIR, tmp_path / "schemas", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    shutil.copy(SCHEMA_DIR / "Tick.avsc", tmp_path / "schemas" / "history" / "Tick.v1.avsc")
    tick = json.loads((SCHEMA_DIR / "Tick.avsc").read_text())
    tick["fields"].append({"name": "source", "type": "string", "default": "processor"})
    (tmp_path / "schemas" / "Tick.avsc").write_text(json.dumps(tick))
    newer = Codec(tmp_path / "schemas")

    old_bytes = codec.encode_event(codec.event_from_json(BY_TYPE["Tick"]))
    assert newer.decode_event(old_bytes) == {**codec.event_from_json(BY_TYPE["Tick"]), "source": "processor"}
    assert newer.event_from_json(BY_TYPE["Tick"])["source"] == "processor"
    with pytest.raises(CodecError, match="unknown writer schema fingerprint"):
        codec.decode(newer.encode_event(newer.event_from_json(BY_TYPE["Tick"])))


def test_a_change_to_a_shared_type_changes_the_fingerprint_of_every_record_using_it(tmp_path, codec):
    shutil.copytree(SCHEMA_DIR, tmp_path / "schemas", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    balance_file = codec.version("Balance").source.name
    balance = json.loads((SCHEMA_DIR / balance_file).read_text())
    balance["fields"].append({"name": "borrowed", "type": "long", "default": 0})
    (tmp_path / "schemas" / balance_file).write_text(json.dumps(balance))
    changed = Codec(tmp_path / "schemas")
    for name in ALL_TYPES:
        same = changed.version(name).fingerprint == codec.version(name).fingerprint
        assert same == (name not in ("Balance", "CapacityReleased", "ParentSettled", "LedgerParent")), name


# -- bad bytes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda data: b"", "truncated single-object header"),
        (lambda data: data[:7], "truncated single-object header"),
        (lambda data: b"\xc3\x00" + data[2:], "bad single-object marker c300"),
        (lambda data: b"\x01\x00" + data[2:], "bad single-object marker 0100"),
        # 00 starts a Confluent frame: the single-object codec says what it is and what reading it needs
        (lambda data: b"\x00\x00\x00\x00\x07" + data[10:], "a Confluent wire format frame \\(schema id 7\\): "
                                                           "reading it needs the Schema Registry"),
        (lambda data: data[:2] + bytes(8) + data[10:], "unknown writer schema fingerprint 0000000000000000"),
        (lambda data: data[:-3], "ChildReserved: cannot decode body"),
        (lambda data: data[:10], "ChildReserved: cannot decode body"),
        (lambda data: data + b"\x00", "ChildReserved: 1 trailing bytes"),
        (lambda data: data[:11] + b"\xff" * 10 + data[21:], "ChildReserved: cannot decode body"),
    ],
    ids=["empty", "short-header", "marker", "no-marker", "confluent-frame", "fingerprint", "truncated", "no-body", "trailing", "garbage"],
)
def test_bad_bytes_raise_codec_error_with_the_reason(codec, mangle, reason):
    data = codec.encode_event(codec.event_from_json(BY_TYPE["ChildReserved"]))
    with pytest.raises(CodecError, match=reason):
        codec.decode(mangle(data))


def test_codec_error_is_a_value_error():
    assert issubclass(CodecError, ValueError)


def test_encoding_a_record_that_does_not_fit_raises_codec_error(codec):
    with pytest.raises(CodecError, match="unknown record name 'Nope'"):
        codec.encode("Nope", {})
    with pytest.raises(CodecError, match="TimerRecord: cannot encode"):
        codec.encode("TimerRecord", {"kind": "lease", "deadline_ms": "soon", "parent_id": "p", "child_id": "c"})
    with pytest.raises(CodecError, match="unknown event type 'Nope'"):
        codec.encode_event({"type": "Nope"})
    with pytest.raises(CodecError, match="'type'"):
        codec.encode_event({"event_id": "e"})


def test_decode_event_rejects_a_record_that_is_not_an_event(codec):
    data = codec.encode("PartitionMeta", {"ledger_time_ms": 5, "last_tick_key": None})
    assert codec.decode(data) == ("PartitionMeta", {"ledger_time_ms": 5, "last_tick_key": None})
    with pytest.raises(CodecError, match="PartitionMeta is not an event"):
        codec.decode_event(data)


# -- canonical JSON form ----------------------------------------------------------------------------------------


def test_type_tuples_name_every_schema_once(codec):
    assert len(EVENT_TYPES) == 19
    assert sorted(ALL_TYPES) == sorted(codec.names)
    assert sorted(event["type"] for event in TYPICAL_EVENTS) == sorted(EVENT_TYPES)


@pytest.mark.parametrize("event", TYPICAL_EVENTS, ids=lambda event: event["type"])
def test_event_from_json_accepts_each_type_and_returns_the_decoded_shape(codec, event):
    canonical = codec.event_from_json(json.loads(json.dumps(event)))
    fields = [field["name"] for field in parsed(codec, event["type"])["fields"]]
    assert list(canonical) == ["type", *fields]
    assert {key: value for key, value in canonical.items() if key in event} == event
    decoded = codec.decode_event(codec.encode_event(canonical))
    assert decoded == canonical and list(decoded) == list(canonical)
    assert codec.event_to_json(canonical) == canonical
    assert json.loads(json.dumps(codec.event_to_json(canonical))) == canonical


def test_event_from_json_fills_defaults_and_does_not_share_them(codec):
    minimal = dict(BY_TYPE["ParentReserved"], policy={"max_live_children": 1, "reconciliation_timeout_ms": 5})
    first, second = codec.event_from_json(minimal), codec.event_from_json(minimal)
    assert first["policy"]["lending_limit"] == {}
    first["policy"]["lending_limit"]["tokens"] = 1
    assert second["policy"]["lending_limit"] == {}
    failed = codec.event_from_json({k: v for k, v in BY_TYPE["ChildFailed"].items()
                                    if k not in ("usage", "reason", "retry_attempt_id")})
    assert (failed["usage"], failed["usage_uncertain"], failed["reason"], failed["retry_attempt_id"]) == (
        None, False, "", None)
    assert codec.event_from_json(BY_TYPE["UsageReported"])["final"] is False


def test_event_from_json_returns_a_fresh_dict(codec):
    event = copy.deepcopy(BY_TYPE["ChildReserved"])
    canonical = codec.event_from_json(event)
    canonical["quantities"]["tokens"] = 0
    assert event == BY_TYPE["ChildReserved"]


def _with(event_type, **changes):
    event = copy.deepcopy(BY_TYPE[event_type])
    for key, value in changes.items():
        if value is _DROP:
            del event[key]
        else:
            event[key] = value
    return event


_DROP = object()

BAD_EVENTS = [
    (_with("ChildReserved", quantities={"tokens": 12.5}),
     "ChildReserved.quantities.tokens: expected integer, got 12.5"),
    (_with("ChildReserved", quantities={"tokens": 12.0}),
     "ChildReserved.quantities.tokens: expected integer, got 12.0"),
    (_with("ChildReserved", quantities={"a": 1, "tokens": True}),
     "ChildReserved.quantities.tokens: expected integer, got true"),
    (_with("ChildReserved", quantities=[20]), "ChildReserved.quantities: expected object, got [20]"),
    (_with("ChildReserved", child_id=_DROP), "ChildReserved.child_id: missing required field"),
    (_with("ChildReserved", child_id=None), "ChildReserved.child_id: expected string, got null"),
    (_with("ChildReserved", child_id=7), "ChildReserved.child_id: expected string, got 7"),
    (_with("ChildReserved", priority=1), "ChildReserved.priority: unknown field"),
    (_with("ChildActivated", lease_generation="1"), 'ChildActivated.lease_generation: expected integer, got "1"'),
    (_with("ChildActivated", lease_ttl_ms=2**63),
     "ChildActivated.lease_ttl_ms: expected integer, got 9223372036854775808"),
    (_with("Tick", now_ms=1.7e12), "Tick.now_ms: expected integer, got 1700000000000.0"),
    (_with("Tick", event_id=_DROP), "Tick.event_id: missing required field"),
    (_with("Tick", now=1), "Tick.now: unknown field"),
    (_with("UsageReported", final=1), "UsageReported.final: expected boolean, got 1"),
    (_with("ChildFailed", usage=5), "ChildFailed.usage: expected object, got 5"),
    (_with("ChildFailed", usage={"tokens": None}), "ChildFailed.usage.tokens: expected integer, got null"),
    (_with("ChildFailed", retry_attempt_id=2), "ChildFailed.retry_attempt_id: expected string, got 2"),
    (_with("ParentReserved", capacity={"tokens": {"quantity": "100", "kind": "logical"}}),
     'ParentReserved.capacity.tokens.quantity: expected integer, got "100"'),
    (_with("ParentReserved", capacity={"tokens": {"quantity": 100}}),
     "ParentReserved.capacity.tokens.kind: missing required field"),
    (_with("ParentReserved", capacity={"tokens": {"quantity": 100, "kind": "logical", "unit": "tok"}}),
     "ParentReserved.capacity.tokens.unit: unknown field"),
    (_with("ParentReserved", policy={"max_live_children": 2**31, "reconciliation_timeout_ms": 1}),
     "ParentReserved.policy.max_live_children: expected 32-bit integer, got 2147483648"),
    (_with("ParentReserved", policy={"max_live_children": 1, "reconciliation_timeout_ms": 1, "lending_limit": None}),
     "ParentReserved.policy.lending_limit: expected object, got null"),
    (_with("ChildReserved", type="Nope"), 'type: unknown event type "Nope"'),
    (_with("ChildReserved", type=None), "type: unknown event type null"),
    (_with("ChildReserved", type=_DROP), "type: missing required field"),
    ([BY_TYPE["Tick"]], "expected a JSON object, got"),
    ("Tick", 'expected a JSON object, got "Tick"'),
]


@pytest.mark.parametrize(("obj", "message"), BAD_EVENTS, ids=[message for _, message in BAD_EVENTS])
def test_event_from_json_rejects_bad_input_naming_the_field(codec, obj, message):
    with pytest.raises(CodecError) as raised:
        codec.event_from_json(obj)
    assert str(raised.value).startswith(message)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_event_from_json_accepts_every_event_the_schema_accepts(codec, data):
    name = data.draw(st.sampled_from(EVENT_TYPES))
    schema = parsed(codec, name)
    event = {"type": name, **data.draw(strategy(schema, schema["__named_schemas"]))}
    canonical = codec.event_from_json(event)
    assert canonical == event
    assert codec.decode_event(codec.encode_event(canonical)) == canonical


# -- container files --------------------------------------------------------------------------------------------


def test_container_file_round_trip_through_a_path(tmp_path, codec):
    events = [codec.event_from_json(event) for event in TYPICAL_EVENTS]
    path = tmp_path / "events.avro"
    codec.write_container(path, events)
    assert list(codec.read_container(path)) == events
    assert list(codec.read_container(str(path))) == events


def test_container_file_is_readable_by_plain_fastavro(codec):
    events = [codec.event_from_json(event) for event in TYPICAL_EVENTS]
    buffer = io.BytesIO()
    codec.write_container(buffer, events)
    buffer.seek(0)
    records = list(fastavro.reader(buffer, return_record_name=True))
    assert [(name.rpartition(".")[2], {"type": name.rpartition(".")[2], **record}) for name, record in records] == [
        (event["type"], event) for event in events
    ]


def test_container_written_with_older_versions_reads_into_the_current_ones(codec):
    named = {}
    union = [load_schema(str(SCHEMA_DIR / "history" / "ChildFailed.v1.avsc"), named_schemas=named),
             load_schema(str(SCHEMA_DIR / "Tick.avsc"), named_schemas=named)]
    v1 = {key: value for key, value in codec.event_from_json(BY_TYPE["ChildFailed"]).items()
          if key not in ("type", "usage_uncertain", "retry_attempt_id")}
    tick = codec.event_from_json(BY_TYPE["Tick"])
    buffer = io.BytesIO()
    fastavro.writer(buffer, union, [("io.branchsettlement.events.ChildFailed", v1),
                                    ("io.branchsettlement.events.Tick", tick)])
    buffer.seek(0)
    events = list(codec.read_container(buffer))
    assert events == [{"type": "ChildFailed", **v1, "usage_uncertain": False, "retry_attempt_id": None}, tick]
    assert list(events[0]) == list(codec.event_from_json(BY_TYPE["ChildFailed"])), "fields in current order"


def test_container_of_a_single_event_record_schema(codec):
    ticks = [codec.event_from_json(dict(BY_TYPE["Tick"], now_ms=now)) for now in (1, 2, 3)]
    buffer = io.BytesIO()
    fastavro.writer(buffer, load_schema(str(SCHEMA_DIR / "Tick.avsc")), ticks)
    buffer.seek(0)
    assert list(codec.read_container(buffer)) == ticks


def test_container_errors_are_codec_errors(codec):
    with pytest.raises(CodecError, match="unknown event type"):
        codec.write_container(io.BytesIO(), [{"type": "Nope"}])
    with pytest.raises(CodecError, match="cannot read container"):
        list(codec.read_container(io.BytesIO(b"not an avro file")))
    buffer = io.BytesIO()
    fastavro.writer(buffer, load_schema(str(SCHEMA_DIR / "TimerRecord.avsc")),
                    [{"kind": "lease", "deadline_ms": 1, "parent_id": "p", "child_id": "c"}])
    buffer.seek(0)
    with pytest.raises(CodecError, match="TimerRecord, which is not an event record"):
        list(codec.read_container(buffer))


def test_a_child_record_written_before_earlier_attempts_consumed_reads_with_none() -> None:
    """A projection or changelog written before the field existed restores: the field reads as {}."""
    old = {"parent_id": "P", "child_id": "A", "branch_id": "A", "attempt_id": "A1", "state": "reserved",
           "activated": False, "lease_generation": 0, "lease_expires_at_ms": None, "reconcile_deadline_ms": None,
           "reserved": {"tokens": 20}, "consumed": {"tokens": 0}, "awaiting": {}, "awaiting_destination": {},
           "escalated": {}, "usage_report_ids": []}
    name, record = default_codec().decode(single_object(SCHEMA_DIR / "history" / "LedgerChild.v1.avsc", old))
    assert name == "LedgerChild"
    assert record == {**old, "earlier_attempts_consumed": {}}


def test_a_parent_record_written_before_loans_reads_with_none_and_folds_on() -> None:
    """A projection or changelog written before borrowing restores: `loans` reads as [], and the parent lends
    and closes as any other."""
    from branch_settlement.projections import model
    old = model.new_parent("P", {"tokens": {"quantity": 100, "kind": "logical"}}, 5,
                           {"max_live_children": 4, "reconciliation_timeout_ms": 10, "lending_limit": {"tokens": 10}})
    del old["loans"]
    data = single_object(SCHEMA_DIR / "history" / "LedgerParent.v1.avsc", old)
    name, record = default_codec().decode(data)
    assert name == "LedgerParent"
    assert record == {**old, "loans": []}
    from branch_settlement.processors.ledger.fold import Fold
    from branch_settlement.processors.ledger.outputs import Outputs
    from branch_settlement.processors.replay.replayer import open_view
    from branch_settlement.projections import keys
    from branch_settlement.projections.store import MemoryStore
    store = MemoryStore()
    store.write([(keys.parent_key("P"), data)], 0)
    fold = Fold(open_view(store, default_codec()))
    loan = default_codec().event_from_json({"type": "LoanRequested", "event_id": "e", "parent_id": "P",
                                            "idempotency_key": "P/loan/L1/request", "occurred_at_ms": 0,
                                            "loan_id": "L1", "borrower": "b", "quantities": {"tokens": 10}})
    assert fold.apply(loan, 0, Outputs())["result"] == "ok"
    assert fold.view.parent("P")["dimensions"]["tokens"]["lent"] == 10
