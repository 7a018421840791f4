"""The input boundary (schemas/limits.py): every field has a range, no sum the fold computes can overflow, every
record the fold writes fits a topic's message size, and input the wire format cannot hold exactly is refused at
decode. Each hostile input gets a result or a dead letter; nothing raises, nothing else changes, and good events
after it still settle."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from branch_settlement.processors.kafka.partition import PartitionTask
from branch_settlement.projections import model
from branch_settlement.projections.store import MemoryStore
import fastavro

from branch_settlement.schemas.codec import SCHEMA_DIR, Codec, default_codec
from branch_settlement.schemas.confluent import ConfluentCodec, StaticSchemas, frame
from branch_settlement.schemas.registry import load_registry
from branch_settlement.schemas.errors import CodecError
from branch_settlement.schemas.limits import (DEAD_LETTER_ORIGINAL_BYTES, MAX_BALANCE, MAX_CHILDREN_PER_PARENT,
                                              MAX_DIMENSIONS, MAX_EVENT_BYTES, MAX_ID_BYTES, MAX_KEY_BYTES,
                                                              MAX_LEASE_GENERATION, MAX_LOANS_PER_PARENT, MAX_QUANTITY,
                                              MAX_TIME_MS, MAX_TTL_MS, MAX_USAGE_REPORTS_PER_ATTEMPT)
from tests.harness import T0, Ledger

pytestmark = pytest.mark.unit

TOPIC_MAX_MESSAGE_BYTES = 1_048_588  # Kafka's default max.message.bytes


def running() -> Ledger:
    L = Ledger()
    L.tick(T0)
    assert L.open_parent() == "ok"
    assert L.reserve("A") == "ok"
    assert L.activate("A") == "ok"
    return L


def unchanged(L: Ledger, before: dict) -> None:
    assert L.balance() == before


@pytest.mark.parametrize("field,value", [
    ("child_id", "x" * (MAX_ID_BYTES + 1)),
    ("child_id", "é" * (MAX_ID_BYTES // 2 + 1)),  # two bytes each in UTF-8
    ("attempt_id", "a" * 10_000),
    ("branch_id", ""),
])
def test_ids_beyond_their_size_are_invalid(field: str, value: str) -> None:
    L = running()
    before = L.balance()
    fields = dict(child_id="B", branch_id="B", attempt_id="B1", quantities={"tokens": 1})
    fields[field] = value
    assert L.send("ChildReserved", **fields) == "invalid_event"
    assert "bytes of UTF-8" in L.out.results[-1]["detail"] or field == "branch_id"
    unchanged(L, before)
    assert L.reserve("B") == "ok"


def test_an_id_at_its_limit_is_valid() -> None:
    L = running()
    assert L.reserve("é" * (MAX_ID_BYTES // 2), attempt="a" * MAX_ID_BYTES, branch="b" * MAX_ID_BYTES) == "ok"


def test_an_idempotency_key_made_of_four_ids_at_their_limit_is_valid() -> None:
    """SPEC builds a child event's key as parent/child/attempt/version: its limit is a few ids long."""
    L = running()
    key = "/".join(["p" * MAX_ID_BYTES, "c" * MAX_ID_BYTES, "a" * MAX_ID_BYTES, "1"])
    assert L.send("CancelRequested", key=key, child_id="A", attempt_id="A1", reason="r") == "ok"
    assert L.send("CancelRequested", key="k" * (MAX_KEY_BYTES + 1), child_id="A", attempt_id="A1",
                  reason="r") == "invalid_event"


def test_a_long_reason_does_not_lose_the_settlement() -> None:
    """A failure's reason may be a stack trace: the event's size bounds it, and the confirmed usage settles."""
    L = running()
    assert L.send("ChildFailed", child_id="A", attempt_id="A1", lease_generation=1, activated=True,
                  usage={"tokens": 3}, reason="Traceback ...\n" * 2_000) == "ok"
    assert L.balance()["committed"] == 3


def test_an_empty_retry_attempt_means_no_retry() -> None:
    L = running()
    assert L.send("ChildFailed", child_id="A", attempt_id="A1", lease_generation=1, activated=True,
                  usage={"tokens": 3}, reason="boom", retry_attempt_id="") == "ok"
    assert L.state("A") == "released"


@pytest.mark.parametrize("etype,fields,detail", [
    ("UsageReported", dict(child_id="A", attempt_id="A1", lease_generation=1, usage_report_id="r",
                           usage={"tokens": MAX_QUANTITY + 1}), "quantity must be an integer from 0"),
    ("ChildActivated", dict(child_id="A", attempt_id="A1", lease_generation=1, lease_ttl_ms=MAX_TTL_MS + 1),
     "lease_ttl_ms"),
    ("LeaseRenewed", dict(child_id="A", attempt_id="A1", lease_generation=MAX_LEASE_GENERATION + 1,
                          lease_ttl_ms=1), "lease_generation"),
    ("UsageReported", dict(child_id="A", attempt_id="A1", lease_generation=1, usage_report_id="r",
                           usage={f"d{i}": 0 for i in range(MAX_DIMENSIONS + 1)}), "dimensions, at most"),
    ("LoanRequested", dict(key="P/loan/L1/request", loan_id="L1", borrower="b", quantities={"tokens": MAX_QUANTITY + 1}),
     "quantity must be an integer from 0"),
    ("LoanRequested", dict(key="P/loan/L1/request", loan_id="L1", borrower="b" * (MAX_ID_BYTES + 1),
                           quantities={"tokens": 1}), "borrower must be non-empty"),
    ("LoanRequested", dict(key=f"P/loan/{'L' * (MAX_ID_BYTES + 1)}/request", loan_id="L" * (MAX_ID_BYTES + 1),
                           borrower="b", quantities={"tokens": 1}), "loan_id must be non-empty"),
    ("LoanReturned", dict(key="P/loan/L1/return", loan_id="L1", usage={"tokens": -1}),
     "quantity must be an integer from 0"),
    ("LoanReturned", dict(key="P/loan//return", loan_id="", usage={}), "loan_id must be non-empty"),
])
def test_values_beyond_their_range_are_invalid(etype: str, fields: dict, detail: str) -> None:
    L = running()
    before = L.balance()
    assert L.send(etype, **fields) == "invalid_event", L.out.results[-1]["detail"]
    assert detail in L.out.results[-1]["detail"]
    unchanged(L, before)


def test_a_tick_beyond_the_time_limit_is_invalid_and_time_stands() -> None:
    L = running()
    assert L.tick(MAX_TIME_MS + 1) == "invalid_event"
    assert L.view.meta["ledger_time_ms"] == T0
    assert L.tick(T0 + 1) == "ok"


def test_a_lease_of_the_longest_ttl_expires_without_overflow() -> None:
    L = Ledger()
    L.tick(T0)
    assert L.open_parent(lease_ttl_ms=MAX_TTL_MS) == "ok"
    assert L.reserve("A") == "ok"
    assert L.activate("A", lease_ttl_ms=MAX_TTL_MS) == "ok"
    assert L.tick(MAX_TIME_MS) == "ok"  # past both: the child expires, the parent expires
    assert L.state("A") == "reconciling"
    assert L.status() == "expired"


def test_a_parent_takes_at_most_its_limit_of_children() -> None:
    L = Ledger()
    L.tick(T0)
    assert L.open_parent(tokens=MAX_CHILDREN_PER_PARENT + 1) == "ok"
    for n in range(MAX_CHILDREN_PER_PARENT):
        assert L.reserve(f"c{n}", tokens=1) == "ok"
        assert L.send("ChildSkipped", child_id=f"c{n}", attempt_id=f"c{n}1", reason="-") == "ok"
    before = L.balance()
    assert L.reserve("one-too-many", tokens=1) == "limit_exceeded"
    unchanged(L, before)


def test_an_attempt_takes_at_most_its_limit_of_usage_reports() -> None:
    L = Ledger()
    L.tick(T0)
    assert L.open_parent(tokens=10) == "ok"
    assert L.reserve("A", tokens=10) == "ok"
    assert L.activate("A") == "ok"
    for n in range(MAX_USAGE_REPORTS_PER_ATTEMPT):
        assert L.send("UsageReported", child_id="A", attempt_id="A1", lease_generation=1, usage_report_id=f"r{n}",
                      usage={"tokens": 0}) == "ok"
    assert L.send("UsageReported", child_id="A", attempt_id="A1", lease_generation=1, usage_report_id="last",
                  usage={"tokens": 1}) == "limit_exceeded"
    assert L.send("UsageReported", child_id="A", attempt_id="A1", lease_generation=1, usage_report_id="final",
                  usage={"tokens": 4}, final=True) == "ok"  # a final report still settles it
    assert L.balance()["committed"] == 4


def test_no_balance_term_can_grow_past_its_headroom() -> None:
    """Adjustments beyond the parent are overdrawn, each at most MAX_QUANTITY: the one that would take a term
    past MAX_BALANCE is limit_exceeded, and nothing changes."""
    L = Ledger()
    L.tick(T0)
    assert L.open_parent(tokens=1) == "ok"
    assert L.reserve("A", tokens=1) == "ok"
    assert L.send("ChildSkipped", child_id="A", attempt_id="A1", reason="-") == "ok"
    codes = []
    for n in range(MAX_BALANCE // MAX_QUANTITY + 2):
        codes.append(L.send("UsageAdjustment", child_id="A", attempt_id="A1", usage={"tokens": MAX_QUANTITY},
                            reason="invoice"))
        if codes[-1] == "limit_exceeded":
            break
    assert codes[-1] == "limit_exceeded" and set(codes[:-1]) == {"overdrawn"}
    balance = L.balance()
    assert balance["overdrawn"] + MAX_QUANTITY > MAX_BALANCE >= balance["overdrawn"]
    assert balance["committed"] < 2**63


# -- decode --------------------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@pytest.mark.parametrize("forged", [2**64 + 10, 2**70])
def test_a_varint_beyond_64_bits_is_refused_not_wrapped(forged: int) -> None:
    codec = default_codec()
    event = codec.event_from_json({"type": "ChildReserved", "event_id": "e", "idempotency_key": "k",
                                   "parent_id": "P", "occurred_at_ms": 0, "child_id": "A", "branch_id": "A",
                                   "attempt_id": "A1", "quantities": {"tokens": 5}})
    data = codec.encode_event(event)
    at = data.rindex(_varint(10))  # zigzag(5), the last value of the record
    with pytest.raises(CodecError, match="beyond the 64 bits"):
        codec.decode_event(data[:at] + _varint(forged) + data[at + 1:])


def _zigzag(value: int) -> bytes:
    return _varint((value << 1) ^ (value >> 63))


def _quantities_in_a_sized_block(data: bytes, key: bytes, forged: bytes) -> bytes:
    """`data` (a record whose last field is a one-entry map `key` -> long) with that map written as one sized
    block (a negative count, then its byte size) holding `forged` as the value: bytes the generated readers leave
    to fastavro, which reads such blocks."""
    at = data.rindex(b"\x02" + _zigzag(len(key))[0:1] + key)
    entry = _zigzag(len(key)) + key + forged
    return data[:at] + _zigzag(-1) + _zigzag(len(entry)) + entry + b"\x00"


@pytest.mark.parametrize("implementation", ["compiled", "python"])
@pytest.mark.parametrize("forged", [2**64 + 10, 2**64 + 5, 2**70])
def test_a_varint_beyond_64_bits_is_refused_where_fastavro_reads_too(forged: int, implementation: str) -> None:
    """A sized block, an older writer schema, a Confluent frame of another version and a container file are read
    by fastavro, which wraps such a varint around (2**64 + 10 would be booked as 5): each is refused first."""
    codec = Codec(implementation=implementation)
    event = codec.event_from_json({"type": "ChildReserved", "event_id": "e", "idempotency_key": "k",
                                   "parent_id": "P", "occurred_at_ms": 0, "child_id": "A", "branch_id": "A",
                                   "attempt_id": "A1", "quantities": {"tokens": 5}})
    data = codec.encode_event(event)
    sized = _quantities_in_a_sized_block(data, b"tokens", _zigzag(5))
    assert codec.decode_event(sized)["quantities"] == {"tokens": 5}  # fastavro reads the sized block
    with pytest.raises(CodecError, match="beyond the 64 bits"):
        codec.decode_event(_quantities_in_a_sized_block(data, b"tokens", _varint(forged)))
    # ChildFailed as its first version wrote it (schemas/history): usage is its last map but one
    old = next(v for v in load_registry(SCHEMA_DIR).by_fingerprint.values()
               if v.name == "ChildFailed" and not v.current)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, old.parsed, {"event_id": "f", "idempotency_key": "k", "parent_id": "P",
                                                  "occurred_at_ms": 0, "child_id": "A", "attempt_id": "A1",
                                                  "lease_generation": 1, "activated": True,
                                                  "usage": {"tokens": 5}, "reason": ""})
    v1 = old.header + body.getvalue()
    assert codec.decode_event(v1)["usage"] == {"tokens": 5}
    at = v1.rindex(_zigzag(5) + b"\x00")
    with pytest.raises(CodecError, match="beyond the 64 bits"):
        codec.decode_event(v1[:at] + _varint(forged) + v1[at + 1:])
    # a Confluent frame of a version known only to the registry (the v1 schema under id 7)
    confluent = ConfluentCodec(StaticSchemas({7: old.source.read_text()}),
                               implementation=implementation)
    framed = frame(7, v1[10:])
    assert confluent.decode_event(framed)["usage"] == {"tokens": 5}
    at = framed.rindex(_zigzag(5) + b"\x00")
    with pytest.raises(CodecError, match="beyond the 64 bits"):
        confluent.decode_event(framed[:at] + _varint(forged) + framed[at + 1:])
    # a container file: the value forged in its (uncompressed) block
    buffer = io.BytesIO()
    codec.write_container(buffer, [event])
    container = buffer.getvalue()
    sync = container[-16:]  # header | sync | count | size | block | sync
    start = container.index(sync) + 16
    count, size = container[start], container[start + 1]  # one record, a block of fewer than 64 bytes
    block = container[start + 2:start + 2 + size // 2]
    at = block.index(b"\x0ctokens\x0a") + 7
    block = block[:at] + _varint(forged) + block[at + 1:]
    forged_file = container[:start] + bytes([count]) + _zigzag(len(block)) + block + sync
    with pytest.raises(CodecError, match="beyond the 64 bits"):
        list(codec.read_container(io.BytesIO(forged_file)))


# Hostile blocks on the paths fastavro reads (review findings): each is run in a process of its own with a time
# limit, because what they guard against is a loop that never ends.
_HOSTILE_BLOCKS = r"""
import io, json, sys
import fastavro
from branch_settlement.schemas.codec import Codec
from branch_settlement.schemas.confluent import ConfluentCodec, StaticSchemas, frame, standalone_schemas
from branch_settlement.schemas.codegen import _varint as varint  # zig-zag, within a long
from branch_settlement.schemas.errors import CodecError

codec = Codec(implementation=sys.argv[2])
tick = codec.encode("Tick", {"event_id": "e", "idempotency_key": "k", "parent_id": "", "occurred_at_ms": 1,
                             "now_ms": 2})[10:]
case = sys.argv[1]
try:
    if case == "boolean-array":  # a registry's version of Tick with an array of booleans, 2**62 of them
        schema = json.loads(standalone_schemas()["Tick"])
        schema["fields"].append({"name": "flags", "type": {"type": "array", "items": "boolean"}, "default": []})
        confluent = ConfluentCodec(StaticSchemas({7: json.dumps(schema)}), implementation=sys.argv[2])
        assert confluent.decode_event(frame(7, tick + b"\x02\x01\x00"))["now_ms"] == 2
        confluent.decode_event(frame(7, tick + varint(2**62 - 1)))
    elif case == "container-count":  # a container block that claims 2**62 records
        buffer = io.BytesIO()
        codec.write_container(buffer, [codec.event_from_json({"type": "Tick", "event_id": "e",
                                       "idempotency_key": "k", "parent_id": "", "occurred_at_ms": 1, "now_ms": 2})])
        data = buffer.getvalue()
        sync = data[-16:]
        start = data.index(sync) + 16
        size = data[start + 1] // 2
        hostile = data[:start] + varint(2**62 - 1) + data[start + 1:start + 2 + size] + sync
        list(codec.read_container(io.BytesIO(hostile)))
    elif case == "sized-block":  # a version of ChildReserved that fastavro skips a field of by its byte size
        schema = json.loads(standalone_schemas()["ChildReserved"])
        at = [f["name"] for f in schema["fields"]].index("quantities")
        schema["fields"].insert(at, {"name": "junk", "type": {"type": "array", "items": "string"}, "default": []})
        confluent = ConfluentCodec(StaticSchemas({9: json.dumps(schema)}), implementation=sys.argv[2])
        head = b"".join(varint(len(v)) + v for v in (b"e", b"k", b"P")) + varint(1) + b"".join(
            varint(len(v)) + v for v in (b"c", b"b", b"a"))
        forged = bytes([0xFF] * 9) + b"\x02"  # 2**64 + ...: wrapped around by fastavro
        entries = b"\x02b" + forged
        # the sized block says 0 bytes: fastavro would skip nothing, then read 'junk''s items as the quantities
        body = head + varint(-1) + varint(0) + varint(2) + b"\x02a" + varint(len(entries)) + entries + b"\x00"
        print(confluent.decode_event(frame(9, body)))
    elif case == "long-varint":  # a megabyte of continuation bytes: refused in linear time, on both paths
        hostile = codec.version("Tick").header + tick[:-1] + b"\x80" * 1_000_000 + b"\x01"
        for decode in (codec.decode, codec._decode_with_fastavro):
            try:
                decode(hostile)
                print("no error")
                sys.exit(0)
            except CodecError as exc:
                assert "beyond the 64 bits" in str(exc), exc
        codec._decode_with_fastavro(hostile)
    print("no error")
except CodecError as exc:
    print(f"CodecError: {exc}")
"""


@pytest.mark.parametrize("implementation", ["compiled", "python"])
@pytest.mark.parametrize("case, refusal", [
    ("boolean-array", "a block of 4611686018427387903 items at byte"),
    ("container-count", "4611686018427387903 records in"),
    ("sized-block", "says it is 0 bytes long, its items take"),
    ("long-varint", "beyond the 64 bits of an Avro long"),
])
def test_a_hostile_block_is_refused_not_looped_over(case: str, refusal: str, implementation: str) -> None:
    done = subprocess.run([sys.executable, "-c", _HOSTILE_BLOCKS, case, implementation], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CodecError: ") and refusal in done.stdout, done.stdout


def test_a_union_of_two_nulls_is_left_to_the_generated_writer() -> None:
    """A null spelled as a type object beside "null": the plan refuses it, so the compiled codec writes it with
    the generated Python writer, byte for byte (an Encoder given such a plan refuses it too)."""
    from branch_settlement.schemas import codegen, native

    schema = fastavro.parse_schema({"type": "record", "name": "N", "fields": [
        {"name": "x", "type": [{"type": "null"}, "null"]}]})
    compiled = codegen.compile_encoder(schema, b"H", native.COMPILED)
    assert not isinstance(compiled, native.module().Encoder)
    assert compiled({"x": None}) == codegen.compile_encoder(schema, b"H", native.PYTHON)({"x": None})
    with pytest.raises(ValueError, match="a writer's union plan is null and one other type"):
        native.module().Encoder((5, ("x",), ((8, ((0,), (0,))),)), b"H", codegen.NotPlain)


def test_a_map_that_changes_size_while_written_is_left_to_fastavro() -> None:
    """A map's odd key can run Python code (its __eq__, on a lookup) that changes another map being written: the
    compiled writer gives up (NotPlain) as the generated one does, instead of aborting the process."""
    script = r"""
import sys
from branch_settlement.schemas.codec import Codec
from branch_settlement.schemas.codegen import NotPlain
capacity = {}
class Key:
    def __hash__(self): return hash("quantity")
    def __eq__(self, other):
        capacity["more%d" % len(capacity)] = {"quantity": 1, "kind": "logical"}
        return False
capacity["a"] = {Key(): 0, "quantity": 1, "kind": "logical"}
capacity["b"] = {"quantity": 2, "kind": "logical"}
record = {"event_id": "e", "idempotency_key": "k", "parent_id": "p", "occurred_at_ms": 1, "capacity": capacity,
          "lease_ttl_ms": 5, "policy": {"max_live_children": 1, "reconciliation_timeout_ms": 1, "lending_limit": {}}}
try:
    Codec(implementation=sys.argv[1])._encoders["ParentReserved"](record)
    print("written")
except NotPlain:
    print("not plain")
"""
    for implementation in ("compiled", "python"):
        done = subprocess.run([sys.executable, "-c", script, implementation], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == "not plain", (implementation, done)


def test_a_dead_letters_reason_is_the_same_in_every_process() -> None:
    """fastavro names the stream it read, with its address; the reason keeps none, so the processor's dead
    letter and a replay's agree (settle replay --topic compares them)."""
    codec = default_codec()
    event = codec.event_from_json({"type": "ChildActivated", "event_id": "e", "idempotency_key": "k",
                                   "parent_id": "P", "occurred_at_ms": 0, "child_id": "A", "attempt_id": "A1",
                                   "lease_generation": 1, "lease_ttl_ms": 10})
    truncated = codec.encode_event(event)[:-1]
    reasons = set()
    for _ in range(3):
        with pytest.raises(CodecError) as caught:
            Codec().decode_event(truncated)
        reasons.add(str(caught.value))
    assert len(reasons) == 1 and "0x" not in reasons.pop()


def test_an_oversized_record_is_refused_at_decode() -> None:
    codec = default_codec()
    event = codec.event_from_json({"type": "Tick", "event_id": "x" * MAX_EVENT_BYTES, "idempotency_key": "k",
                                   "parent_id": "", "occurred_at_ms": 0, "now_ms": 1})
    with pytest.raises(CodecError, match=f"an event is at most {MAX_EVENT_BYTES}"):
        codec.decode_event(codec.encode_event(event))


def test_a_lone_surrogate_is_refused_in_json() -> None:
    codec = default_codec()
    with pytest.raises(CodecError, match="lone surrogate"):
        codec.event_from_json(json.loads('{"type": "Tick", "event_id": "\\ud800", "idempotency_key": "k", '
                                         '"parent_id": "", "occurred_at_ms": 0, "now_ms": 1}'))


def test_hostile_lines_are_dead_letters_and_the_replay_goes_on(tmp_path) -> None:
    good = [{"type": "Tick", "event_id": "t", "idempotency_key": "tick/0/5", "parent_id": "", "occurred_at_ms": 0,
             "now_ms": 5},
            {"type": "ParentReserved", "event_id": "p", "idempotency_key": "P/reserve", "parent_id": "P",
             "occurred_at_ms": 0, "capacity": {"tokens": {"quantity": 10, "kind": "logical"}}, "lease_ttl_ms": 1000,
             "policy": {"max_live_children": 2, "reconciliation_timeout_ms": 100, "lending_limit": {}}}]
    hostile = [
        '{"type": "Tick", "event_id": "\\ud800", "idempotency_key": "k", "parent_id": "", "occurred_at_ms": 0, '
        '"now_ms": 6}',
        "[" * 20_000 + "]" * 20_000,  # within the size limit, far past the JSON parser's recursion limit
        '{"type": "ChildReserved", "event_id": "e", "idempotency_key": "k", "parent_id": "P", "occurred_at_ms": 0, '
        f'"child_id": "A", "branch_id": "A", "attempt_id": "A1", "quantities": {{"tokens": {2**64 + 5}}}}}',
        json.dumps({"type": "Tick", "event_id": "x" * (MAX_EVENT_BYTES + 1), "idempotency_key": "k",
                    "parent_id": "", "occurred_at_ms": 0, "now_ms": 7}),
    ]
    after = {"type": "ChildReserved", "event_id": "c", "idempotency_key": "P/A", "parent_id": "P",
             "occurred_at_ms": 0, "child_id": "A", "branch_id": "A", "attempt_id": "A1", "quantities": {"tokens": 4}}
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join([json.dumps(good[0]), json.dumps(good[1]), *hostile, json.dumps(after)]) + "\n")
    done = subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", "replay", "--json",
                           str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    doc = json.loads(done.stdout)
    reasons = [letter["reason"] for letter in doc["dead_letters"]]
    assert len(reasons) == len(hostile), reasons
    assert "lone surrogate" in reasons[0] and "nested too deeply" in reasons[1]
    assert "expected integer" in reasons[2] and f"an event is at most {MAX_EVENT_BYTES}" in reasons[3]
    assert [r["result"] for r in doc["results"]] == ["ok", "ok", "ok"]
    assert doc["parents"]["P"]["dimensions"]["tokens"]["outstanding"] == 4


# -- every record fits the topic -----------------------------------------------------------------------------


def test_the_largest_ledger_records_fit_a_message() -> None:
    codec = default_codec()
    longest = "p" * MAX_ID_BYTES
    dims = {f"{n:0{MAX_ID_BYTES}d}": {"quantity": MAX_QUANTITY, "kind": "physical"} for n in range(MAX_DIMENSIONS)}
    parent = model.new_parent(longest, dims, MAX_TIME_MS,
                              {"max_live_children": MAX_CHILDREN_PER_PARENT, "reconciliation_timeout_ms": MAX_TTL_MS,
                               "lending_limit": {dim: MAX_QUANTITY for dim in dims}})
    parent["children"] = [f"{n:0{MAX_ID_BYTES}d}" for n in range(MAX_CHILDREN_PER_PARENT)]
    parent["winners"] = {child_id: "a" * MAX_ID_BYTES for child_id in parent["children"]}  # a branch each
    for n in range(MAX_LOANS_PER_PARENT):
        loan = model.new_loan(f"{n:0{MAX_ID_BYTES}d}", "w" * MAX_ID_BYTES, {dim: MAX_QUANTITY for dim in dims}, MAX_TIME_MS)
        loan["usage"] = {dim: MAX_BALANCE for dim in dims}
        parent["loans"].append(loan)
    assert len(codec.encode("LedgerParent", parent)) < TOPIC_MAX_MESSAGE_BYTES
    child = model.new_child(longest, longest, longest, longest, {dim: MAX_QUANTITY for dim in dims})
    child["usage_report_ids"] = [f"{n:0{MAX_ID_BYTES}d}" for n in range(MAX_USAGE_REPORTS_PER_ATTEMPT)]
    for field in ("consumed", "earlier_attempts_consumed", "awaiting", "escalated"):
        child[field] = {dim: MAX_BALANCE for dim in dims}
    child["awaiting_destination"] = {dim: "global_pool" for dim in dims}
    assert len(codec.encode("LedgerChild", child)) < TOPIC_MAX_MESSAGE_BYTES


def test_the_dead_letter_of_an_oversized_record_keeps_its_head_and_a_bounded_key() -> None:
    codec = default_codec()
    original = bytes(range(256)) * 4096  # 1 MiB
    with pytest.raises(CodecError) as refused:
        codec.decode_event(original)
    assert "1048576 bytes (sha256 " in str(refused.value)  # the reason names what the dead letter cannot keep
    task = PartitionTask(0, MemoryStore(), codec, 0, 1)
    task.dead_letter(b"k" * 100_000, {"source_topic": "branch-events", "partition": 0, "offset": 7,
                                      "original": original, "reason": str(refused.value), "line": None,
                                      "event_id": None})
    [(topic, key, value)] = task.records
    assert len(value) < DEAD_LETTER_ORIGINAL_BYTES + 1024 and len(key) == MAX_KEY_BYTES
    letter = codec.decode(value)[1]
    assert letter["original"] == original[:DEAD_LETTER_ORIGINAL_BYTES]
    assert letter["reason"] == str(refused.value)  # as a re-fold derives it: the cross-check agrees
