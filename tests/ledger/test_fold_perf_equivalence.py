"""The fast paths of the fold's hot loop give exactly what the plain paths gave.

- `Codec.encode` writes records with compiled writers (schemas/codegen.py) and leaves to fastavro anything that is
  not a plain value: whatever a record holds, its bytes (or its CodecError) must be fastavro's.
"""

import io

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.outputs import Outputs
from branch_settlement.processors.workload import Generator, Mix
from branch_settlement.projections.store import MemoryStore
from branch_settlement.projections.view import LedgerView
from branch_settlement.schemas import EVENT_TYPES, LEDGER_TYPES, OUTPUT_TYPES, CodecError, native
from branch_settlement.schemas.codec import Codec
from tests.schemas.test_codec import sample, strategy

pytestmark = pytest.mark.unit

ALL_TYPES = EVENT_TYPES + OUTPUT_TYPES + LEDGER_TYPES


@pytest.fixture(scope="module", params=[native.COMPILED, native.PYTHON])
def codec(request):
    """Each implementation's codec (schemas/native.py), held to fastavro alike; the compiled one must be built."""
    if request.param == native.COMPILED and native.module() is None:
        pytest.fail("the compiled implementation is not installed: `make install` builds it (native/)")
    return Codec(implementation=request.param)


def fastavro_bytes(codec, name, record):
    """The single-object encoding as fastavro writes it, or the exception type it raises."""
    version = codec.version(name)
    body = io.BytesIO()
    try:
        fastavro.schemaless_writer(body, version.parsed, record)
    except Exception as exc:
        return type(exc)
    return version.header + body.getvalue()


def codec_bytes(codec, name, record):
    try:
        return codec.encode(name, record)
    except CodecError as exc:
        return type(exc.__cause__)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_a_representative_record_encodes_as_fastavro_does(codec, name):
    schema = codec.version(name).parsed
    record = sample(schema, schema["__named_schemas"])
    assert codec.encode(name, record) == fastavro_bytes(codec, name, record)


@settings(max_examples=1500, deadline=None)
@given(st.data())
def test_any_valid_record_encodes_as_fastavro_does(codec, data):
    name = data.draw(st.sampled_from(ALL_TYPES))
    schema = codec.version(name).parsed
    record = data.draw(strategy(schema, schema["__named_schemas"]))
    assert codec.encode(name, record) == fastavro_bytes(codec, name, record)


# Values that are not plain for some or every Avro type: fastavro takes some of them (a float or a bool for a
# long, a tuple or a string for an array, an int for a boolean, a str subclass) and rejects the others.
class Label(str):
    pass


ODD_VALUES = [None, True, False, 0, 1, 2, -1, 2**40, 2**63, -(2**63), -(2**63) - 1, 1.0, 2.5, "", "x", Label("x"),
              "\ud800", b"", b"x", bytearray(b"x"), ("a",), ["a"], [1], [], {}, {"tokens": 1}, {"tokens": True},
              {"tokens": 1.5}, {"tokens": "x"}, {1: 2}, {"tokens": None}]
MISSING = object()


def positions(value, path=()):
    """Every place in a record where a value sits: fields, map values, array items, nested records."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield path + (key,)
            yield from positions(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield path + (index,)
            yield from positions(item, path + (index,))


def replaced(record, path, value):
    """A deep copy of `record` with `value` at `path` (MISSING deletes it)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    copy = dict(record) if isinstance(record, dict) else list(record)
    if value is MISSING and not rest:
        del copy[head]
    else:
        copy[head] = replaced(record[head], rest, value)
    return copy


@pytest.mark.parametrize("name", ALL_TYPES)
def test_an_odd_value_anywhere_encodes_or_fails_as_fastavro_does(codec, name):
    schema = codec.version(name).parsed
    record = sample(schema, schema["__named_schemas"])
    for path in positions(record):
        for value in [*ODD_VALUES, MISSING]:
            odd = replaced(record, path, value)
            expected = fastavro_bytes(codec, name, odd)
            actual = codec_bytes(codec, name, odd)
            if isinstance(expected, bytes):
                assert actual == expected, (path, value)
            else:
                assert not isinstance(actual, bytes), f"{path} = {value!r}: fastavro raises {expected.__name__}"


def test_a_record_that_is_not_a_dict_fails_as_with_fastavro(codec):
    for name in ALL_TYPES:
        for value in (None, [], "x", 1):
            assert not isinstance(fastavro_bytes(codec, name, value), bytes)
            with pytest.raises(CodecError, match=f"{name}: cannot encode"):
                codec.encode(name, value)


def test_every_record_of_a_realistic_workload_encodes_as_fastavro_does(codec):
    def encode(name, record):
        data = codec.encode(name, record)
        assert data == fastavro_bytes(codec, name, record)
        return data

    stress = Mix(retries=0.25, speculative=0.2, timeouts=0.15, skips=0.1, duplicates=0.15, malformed=0.0)
    events = [codec.event_from_json(r) for r in Generator(11, stress).generate(3000) if not isinstance(r, str)]
    store = MemoryStore()
    view = LedgerView(store, encode, codec.decode)
    fold = Fold(view)
    out = Outputs()
    for offset, event in enumerate(events):
        encode(event["type"], event)
        fold.apply(event, offset, out)
        if offset % 100 == 99 or offset == len(events) - 1:
            for records, name in ((out.results, "SettlementResult"), (out.releases, "CapacityReleased"),
                                  (out.audits, "AuditRecord"), (out.settled, "ParentSettled")):
                for record in records:
                    encode(name, record)
            out.clear()
            store.write(view.changes(), offset)
            view.mark_committed()


# - `Codec.decode` and `Codec.decode_event` read bytes written with a current schema with generated readers and
#   leave anything unusual to fastavro: whatever the bytes, the record (with its key order and types) or the
#   CodecError (with its message) must be the one the plain fastavro path gives. One difference on purpose: a
#   varint beyond 64 bits, which fastavro wraps around to a small number or fails on later, is refused at once.


def outcome(decode, data):
    """repr of what `decode` returns (repr shows key order, bool vs int, bytes vs str), or the error message."""
    try:
        return repr(decode(data))
    except CodecError as exc:
        return f"CodecError: {exc}"


def plain_event(codec, data):
    name, record = codec._decode_with_fastavro(data)
    if name not in EVENT_TYPES:
        raise CodecError(f"{name} is not an event")
    return {"type": name, **record}


VARINT_BEYOND_64_BITS = "beyond the 64 bits of an Avro long"


def assert_decodes_as_fastavro(codec, data):
    fast = outcome(codec.decode, data)
    if VARINT_BEYOND_64_BITS in fast:
        assert outcome(codec.decode_event, data).startswith("CodecError: "), data
        return
    assert fast == outcome(codec._decode_with_fastavro, data), data
    assert outcome(codec.decode_event, data) == outcome(lambda d: plain_event(codec, d), data), data


def mangled(data):
    """Truncations, trailing bytes and single-byte changes of every body byte."""
    yield data + b"\x00"
    yield data + b"\x02\x41"
    for cut in range(10, len(data)):
        yield data[:cut]
    for index in range(10, len(data)):
        for value in {0x00, 0x01, 0x02, 0x03, 0x7F, 0x80, 0x81, 0xFF, data[index] ^ 0x01, data[index] ^ 0x80}:
            yield data[:index] + bytes([value]) + data[index + 1:]


@pytest.mark.parametrize("name", ALL_TYPES)
def test_a_representative_record_and_every_mangled_copy_decode_as_with_fastavro(codec, name):
    schema = codec.version(name).parsed
    data = codec.encode(name, sample(schema, schema["__named_schemas"]))
    assert_decodes_as_fastavro(codec, data)
    generated = codec._fast_readers[data[2:10]][1]  # the generated reader takes it: nothing left to fastavro
    assert repr(generated(data)) == repr(codec._decode_with_fastavro(data)[1])
    for bad in mangled(data):
        assert_decodes_as_fastavro(codec, bad)


@settings(max_examples=1500, deadline=None)
@given(st.data())
def test_any_valid_record_decodes_as_with_fastavro(codec, data):
    name = data.draw(st.sampled_from(ALL_TYPES))
    schema = codec.version(name).parsed
    encoded = codec.encode(name, data.draw(strategy(schema, schema["__named_schemas"])))
    assert_decodes_as_fastavro(codec, encoded)
    index = data.draw(st.integers(10, max(10, len(encoded) - 1)))
    value = data.draw(st.integers(0, 255))
    assert_decodes_as_fastavro(codec, encoded[:index] + bytes([value]) + encoded[index + 1:])


def test_long_strings_large_maps_and_arrays_and_odd_encodings_decode_as_with_fastavro(codec):
    parent = sample(codec.version("LedgerParent").parsed, codec.version("LedgerParent").parsed["__named_schemas"])
    parent["parent_id"] = "p" * 300 + "é"
    parent["children"] = [f"child-{i}" for i in range(200)]
    parent["lending_limit"] = {f"dim-{i}": i * 1000 for i in range(100)}
    parent["lease_expires_at_ms"] = -(2**63)
    parent["max_live_children"] = 2**63 - 1
    data = codec.encode("LedgerParent", parent)
    assert codec.decode(data) == ("LedgerParent", parent)
    assert_decodes_as_fastavro(codec, data)
    header = codec.version("Tick").header
    tick = codec.encode_event({"type": "Tick", "event_id": "e", "idempotency_key": "k", "parent_id": "",
                               "occurred_at_ms": 1, "now_ms": 5})
    body = tick[len(header):]
    overlong = header + body[:-1] + b"\x8a\x80\x80\x00"  # now_ms 5 as a four-byte varint: fastavro takes it
    past_64_bits = header + body[:-1] + b"\xff" * 10 + b"\x7f"
    sized_block = codec.version("ChildReserved").header  # a map written as a block with a byte size
    reserved = codec.encode_event({"type": "ChildReserved", "event_id": "e", "idempotency_key": "k",
                                   "parent_id": "p", "occurred_at_ms": 1, "child_id": "c", "branch_id": "b",
                                   "attempt_id": "a", "quantities": {"t": 1}})
    assert reserved.endswith(b"\x02\x02t\x02\x00")
    sized = reserved[:-5] + b"\x01\x08\x02t\x02\x00"
    for data in (overlong, past_64_bits, sized, sized_block + b"\x00" * 3):
        assert_decodes_as_fastavro(codec, data)
    assert codec.decode_event(overlong)["now_ms"] == 5


def test_decode_takes_bytes_like_objects_as_before(codec):
    data = codec.encode("AuditRecord", sample(codec.version("AuditRecord").parsed, {}))
    for wrapped in (bytearray(data), memoryview(data)):
        assert codec.decode(wrapped) == codec.decode(data)


def test_encoder_gives_the_bytes_and_errors_of_encode(codec):
    for name in ALL_TYPES:
        schema = codec.version(name).parsed
        record = sample(schema, schema["__named_schemas"])
        assert codec.encoder(name)(record) == codec.encode(name, record)
        odd = dict(record)
        odd[next(iter(odd))] = 1.5
        assert codec_bytes(codec, name, odd) == (lambda: _encoder_bytes(codec, name, odd))()
    with pytest.raises(CodecError, match="unknown record name"):
        codec.encoder("Nope")


def _encoder_bytes(codec, name, record):
    try:
        return codec.encoder(name)(record)
    except CodecError as exc:
        return type(exc.__cause__)


# - The fold's per-event checks: `validate` answers as the full check `_problem` does, and `payload_digest` digests
#   exactly the text json.dumps gives (the generated sorted-keys writers of schemas/event_json.py are not sure of
#   anything unusual and leave it to json.dumps), for any event, odd values included.

ODD_EVENT_VALUES = [None, True, False, 0, -1, 2**70, 1.5, "", "x", "x\x00y", 'q"uote', "back\\slash", "tab\there",
                    "new\nline", "\x7f", "é", "\u2028", "\ud800", Label("x"), b"x", [], ["a"], {}, {"tokens": 1},
                    {"tokens": -1}, {"": 1}, {"a\x00": 1}, {"tokens": True}, {"tokens": 1.0}, {1: 2}, {"b": 1, "a": 2},
                    {"tokens": {"quantity": 1, "kind": "logical"}}]


def outcome_of(function, *args):
    try:
        return "ok", function(*args)
    except Exception as exc:  # the same exception type, whichever path raised it
        return "raised", type(exc)


def reference_digest(event):
    import hashlib

    from branch_settlement.processors.ledger.fold import _canonical_json

    return hashlib.blake2b(_canonical_json(event).encode(), digest_size=16).digest()


def assert_checks_as_before(event):
    from branch_settlement.processors.ledger.fold import payload_digest
    from branch_settlement.processors.ledger.validation import _problem, validate

    assert outcome_of(validate, event) == outcome_of(_problem, event), event
    assert outcome_of(payload_digest, event) == outcome_of(reference_digest, event), event


def event_strategy(codec):
    return st.sampled_from(EVENT_TYPES).flatmap(
        lambda name: strategy(codec.version(name).parsed, codec.version(name).parsed["__named_schemas"]).map(
            lambda record: {"type": name, **record}))


@settings(max_examples=2000, deadline=None)
@given(st.data())
def test_validate_and_payload_digest_agree_with_the_plain_path_for_any_event(codec, data):
    event = data.draw(event_strategy(codec))
    assert_checks_as_before(event)
    field = data.draw(st.sampled_from(sorted(event)))
    odd = dict(event)
    odd[field] = data.draw(st.sampled_from(ODD_EVENT_VALUES))
    assert_checks_as_before(odd)
    missing = dict(event)
    del missing[field]
    assert_checks_as_before(missing)
    assert_checks_as_before({**event, "extra": 1})


def test_validate_and_payload_digest_agree_on_a_realistic_workload_with_odd_values_everywhere(codec):
    events = [codec.event_from_json(r) for r in Generator(5).generate(1500) if not isinstance(r, str)]
    for index, event in enumerate(events):
        assert_checks_as_before(event)
        for field in event:
            odd = dict(event)
            odd[field] = ODD_EVENT_VALUES[(index + len(field)) % len(ODD_EVENT_VALUES)]
            assert_checks_as_before(odd)


@pytest.mark.parametrize("value", ODD_EVENT_VALUES)
def test_every_odd_value_in_every_field_of_every_typical_event(codec, value):
    from tests.schemas.test_codec import TYPICAL_EVENTS

    for event in TYPICAL_EVENTS:
        event = codec.event_from_json(event)
        for field in event:
            assert_checks_as_before({**event, field: value})
        for field in ("quantities", "usage", "capacity", "policy"):
            if field in event and isinstance(event[field], dict):
                for key in list(event[field]) or ["tokens"]:
                    assert_checks_as_before({**event, field: {**event[field], key: value}})


def test_the_fast_checks_take_every_plain_event_of_a_realistic_workload(codec):
    from branch_settlement.processors.ledger.fold import _SORTED_JSON
    from branch_settlement.processors.ledger.validation import _plainly_valid

    events = [codec.event_from_json(r) for r in Generator(5).generate(1500) if not isinstance(r, str)]
    for event in events:
        assert _SORTED_JSON[event["type"]](event) is not None, event
        if event["type"] not in ("Tick", "ParentReserved"):
            assert _plainly_valid(event), event


def test_the_encoding_caches_stay_bounded(codec):
    from branch_settlement.schemas import codegen

    letter = {"source_topic": "t", "partition": 0, "offset": 1, "original": b"x" * 10_000, "reason": "r" * 5000,
              "line": 7, "event_id": None}
    fast = codec.encode("DeadLetter", letter)
    assert fast == fastavro_bytes(codec, "DeadLetter", letter)
    assert "r" * 5000 not in codegen._string_cache  # long strings are encoded, not kept
    for index in range(codegen._STRING_CACHE_MAX + 10):
        codec.encode("TimerRecord", {"kind": "child_lease", "deadline_ms": index, "parent_id": f"p{index}",
                                     "child_id": ""})
    assert len(codegen._string_cache) <= codegen._STRING_CACHE_MAX
    assert len(codegen._long_cache) <= codegen._LONG_CACHE_MAX
