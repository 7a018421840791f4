"""The fast paths of the fold's hot loop give exactly what the plain paths gave.

- `Codec.encode` writes records with compiled writers (schemas/codec.py) and leaves to fastavro anything that is
  not a plain value: whatever a record holds, its bytes (or its CodecError) must be fastavro's.
"""

import io

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processors.fold import Fold
from processors.outputs import Outputs
from processors.workload import Generator, Mix
from projections.store import MemoryStore
from projections.view import LedgerView
from schemas import EVENT_TYPES, LEDGER_TYPES, OUTPUT_TYPES, CodecError, default_codec
from tests.test_codec import sample, strategy

pytestmark = pytest.mark.unit

ALL_TYPES = EVENT_TYPES + OUTPUT_TYPES + LEDGER_TYPES


@pytest.fixture(scope="module")
def codec():
    return default_codec()


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
