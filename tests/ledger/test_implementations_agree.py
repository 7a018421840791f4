"""The compiled implementation (native/, selected by schemas/native.py) gives the pure-Python reference's bytes.

Byte for byte and error for error, on every generator we have:
- every record of every schema the generators make, and every mangled copy of its bytes (the codec level:
  the compiled reader and writer against the generated Python ones, NotPlain and CodecError told apart);
- whole folds, input decoded from Avro, every output and every ledger record encoded at each checkpoint: the
  realistic workload, the worked example, the borrowing example, the reference model's seeded adversarial
  streams;
- the fuzz corpus, mutated by hypothesis: the same record or the same dead letter's reason, and for every mutated
  record that decodes, the same fold of it (result, outputs, ledger);
- the bounded exhaustive check's sequences, from each of its start states: the same ledger, outputs and auditor's
  view after every step (tests/ledger/exhaustive.py, `against`).

The compiled fold (native/src/fold.rs, FoldCore) takes the common events itself and gives the others to the Python
fold: the tests below also prove that it does take them, that it refuses a contract other than its own, and that it
keeps no fold alive.

tests/ledger/test_fold_perf_equivalence.py also holds each implementation to fastavro.
The compiled module must be installed here (`make install` builds it): a missing one fails, it is not skipped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branch_settlement.processors.ledger.fold import Fold
from branch_settlement.processors.ledger.outputs import OUTPUT_ROUTES, Outputs
from branch_settlement.processors.replay.replayer import open_view
from branch_settlement.processors.workload import Generator
from branch_settlement.projections.store import MemoryStore
from branch_settlement.schemas import EVENT_TYPES, LEDGER_TYPES, OUTPUT_TYPES, CodecError, native
from branch_settlement.schemas.codec import HEADER_SIZE, Codec
from branch_settlement.processors.ledger import fold as fold_module
from branch_settlement.processors.ledger.auditor import AuditedFold
from branch_settlement.schemas.partitioning import murmur2
from tests.ledger import exhaustive
from tests.ledger.test_fuzz import _PREFIX, EDITS, _corpus, mutate, prefix_events
from tests.ledger.test_reference_model import Stream
from tests.schemas.test_codec import sample, strategy

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ALL_TYPES = EVENT_TYPES + OUTPUT_TYPES + LEDGER_TYPES
OUTPUT_RECORDS = tuple((attr, name) for attr, _, name in OUTPUT_ROUTES)


@pytest.fixture(scope="module")
def compiled() -> Codec:
    if native.module() is None:
        pytest.fail("the compiled implementation is not installed: `make install` builds it (native/)")
    return Codec(implementation=native.COMPILED)


@pytest.fixture(scope="module")
def python() -> Codec:
    return Codec(implementation=native.PYTHON)


def test_the_compiled_codec_runs_compiled_readers_and_writers(compiled, python):
    assert compiled.implementation == native.COMPILED and python.implementation == native.PYTHON
    module = native.module()
    assert isinstance(compiled._encoders["SettlementResult"], module.Encoder)
    assert isinstance(compiled._fast_event_readers[compiled.version("ChildReserved").fingerprint], module.Decoder)
    assert not isinstance(python._encoders["SettlementResult"], module.Encoder)


def test_an_unknown_or_missing_implementation_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(native.ENV, "rust")
    with pytest.raises(native.ConfigError, match="SETTLE_IMPLEMENTATION is 'rust': expected one of auto, compiled"):
        native.select()
    monkeypatch.setenv(native.ENV, "python")
    assert native.select() == native.PYTHON
    monkeypatch.setattr(native, "_load", lambda: (None, "branch-settlement-native is not installed"))
    monkeypatch.delenv(native.ENV)
    assert native.select() == native.PYTHON  # auto: the fallback
    with pytest.raises(native.ConfigError, match="compiled implementation was asked for"):
        native.select("compiled")


def raw_outcome(function, data):
    """What a fast reader makes of `data`: a record, CodecError (its message), or anything else it raises, which
    means the same (left to fastavro): the generated Python reader raises NotPlain, IndexError, UnicodeDecodeError
    ..., the compiled one NotPlain."""
    try:
        return "record", repr(function(data))
    except CodecError as exc:
        return "CodecError", str(exc)
    except Exception:  # noqa: BLE001 - see the docstring
        return "left to fastavro", None


def mangled(data: bytes):
    yield data + b"\x00"
    for cut in range(HEADER_SIZE, len(data)):
        yield data[:cut]
    for index in range(HEADER_SIZE, len(data)):
        for value in {0x00, 0x01, 0x02, 0x03, 0x7F, 0x80, 0x81, 0xFF, data[index] ^ 0x01, data[index] ^ 0x80}:
            yield data[:index] + bytes([value]) + data[index + 1:]
    # varints of every length up to and past 64 bits, in place of each body byte that starts one
    for index in range(HEADER_SIZE, len(data)):
        for tail in (b"\xff" * 9 + b"\x01", b"\xff" * 9 + b"\x02", b"\x80" * 12 + b"\x00", b"\xff" * 10 + b"\x7f"):
            yield data[:index] + tail + data[index + 1:]


@pytest.mark.parametrize("name", ALL_TYPES)
def test_the_readers_agree_on_every_mangled_copy_of_a_record(compiled, python, name):
    schema = python.version(name).parsed
    data = python.encode(name, sample(schema, schema["__named_schemas"]))
    fingerprint = data[2:HEADER_SIZE]
    pairs = [(compiled._fast_readers[fingerprint][1], python._fast_readers[fingerprint][1])]
    if fingerprint in python._fast_event_readers:
        pairs.append((compiled._fast_event_readers[fingerprint], python._fast_event_readers[fingerprint]))
    for variant in [data, *mangled(data)]:
        for fast, reference in pairs:
            assert raw_outcome(fast, variant) == raw_outcome(reference, variant), variant.hex()
        assert decode_outcome(compiled, variant) == decode_outcome(python, variant), variant.hex()


def decode_outcome(codec, data):
    try:
        return repr(codec.decode(data))
    except CodecError as exc:
        return f"CodecError: {exc}"


def encode_outcome(codec, name, record):
    try:
        return codec.encode(name, record)
    except CodecError as exc:
        return f"CodecError: {exc}"


@settings(max_examples=800, deadline=None)
@given(st.data())
def test_any_valid_record_encodes_and_decodes_alike(compiled, python, data):
    name = data.draw(st.sampled_from(ALL_TYPES))
    schema = python.version(name).parsed
    record = data.draw(strategy(schema, schema["__named_schemas"]))
    encoded = python.encode(name, record)
    assert compiled.encode(name, record) == encoded
    assert compiled.encoder(name)(record) == encoded
    assert decode_outcome(compiled, encoded) == decode_outcome(python, encoded)


@pytest.mark.parametrize("text", ["", "a", "parent-000042", "x" * 300, "\x7f", "é", "ça-42", "\u4e2d\u6587",
                                  "\U0001f600"])
def test_a_read_string_is_the_str_cpython_makes_of_it(compiled, python, text):
    """The compiled reader makes ASCII strings itself (PyUnicode_New and a copy, not CPython's decoding): the same
    value, exact type, ASCII-ness, layout (its size) and hash as the str the generated reader makes, also as a map's
    key, and usable as a dict key for the other."""
    schema = python.version("UsageReported").parsed
    record = {**sample(schema, schema["__named_schemas"]), "parent_id": text, "usage": {text: 1}}
    encoded = python.encode("UsageReported", record)
    got, want = compiled.decode(encoded)[1], python.decode(encoded)[1]
    assert got == want
    for made, reference in ((got["parent_id"], want["parent_id"]), (next(iter(got["usage"])), text)):
        assert type(made) is str and made == reference == text
        assert made.isascii() == text.isascii()
        assert sys.getsizeof(made) == sys.getsizeof(reference)
        assert hash(made) == hash(text) and {text: 1}[made] == 1
        assert made.encode() == text.encode() and made + "!" == text + "!"


# Values that are not plain: exact types only, so a writer gives each to fastavro (or refuses it) alike.
class Label(str):
    pass


class Count(int):
    pass


ODD = st.sampled_from([True, False, 1.0, -0.0, 2**63, -(2**63) - 1, 2**64 + 5, Label("x"), Count(3), b"x", "x",
                       "\ud800", None, (), [], {}, {"k": 1}, [1], (1,), 0])


@settings(max_examples=800, deadline=None)
@given(st.data())
def test_a_record_with_any_odd_value_is_written_alike(compiled, python, data):
    name = data.draw(st.sampled_from(ALL_TYPES))
    schema = python.version(name).parsed
    record = dict(data.draw(strategy(schema, schema["__named_schemas"])))
    field = data.draw(st.sampled_from(sorted(record)))
    how = data.draw(st.sampled_from(["replace", "delete", "nest"]))
    if how == "replace":
        record[field] = data.draw(ODD)
    elif how == "delete":
        del record[field]
    elif isinstance(record[field], dict):
        record[field] = {**record[field], data.draw(ODD.filter(lambda v: v.__hash__ is not None)): data.draw(ODD)}
    elif isinstance(record[field], list):
        record[field] = [*record[field], data.draw(ODD)]
    assert encode_outcome(compiled, name, record) == encode_outcome(python, name, record)


# ---- the idempotency digest ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digests(compiled):
    """Per event type: (the compiled SortedJsonDigest, the generated Python sorted-JSON writer) of one plan."""
    from branch_settlement.processors.ledger.fold import _SORTED_JSON, DELIVERY_FIELDS
    from branch_settlement.schemas.event_json import sorted_json_plan

    pairs = {}
    for name in EVENT_TYPES:
        plan = sorted_json_plan(compiled.version(name).parsed, DELIVERY_FIELDS)
        assert plan is not None, name  # every event type of ours has a compiled digest
        pairs[name] = (native.module().SortedJsonDigest(plan), _SORTED_JSON[name])
    return pairs


def assert_digests_alike(digests, name, event):
    """The writers of event type `name` on `event` (whatever its own "type" now holds)."""
    import hashlib

    compiled, generated = digests[name]
    try:
        want = generated(event)
    except Exception:  # noqa: BLE001 - the generated writer is never supposed to raise
        raise AssertionError(f"the generated writer raised on {event!r}") from None
    got = compiled.sorted_json(event)
    assert got == want, event
    assert compiled(event) == (None if want is None else hashlib.blake2b(want, digest_size=16).digest())


ODD_JSON_VALUES = [None, True, False, 0, -1, 2**63, -(2**63) - 1, 2**70, 1.5, "", "x", "x\x00y", 'q"uote',
                   "back\\slash", "tab\there", "\x7f", "é", "\u2028", "\ud800", Label("x"), Count(2), b"x", [],
                   ["a"], {}, {"tokens": 1}, {"": 1}, {"a\x00": 1}, {"tokens": True}, {1: 2}, {"b": 1, "a": 2},
                   {"é": 1, "e": 2, "z": 3}, {"tokens": {"quantity": 1, "kind": "logical"}}]


@settings(max_examples=1500, deadline=None)
@given(st.data())
def test_the_compiled_digest_digests_the_generated_writers_text(compiled, digests, data):
    name = data.draw(st.sampled_from(EVENT_TYPES))
    schema = compiled.version(name).parsed
    event = {"type": name, **data.draw(strategy(schema, schema["__named_schemas"]))}
    assert_digests_alike(digests, name, event)
    field = data.draw(st.sampled_from(sorted(event)))
    assert_digests_alike(digests, name, {**event, field: data.draw(st.sampled_from(ODD_JSON_VALUES))})
    missing = dict(event)
    del missing[field]
    assert_digests_alike(digests, name, missing)
    assert_digests_alike(digests, name, {**event, "extra": 1})
    for key, value in event.items():
        if isinstance(value, dict) and value:
            inner = data.draw(st.sampled_from(sorted(value)))
            odd = data.draw(st.sampled_from(ODD_JSON_VALUES))
            assert_digests_alike(digests, name, {**event, key: {**value, inner: odd}})
            assert_digests_alike(digests, name, {**event, key: {**value, data.draw(st.text(max_size=3)): odd}})


def test_the_compiled_digest_agrees_across_blake2b_block_boundaries(compiled, digests):
    """Texts of every length from under two 128-byte blocks to past four (BLAKE2b compresses 128 bytes at a time;
    the compiled digest takes the CPU's vector path where it has one): the same digest as hashlib's."""
    name = "ChildReserved"
    schema = compiled.version(name).parsed
    event = {"type": name, **sample(schema, schema["__named_schemas"])}
    lengths = set()
    for size in range(400):
        grown = {**event, "child_id": "c" * size}
        lengths.add(len(digests[name][1](grown)))
        assert_digests_alike(digests, name, grown)
    assert {255, 256, 257, 383, 384, 385, 511, 512, 513} <= lengths, sorted(lengths)


def test_the_fold_digests_with_the_selected_implementation(monkeypatch):
    from branch_settlement.processors.ledger import fold

    event = example("worked-example.jsonl", Codec(implementation=native.PYTHON))[1]
    found = {}
    for implementation in (native.COMPILED, native.PYTHON):
        monkeypatch.setenv(native.ENV, implementation)
        monkeypatch.setattr(fold, "_DIGESTS", None)
        found[implementation] = fold.payload_digest(event)
        assert isinstance(fold._DIGESTS[event["type"]], native.module().SortedJsonDigest) == (
            implementation == native.COMPILED)
    assert found[native.COMPILED] == found[native.PYTHON]


# ---- whole folds ----------------------------------------------------------------------------------------------

def fold_bytes(codec: Codec, events: list[dict], checkpoint_events: int = 50, partition: int = 0,
               partitions: int | None = None, rekey=None) -> list[bytes]:
    """Every byte a fold with `codec` (and the fold of the same implementation) writes: each input as encoded and
    decoded again, then at each checkpoint every output record and every ledger change (key and value), in order.
    `partitions`: the fold is that of `partition` of a topic of so many (the others' events are misrouted).
    `rekey`: each decoded event is folded as `rekey(event)` gives it."""
    inputs = [codec.encode_event(event) for event in events]
    view = open_view(MemoryStore(), codec)
    fold, out, written = Fold(view, partition, partitions, implementation=codec.implementation), Outputs(), []
    for offset, data in enumerate(inputs):
        written.append(data)
        event = codec.decode_event(data)
        fold.apply(rekey(event) if rekey else event, offset, out)
        if (offset + 1) % checkpoint_events == 0 or offset + 1 == len(inputs):
            for attr, name in OUTPUT_RECORDS:
                written.extend(codec.encode(name, record) for record in getattr(out, attr))
            out.clear()
            changes = fold.changes()  # the compiled core's encoding of them, for the compiled fold
            for key, value in changes:
                written.extend((key, value or b""))
            view.store.write(changes, offset)  # the view may evict what it committed: the store has it
            view.mark_committed()
    return written


def assert_folds_alike(compiled, python, events, label):
    got, want = fold_bytes(compiled, events), fold_bytes(python, events)
    assert len(got) == len(want), label
    for index, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"{label}: record {index} differs"


def example(name: str, codec: Codec) -> list[dict]:
    lines = (EXAMPLES / name).read_text().splitlines()
    return [codec.event_from_json(json.loads(line)) for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("seed", [1, 7, 42])
def test_a_realistic_workload_folds_to_the_same_bytes(compiled, python, seed):
    events = [python.event_from_json(r) for r in Generator(seed).generate(3000) if not isinstance(r, str)]
    assert_folds_alike(compiled, python, events, f"workload seed {seed}")


@pytest.mark.parametrize("partition", [0, 2])
def test_a_fold_of_one_topic_partition_folds_to_the_same_bytes(compiled, python, partition):
    events = [python.event_from_json(r) for r in Generator(42).generate(3000) if not isinstance(r, str)]
    want = fold_bytes(python, events, partition=partition, partitions=3)
    assert fold_bytes(compiled, events, partition=partition, partitions=3) == want
    assert b"misrouted" in b"".join(want) and b"tick_not_accepted" in b"".join(want)


@pytest.mark.parametrize("name", ["worked-example.jsonl", "borrowing.jsonl"])
def test_the_examples_fold_to_the_same_bytes(compiled, python, name):
    assert_folds_alike(compiled, python, example(name, python), name)


@pytest.mark.parametrize("seed", range(12))
def test_the_reference_model_streams_fold_to_the_same_bytes(compiled, python, seed):
    events = [python.event_from_json(event) for event in Stream(seed, 400).build()]
    assert_folds_alike(compiled, python, events, f"reference stream {seed}")


# ---- the fuzz corpus ------------------------------------------------------------------------------------------

@settings(max_examples=600, deadline=None)
@given(line=st.sampled_from(_corpus("avro.txt")), edits=EDITS)
def test_mutated_corpus_records_decode_alike(compiled, python, line, edits):
    data = mutate(bytes.fromhex(line), edits)
    for decode in (Codec.decode, Codec.decode_event):
        assert decode_outcome_of(decode, compiled, data) == decode_outcome_of(decode, python, data), data.hex()


def decode_outcome_of(decode, codec, data):
    try:
        return repr(decode(codec, data))
    except CodecError as exc:
        return f"CodecError: {exc}"


# ---- the compiled fold ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", sorted(exhaustive.STARTS))
def test_the_exhaustive_sequences_fold_alike(compiled, start):
    depth = {"parent": 4, "running": 3, "lending": 5}[start]
    counts = exhaustive.explore(depth, deterministic_every=10**9, start_name=start, against=native.PYTHON)
    assert counts["steps"] > 3000


def fold_from_prefix(event: dict, implementation: str) -> list:
    """The fuzz test's prefix ledger, then `event`: its result, every output and every ledger change, encoded."""
    store = MemoryStore()
    store.write(_PREFIX[0], 0)
    view = open_view(store, Codec(implementation=native.PYTHON))
    fold, out = AuditedFold(view, implementation=implementation), Outputs()
    fold.auditor.restore(_PREFIX[1])
    result = fold.apply(event, len(prefix_events()), out)
    written = [result]
    for attr, name in OUTPUT_RECORDS:
        written.extend(getattr(out, attr))
    return written + view.changes()


@settings(max_examples=400, deadline=None)
@given(line=st.sampled_from(_corpus("avro.txt")), edits=EDITS)
def test_mutated_corpus_records_fold_alike(compiled, python, line, edits):
    try:
        event = python.decode_event(mutate(bytes.fromhex(line), edits))
    except CodecError:
        return  # a dead letter, the same one (test_mutated_corpus_records_decode_alike)
    assert fold_from_prefix(event, native.COMPILED) == fold_from_prefix(event, native.PYTHON)


def test_the_compiled_fold_takes_the_common_events_itself(compiled, python, monkeypatch):
    delegated = []
    python_apply = Fold._apply
    monkeypatch.setattr(Fold, "_apply", lambda self, event, *args: delegated.append(event["type"]) or
                        python_apply(self, event, *args))
    events = [python.event_from_json(r) for r in Generator(7).generate(3000) if not isinstance(r, str)]
    fold_bytes(compiled, events)
    compiled_types = {"ChildReserved", "ChildActivated", "UsageReported", "ChildCompleted", "ChildSkipped",
                      "CancelAcknowledged", "ChildFailed", "SpeculativeWinner", "ParentReserved", "ParentClosed"}
    taken = sum(event["type"] in compiled_types for event in events) - sum(t in compiled_types for t in delegated)
    assert taken > 0.85 * len(events), (taken, len(events))
    assert "Tick" in delegated  # the rest goes to the Python fold
    # parents open and close in the core too: the workload's closes fence children never activated, and lend nothing
    parents = {"ParentReserved", "ParentClosed"}
    assert parents <= {event["type"] for event in events} and not parents & set(delegated), delegated
    # the workload's skips, cancel acknowledgements and failures (each handing its remainder to a retry) have known
    # usage, and its speculative winners name a held attempt: the core settles them all itself
    outcomes = {"ChildSkipped", "CancelAcknowledged", "ChildFailed", "SpeculativeWinner"}
    assert outcomes <= {event["type"] for event in events} and not outcomes & set(delegated), delegated


def _fresh_keys(event: dict) -> dict:
    """The event under keys that are equal strings of their own, none interned."""
    fresh = {"".join(list(key)): value for key, value in event.items()}
    assert not any(key is sys.intern(key) for key in fresh)
    return fresh


def _label_keys(event: dict) -> dict:
    """The event under keys that are a str subclass."""
    return {Label(key): value for key, value in event.items()}


@pytest.mark.parametrize("rekey", [_fresh_keys, _label_keys])
def test_the_core_reads_an_event_under_any_equal_keys(compiled, python, monkeypatch, rekey):
    """The compiled decoder makes every key of an event an interned str, and so do the core's names: a core that read
    keys by identity would be right on decoded events only. An event whose keys are equal strings of their own, or a
    str subclass, is taken by the core all the same and folds to the same bytes as the Python fold of the decoded
    events (docs/benchmarks.md, ninth part: a read by identity was measured and not taken; this holds any that is)."""
    events = [python.event_from_json(r) for r in Generator(7).generate(1500) if not isinstance(r, str)]
    delegated = []
    python_apply = Fold._apply
    monkeypatch.setattr(Fold, "_apply", lambda self, event, *args: delegated.append(event["type"]) or
                        python_apply(self, event, *args))
    got = fold_bytes(compiled, events, rekey=rekey)
    assert len(delegated) < 0.15 * len(events), (len(delegated), len(events))
    monkeypatch.setattr(Fold, "_apply", python_apply)
    assert got == fold_bytes(python, events)


def test_a_compiled_fold_built_for_another_contract_refuses_to_start(compiled):
    env = dict(fold_module._core_env())
    env["contract"] = dict(env["contract"], MAX_QUANTITY=2**40)
    view = open_view(MemoryStore(), compiled)
    with pytest.raises(ValueError, match="built for another contract: MAX_QUANTITY is Some.*rebuild it"):
        native.module().FoldCore(Fold(view, implementation=native.PYTHON), env)


def test_a_compiled_fold_and_its_view_are_freed_without_the_collector(compiled):
    import gc
    import weakref
    gc.disable()
    try:
        view = open_view(MemoryStore(), compiled)
        fold = Fold(view, implementation=native.COMPILED)
        fold.apply(example("worked-example.jsonl", compiled)[0], 0, Outputs())
        gone = weakref.ref(view)
        del fold, view
        assert gone() is None
    finally:
        gc.enable()


@given(data=st.binary(max_size=64))
def test_the_compiled_murmur2_is_kafkas(compiled, data):
    assert native.module().murmur2(data) == murmur2(data)


def test_a_folded_events_outputs_are_buffered_alike(compiled, python):
    """processors/ledger/outputs.output_encoder, compiled (native/src/outputs.rs) against the Python loop: the same
    (topic, key, bytes) in the same order, the same released totals, and `out` cleared; a record only fastavro
    encodes (a float for a long) goes to Codec.encode alike."""
    import copy

    from branch_settlement.processors.ledger.outputs import output_encoder
    encoders = {codec.implementation: output_encoder(codec) for codec in (compiled, python)}
    assert type(encoders[native.COMPILED]).__name__ == "OutputEncoder"
    events = [python.event_from_json(r) for r in Generator(7).generate(2000) if not isinstance(r, str)]
    view = open_view(MemoryStore(), python)
    fold, out = Fold(view, implementation=native.PYTHON), Outputs()
    buffered = {implementation: ([], {}) for implementation in encoders}
    odd = None
    for offset, event in enumerate(events):
        fold.apply(event, offset, out)
        if offset >= 100 and out.audits and not odd:
            out.audits[0]["lease_generation"] = odd = 5.0
        for implementation, encode in encoders.items():
            copied = copy.deepcopy(out)
            encode(copied, *buffered[implementation])
            assert copied.count() == 0
        out.clear()
    assert buffered[native.COMPILED] == buffered[native.PYTHON]
    assert odd and len(buffered[native.PYTHON][0]) > 2 * len(events) and buffered[native.PYTHON][1]


def test_a_compiled_fold_may_be_dropped_on_another_thread(compiled):
    """The fault simulation, and a processor's client threads, drop folds made elsewhere."""
    import sys
    import threading
    caught = []
    hook, sys.unraisablehook = sys.unraisablehook, caught.append
    try:
        holder = [Fold(open_view(MemoryStore(), compiled), implementation=native.COMPILED)]
        thread = threading.Thread(target=holder.clear)
        thread.start()
        thread.join()
    finally:
        sys.unraisablehook = hook
    assert not holder and not caught, caught


def test_a_codec_that_encodes_its_own_way_buffers_outputs_its_own_way():
    """A ConfluentCodec frames the records others read: the compiled buffering (single-object writers) is not used
    for it, and what is buffered is its frames."""
    from branch_settlement.processors.ledger.outputs import output_encoder
    from branch_settlement.schemas.confluent import ConfluentCodec

    class Framing(Codec):
        def encode(self, name, record):
            return b"\x00framed" + super().encode(name, record)

    codec = Framing(implementation=native.COMPILED)
    assert ConfluentCodec.encode is not Codec.encode
    encode = output_encoder(codec)
    assert type(encode).__name__ != "OutputEncoder"
    view = open_view(MemoryStore(), codec)
    out, records = Outputs(), []
    Fold(view).apply(example("worked-example.jsonl", codec)[0], 0, out)
    encode(out, records, {})
    assert records and all(value.startswith(b"\x00framed") for _, _, value in records)


def test_a_checkpoints_changes_are_encoded_alike(compiled):
    """FoldCore.changes (native/src/fold.rs) against LedgerView.changes, on twin views folded alike: the same
    (key, bytes) in the same order, deletes and changes spilled as bytes included, and the same cache sizes
    re-estimated; a record only fastavro encodes (a float for a long) goes to Codec.encode alike."""
    events = [compiled.event_from_json(r) for r in Generator(11).generate(3000) if not isinstance(r, str)]
    folds = [Fold(open_view(MemoryStore(), compiled), implementation=native.COMPILED) for _ in range(2)]
    assert folds[0]._change_writers is not None
    odd = spilled = deleted = 0
    for offset, event in enumerate(events):
        for fold in folds:
            fold.apply(event, offset, Outputs())
        if offset % 500 != 499:
            continue
        views = [fold.view for fold in folds]
        edited = []
        for view in views:  # the same odd edits on both: a float for a long, a spilled change, a delete
            dirty = view._dirty
            keys_ = [key for key, entry in dirty.items() if entry is not None and type(entry[1]) is dict]
            child = next(key for key in keys_ if "lease_generation" in dirty[key][1])
            dirty[child][1]["lease_generation"] = float(dirty[child][1]["lease_generation"])
            edited.append(dirty[child][1])
            odd += 1
            others = [key for key in keys_ if key != child]
            name, other = dirty[others[0]]
            dirty[others[0]] = (name, compiled.encode(name, other))
            spilled += 1
            dirty[others[1]] = None
            deleted += 1
        got, want = folds[0].changes(), views[1].changes()
        assert got == want
        assert views[0]._sizes == views[1]._sizes and views[0].cached_bytes == views[1].cached_bytes
        for record in edited:  # an int again for the events to come
            record["lease_generation"] = int(record["lease_generation"])
        for fold in folds:
            fold.view.store.write(got, offset)
            fold.view.mark_committed()
    assert odd and spilled and deleted


def test_a_fold_over_a_codec_that_encodes_its_own_way_leaves_its_changes_to_the_view():
    class Framing(Codec):
        def encode(self, name, record):
            return b"\x00framed" + super().encode(name, record)

    fold = Fold(open_view(MemoryStore(), Framing(implementation=native.COMPILED)), implementation=native.COMPILED)
    assert fold._change_writers is None
    fold.apply(example("worked-example.jsonl", fold.view._decode.__self__)[0], 0, Outputs())
    changes = fold.changes()
    assert changes and all(value.startswith(b"\x00framed") for _, value in changes if value is not None)


def test_the_compiled_core_adds_timers_as_the_view_does(compiled, python):
    """Ctx::add_timer (native/src/fold.rs) against LedgerView.add_timer: after every event of the workload, the same
    heap of timers and the same timer records among the changes."""
    events = [python.event_from_json(r) for r in Generator(13).generate(3000) if not isinstance(r, str)]
    folds = {impl: Fold(open_view(MemoryStore(), codec), implementation=impl)
             for impl, codec in ((native.COMPILED, compiled), (native.PYTHON, python))}
    added = 0
    for offset, event in enumerate(events):
        for fold in folds.values():
            fold.apply(event, offset, Outputs())
        got, want = (folds[impl].view for impl in (native.COMPILED, native.PYTHON))
        assert got._timers == want._timers, f"event {offset}: {event['type']}"
        added = max(added, len(want._timers))
        if offset % 400 == 399:
            changes = {impl: fold.changes() for impl, fold in folds.items()}
            assert changes[native.COMPILED] == changes[native.PYTHON]
            assert any(key.startswith(b"t\0") and value for key, value in changes[native.PYTHON])
            for fold, fold_changes in zip(folds.values(), changes.values()):
                fold.view.store.write(fold_changes, offset)
                fold.view.mark_committed()
    assert added > 10


def _parents_stream(python: Codec) -> list[dict]:
    """Every branch of a parent's reservation and close: taken, duplicate, already reserved or closing, closed,
    unknown, a lending limit naming another dimension, what only the Python fold takes (a dimension that is not
    ASCII, an unknown kind or outcome), a close that fences children never activated (a physical remainder awaits
    the scheduler's confirmation) and one recorded on an expired parent."""
    now, n = 1764410400000, iter(range(1000))

    def event(etype: str, parent_id: str, key: str, **fields) -> dict:
        return python.event_from_json({"type": etype, "event_id": f"e-{next(n)}", "idempotency_key": key,
                                       "parent_id": parent_id, "occurred_at_ms": now, **fields})

    def reserve(parent_id: str, key: str, capacity: dict, lending: dict | None = None, ttl: int = 3_600_000):
        policy = {"max_live_children": 8, "reconciliation_timeout_ms": 600_000, "lending_limit": lending or {}}
        return event("ParentReserved", parent_id, key, capacity=capacity, lease_ttl_ms=ttl, policy=policy)

    def close(parent_id: str, key: str, outcome: str = "succeeded"):
        return event("ParentClosed", parent_id, key, outcome=outcome)

    def child(etype: str, child_id: str, key: str, parent_id: str = "p1", **fields):
        return event(etype, parent_id, key, child_id=child_id, attempt_id=f"{child_id}a", **fields)

    capacity = {"tokens": {"quantity": 100, "kind": "logical"}, "gpus": {"quantity": 4, "kind": "physical"}}
    return [
        event("Tick", "", f"tick/{now}", now_ms=now),
        reserve("p1", "p1/r", capacity, {"tokens": 5}),
        reserve("p1", "p1/r", capacity, {"tokens": 5}),  # duplicate
        reserve("p1", "p1/r2", capacity),  # already reserved
        reserve("p2", "p2/r", capacity, {"memory": 1}),  # a lending limit of another dimension
        reserve("p3", "p3/r", {"tökens": {"quantity": 3, "kind": "logical"}}),
        reserve("p4", "p4/r", {"tokens": {"quantity": 3, "kind": "quantum"}}),
        child("ChildReserved", "c1", "p1/c1/r", branch_id="c1", quantities={"tokens": 10, "gpus": 1}),
        child("ChildReserved", "c2", "p1/c2/r", branch_id="c2", quantities={"tokens": 5}),
        child("ChildActivated", "c2", "p1/c2/a", lease_generation=1, lease_ttl_ms=60_000),
        close("p1", "p1/close"),
        close("p1", "p1/close2"),  # already closing
        close("p1", "p1/close3", "exploded"),
        child("ChildCompleted", "c2", "p1/c2/done", lease_generation=1, usage={"tokens": 4}),
        child("SchedulerReleaseConfirmed", "c1", "p1/c1/gpus", dimension="gpus"),
        reserve("p1", "p1/again", capacity),  # closed
        close("p9", "p9/close"),  # unknown
        reserve("p5", "p5/r", capacity, ttl=1000),
        child("ChildReserved", "c5", "p5/c5/r", "p5", branch_id="c5", quantities={"tokens": 1}),
        child("ChildActivated", "c5", "p5/c5/a", "p5", lease_generation=1, lease_ttl_ms=60_000),
        event("Tick", "", f"tick/{now + 5000}", now_ms=now + 5000),  # p5's lease expires, its child still runs
        close("p5", "p5/close", "failed"),
        child("ChildCompleted", "c5", "p5/c5/done", "p5", lease_generation=1, usage={"tokens": 1}),
    ]


def test_every_branch_of_a_parents_reservation_and_close_folds_alike(compiled, python, monkeypatch):
    events = _parents_stream(python)
    delegated = []
    python_apply = Fold._apply
    monkeypatch.setattr(Fold, "_apply", lambda self, event, *args: delegated.append(event["idempotency_key"]) or
                        python_apply(self, event, *args))
    got = fold_bytes(compiled, events, checkpoint_events=4)
    assert sorted(delegated) == sorted(e["idempotency_key"] for e in events  # the core took the rest
                                       if e["type"] in ("Tick", "SchedulerReleaseConfirmed")
                                       or e["idempotency_key"] in ("p3/r", "p4/r", "p1/close3"))
    monkeypatch.setattr(Fold, "_apply", python_apply)
    assert got == fold_bytes(python, events, checkpoint_events=4)
    view = open_view(MemoryStore(), python)
    fold, out = Fold(view, implementation=native.PYTHON), Outputs()
    codes = [fold.apply(e, offset, out)["result"] for offset, e in enumerate(events)]
    assert codes == ["ok", "ok", "duplicate", "invalid_transition", "invalid_event", "ok", "invalid_event", "ok", "ok",
                     "ok", "ok", "invalid_transition", "invalid_event", "ok", "ok", "parent_closed", "unknown_parent",
                     "ok", "ok", "ok", "ok", "ok", "ok"], codes
    settled = {record["parent_id"]: record["outcome"] for record in out.settled}
    assert settled == {"p1": "succeeded", "p5": "failed"}, settled
    notes = [audit["note"] for audit in out.audits if audit["parent_id"] == "p5" and not audit["child_id"]]
    assert "close recorded on expired parent: failed" in notes, notes


@pytest.mark.parametrize("fresh_names", [False, True])
def test_the_compiled_invariant_reads_a_balance_under_any_equal_names(compiled, python, fresh_names):
    """The core reads a balance's terms in one pass where they sit under the names it interned (as in every record
    the fold makes or the codec decodes), else by name: a balance whose keys are equal strings of their own is checked
    the same, and a violation in either is found."""
    from branch_settlement.processors.ledger.errors import InvariantViolation
    events = _parents_stream(python)[:11]  # p1 reserved, c1 and c2 reserved, c2 activated, p1 closed
    view = open_view(MemoryStore(), compiled)
    fold, out = Fold(view, implementation=native.COMPILED), Outputs()
    for offset, event in enumerate(events[:9]):
        fold.apply(event, offset, out)
    parent = view.parent("p1")
    if fresh_names:
        for dim, balance in list(parent["dimensions"].items()):
            parent["dimensions"][dim] = {"".join(list(term)): value for term, value in balance.items()}
        assert not any(term is sys.intern(term) for term in parent["dimensions"]["tokens"])
    assert fold.apply(events[9], 9, out)["result"] == "ok"  # the invariant holds
    parent["dimensions"]["tokens"][next(t for t in parent["dimensions"]["tokens"] if t == "available")] += 1
    with pytest.raises(InvariantViolation, match="parent 'p1' dimension 'tokens'"):
        fold.apply(events[10], 10, out)  # the close touches p1: its broken balance is found
