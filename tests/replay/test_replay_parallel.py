"""What makes the replays fast must not change what they find: a file decoded by a second process gives the
same inputs; the topic replay's byte comparison accepts exactly the published sequences its record-by-record
comparison accepts in order, and hands everything else to it."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from branch_settlement.processors.crosscheck.diff import compare_partition, encode_derived, same_bytes
from branch_settlement.processors.crosscheck.report import PartitionOutcome
from branch_settlement.processors.crosscheck.topic_replay import _Output
from branch_settlement.processors.ledger.outputs import OUTPUT_TOPICS
from branch_settlement.processors.replay.replayer import _single_threaded, read_events, read_events_aside, replay
from branch_settlement.processors.workload import Generator
from branch_settlement.schemas.codec import default_codec

pytestmark = pytest.mark.unit


@pytest.fixture
def workload_file(tmp_path: Path) -> Path:
    lines = [item if isinstance(item, str) else json.dumps(item, separators=(",", ":"))
             for item in Generator(3).generate(6_000)]
    lines[10:10] = ["not json", "[1, 2]", '{"type": "Nope"}', ""]  # dead letters, and a blank line
    path = tmp_path / "workload.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


ASIDE_CHECK = """
import json, sys
from branch_settlement.processors.replay.replayer import (_single_threaded, read_events, read_events_aside, replay,
                                                          replay_document)
from branch_settlement.schemas.codec import default_codec
codec = default_codec()
forked = _single_threaded()  # a fresh process: read_events_aside forks its reader
path = sys.argv[1]
same_inputs = list(read_events_aside(path, codec, min_bytes=0)) == list(read_events(path, codec))
docs = [json.dumps(replay_document(*replay(reader, codec=codec), codec))
        for reader in (read_events(path, codec), read_events_aside(path, codec, min_bytes=0))]
print(json.dumps({"forked": forked, "same_inputs": same_inputs, "same_document": docs[0] == docs[1],
                  "dead_letters": len(json.loads(docs[0])["dead_letters"])}))
"""


def _check_aside(path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", ASIDE_CHECK, str(path)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_file_read_aside_gives_the_same_inputs_and_replay(workload_file: Path) -> None:
    """In a fresh process (single-threaded, so the reader is forked): the same inputs, the same document."""
    checked = _check_aside(workload_file)
    assert checked.pop("dead_letters") > 3  # the workload's malformed lines and the three added
    assert checked == {"forked": True, "same_inputs": True, "same_document": True}


def test_an_avro_container_read_aside_gives_the_same_inputs(workload_file: Path, tmp_path: Path) -> None:
    codec = default_codec()
    events = [item.event for item in read_events(workload_file, codec) if item.event is not None]
    container = tmp_path / "events.avro"
    codec.write_container(container, events)
    assert _check_aside(container) == {"forked": True, "same_inputs": True, "same_document": True,
                                       "dead_letters": 0}


def test_in_a_threaded_process_the_file_is_read_in_place(workload_file: Path) -> None:
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not _single_threaded()
        inputs = read_events_aside(workload_file, default_codec(), min_bytes=0)
        next(inputs)
        assert not multiprocessing.active_children()
        inputs.close()
    finally:
        stop.set()
        other.join()


def test_a_replay_that_stops_early_leaves_no_reader_behind(workload_file: Path) -> None:
    inputs = read_events_aside(workload_file, default_codec(), min_bytes=0)
    next(inputs)
    inputs.close()
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def _published(kinds_and_records: list[tuple[str, dict]]) -> list[tuple[int, bytes]]:
    codec = default_codec()
    return [(offset, codec.encode(kind, record)) for offset, (kind, record) in enumerate(kinds_and_records)]


@pytest.fixture(scope="module")
def folded():
    """The outputs of a generated workload (releases, settled parents, results, audit records)."""
    codec = default_codec()
    result, _ = replay(_generated_inputs(codec), codec=codec)
    assert len(result.outputs.releases) >= 3 and len(result.outputs.settled) >= 2
    return result


def _generated_inputs(codec):
    from branch_settlement.processors.replay.replayer import decode_json_line
    items = [item for item in Generator(5).generate(3_000) if not isinstance(item, str)]
    return [decode_json_line(json.dumps(item).encode(), n, n + 1, codec) for n, item in enumerate(items)]


def _derived(folded) -> tuple[list[dict], list[dict], list[bytes]]:
    """Three releases and two settled parents, and their derived bytes in the processor's order."""
    releases, settled = list(folded.outputs.releases[:3]), list(folded.outputs.settled[:2])
    order = [("CapacityReleased", releases[0]), ("CapacityReleased", releases[1]), ("ParentSettled", settled[0]),
             ("CapacityReleased", releases[2]), ("ParentSettled", settled[1])]
    return releases, settled, [value for _, value in _published(order)]


def test_bytes_match_in_order_or_with_kinds_interleaved_as_checkpoints_cut_them(folded) -> None:
    releases, settled, derived = _derived(folded)
    for order in ([("CapacityReleased", releases[0]), ("CapacityReleased", releases[1]), ("ParentSettled", settled[0]),
                   ("CapacityReleased", releases[2]), ("ParentSettled", settled[1])],
                  [*(("CapacityReleased", r) for r in releases), *(("ParentSettled", s) for s in settled)]):
        assert same_bytes(derived, _published(order))


@pytest.mark.parametrize("change", ["altered", "removed", "injected", "reordered"])
def test_anything_else_goes_to_the_record_by_record_comparison(change: str, folded) -> None:
    releases, settled, derived = _derived(folded)
    order = [*(("CapacityReleased", r) for r in releases), *(("ParentSettled", s) for s in settled)]
    if change == "altered":
        order[1] = ("CapacityReleased", dict(releases[1], quantity=99))
    elif change == "removed":
        del order[1]
    elif change == "injected":
        order.insert(2, order[2])
    else:
        order[0], order[1] = order[1], order[0]
    assert not same_bytes(derived, _published(order))


def test_byte_comparison_and_record_comparison_agree_on_a_partition(folded) -> None:
    """compare_partition counts the same comparisons whichever path it takes, and pinpoints a change."""
    codec = default_codec()
    result = folded
    names = {t: f"x.{t}" for t in ("branch-events", *OUTPUT_TOPICS)}
    published = {"settlement-results": _published([("SettlementResult", r) for r in result.outputs.results]),
                 "capacity-releases": _published([("CapacityReleased", r) for r in result.outputs.releases] +
                                                 [("ParentSettled", r) for r in result.outputs.settled]),
                 "settlement-audit": _published([("AuditRecord", r) for r in result.outputs.audits]),
                 "branch-events-dlq": []}
    derived = encode_derived(result.outputs, codec)
    clean = PartitionOutcome()
    compare_partition(0, derived, result.dead_letters, published, codec, (0, 2**63 - 1), names, clean)
    assert not any(clean.divergences.values())
    expected = len(result.outputs.results) + len(result.outputs.releases) + len(result.outputs.settled) + \
        len(result.outputs.audits)
    assert clean.compared == expected
    offset, value = published["settlement-results"][3]
    kind, record = codec.decode(value)
    published["settlement-results"][3] = (offset, codec.encode(kind, dict(record, result="overdrawn")))
    tampered = PartitionOutcome()
    compare_partition(0, derived, result.dead_letters, published, codec, (0, 2**63 - 1), names, tampered)
    [divergence] = tampered.divergences["settlement-results"]
    assert (divergence.topic, divergence.offset, divergence.problem) == ("x.settlement-results", 3, "different")
    assert divergence.found == {"result": "overdrawn"}
    assert tampered.compared == expected
    ranged = PartitionOutcome()
    compare_partition(0, derived, result.dead_letters, published, codec, (0, 1), names, ranged)
    assert ranged.compared == sum(1 for records in (result.outputs.results, result.outputs.releases,
                                                    result.outputs.settled, result.outputs.audits)
                                  for r in records if r["input_offset"] <= 1)


def test_an_output_read_ahead_stops_at_the_end_decided_after_the_fold() -> None:
    out = _Output()
    out.records = [(0, b"a"), (1, b"b"), (3, b"c"), (4, b"d")]
    out.set_end(4)  # the fold is done; the last stable offset is now 4
    assert out.records == [(0, b"a"), (1, b"b"), (3, b"c")] and out.done
    out = _Output()
    out.records, out.eof = [(0, b"a")], 2  # an end-of-partition seen at 2 while folding
    out.set_end(5)
    assert not out.done
    out.set_end(2)
    assert out.done


def test_an_export_file_replays_the_same_in_one_process_or_several(workload_file: Path, tmp_path: Path) -> None:
    """`settle replay EXPORT.avro` with its partitions folded side by side (a fresh process, so forked) prints
    what one process prints, and what folding each partition in turn gives."""
    from branch_settlement.processors.replay import export_format, partitioned

    codec = default_codec()
    items = list(read_events(workload_file, codec))
    export = tmp_path / "export.avro"
    export_format.write_export(export, ((n % 3, item, b"raw") for n, item in enumerate(items)), codec)
    folded = partitioned.replay_partitions(export_format.read_export(export, codec), codec)
    expected = json.dumps(partitioned.merged_document(folded, codec), indent=2, ensure_ascii=False) + "\n"
    outputs = {}
    for jobs in ("1", "3"):
        for flag in ("--json", None):
            done = subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", "replay", str(export), "--jobs", jobs,
                                   *([flag] if flag else [])], capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parents[2], timeout=300)
            assert done.returncode == 0, done.stderr
            outputs[(jobs, flag)] = done.stdout
    assert outputs[("1", "--json")] == outputs[("3", "--json")] == expected
    assert outputs[("1", None)] == outputs[("3", None)]
    assert outputs[("1", None)].count("=== partition") == 3
