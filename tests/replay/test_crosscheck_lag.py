"""The topic replay tells the processors' lag from missing output: an output expected for an input at or
beyond the group's committed offset is "not yet processed" (counted apart, the replay still agrees); one
missing below it is "missing" (a divergence)."""

from __future__ import annotations

import pytest

from branch_settlement.processors.crosscheck.diff import compare_partition, encode_derived
from branch_settlement.processors.crosscheck.report import NOT_YET_PROCESSED, Lag, PartitionOutcome, Report
from branch_settlement.processors.ledger.outputs import OUTPUT_TOPICS
from branch_settlement.schemas.codec import default_codec
from branch_settlement.processors.replay.replayer import replay
from tests.replay.test_replay_parallel import _generated_inputs, _published

pytestmark = pytest.mark.unit

NAMES = {t: f"x.{t}" for t in ("branch-events", *OUTPUT_TOPICS)}
EVERYTHING = (0, 2**63 - 1)


@pytest.fixture(scope="module")
def folded():
    codec = default_codec()
    return replay(_generated_inputs(codec), codec=codec)[0]


def _published_below(result, end: int) -> dict:
    """What a processor that committed the inputs below `end` has published."""
    def kept(kind, records):
        return [(kind, r) for r in records if r["input_offset"] < end]
    return {"settlement-results": _published(kept("SettlementResult", result.outputs.results)),
            "capacity-releases": _published(kept("CapacityReleased", result.outputs.releases)
                                            + kept("ParentSettled", result.outputs.settled)),
            "settlement-audit": _published(kept("AuditRecord", result.outputs.audits)),
            "branch-events-dlq": []}


def _expected_from(result, end: int) -> int:
    return sum(1 for records in (result.outputs.results, result.outputs.releases, result.outputs.settled,
                                 result.outputs.audits) for r in records if r["input_offset"] >= end)


def test_outputs_beyond_the_committed_offset_are_not_yet_processed(folded) -> None:
    codec = default_codec()
    end = folded.events // 2
    published = _published_below(folded, end)
    part = PartitionOutcome()
    compare_partition(0, encode_derived(folded.outputs, codec), folded.dead_letters, published, codec, EVERYTHING,
                      NAMES, part, committed=end)
    assert not any(part.divergences.values())
    assert len(part.not_yet_processed) == _expected_from(folded, end) > 0
    assert {d.problem for d in part.not_yet_processed} == {NOT_YET_PROCESSED}
    assert min(d.input_offset for d in part.not_yet_processed) >= end


def test_a_group_that_committed_nothing_has_everything_not_yet_processed(folded) -> None:
    codec = default_codec()
    part = PartitionOutcome()
    compare_partition(0, encode_derived(folded.outputs, codec), folded.dead_letters, _published_below(folded, 0),
                      codec, EVERYTHING, NAMES, part, committed=0)
    assert not any(part.divergences.values())
    assert len(part.not_yet_processed) == _expected_from(folded, 0)


def test_an_output_missing_below_the_committed_offset_is_missing(folded) -> None:
    codec = default_codec()
    end = folded.events // 2
    published = _published_below(folded, end)
    removed_offset, removed = published["settlement-results"].pop(5)
    part = PartitionOutcome()
    compare_partition(0, encode_derived(folded.outputs, codec), folded.dead_letters, published, codec, EVERYTHING,
                      NAMES, part, committed=end)
    [missing] = part.divergences["settlement-results"]
    assert missing.problem == "missing" and missing.input_offset == codec.decode(removed)[1]["input_offset"] < end
    assert len(part.not_yet_processed) == _expected_from(folded, end)


def test_without_the_committed_offsets_every_expected_output_must_be_there(folded) -> None:
    codec = default_codec()
    part = PartitionOutcome()
    compare_partition(0, encode_derived(folded.outputs, codec), folded.dead_letters,
                      _published_below(folded, folded.events // 2), codec, EVERYTHING, NAMES, part)
    assert {d.problem for ds in part.divergences.values() for d in ds} == {"missing"}
    assert not part.not_yet_processed


def test_the_report_counts_the_lag_and_still_agrees() -> None:
    report = Report(partitions=[0, 1], group_id="g", lag={0: Lag(committed=4, input_end=10), 1: Lag(0, 0)})
    assert report.agrees and report.inputs_not_yet_processed == 6
    doc = report.as_json()
    assert doc["agrees"] and doc["not_yet_processed"]["inputs"] == 6
    assert doc["not_yet_processed"]["partitions"]["0"] == {"committed": 4, "input_end": 10, "inputs": 6}
