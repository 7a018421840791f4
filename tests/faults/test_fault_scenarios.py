"""The reduced fault scenarios (3,000 planned events over 4 partitions) through the same code as
`make faults`: each one injects its faults for real and the independent verifier must find nothing lost,
nothing released twice, the ledgers equal to the offline fold's (the committed input with the processors'
committed ticks merged in), every tick committed once with its result, and no transaction left open. The
processors tick from the system clock; every child whose late report the stream holds back must have
expired before it came."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults.run import run_scenario
from faults.scenarios import SHARED_BROKER, Size

pytestmark = [pytest.mark.fault, pytest.mark.kafka]

SIZE = Size(events=3_000, partitions=4)
OUTAGES_S = (5, 8)
EVERY_SCENARIO = ("I1", "I2", "I3", "I4", "I5", "I7", "I8")
INJECTED = {
    "input_adversity": {"duplicate_deliveries", "reordered_reports", "late_reports_after_expiry",
                        "stale_lease_generations", "malformed_records", "leases_shortened_for_late_reports"},
    "kill_9": {"processor_kill_9"},
    "sigterm_bounce": {"processor_sigterm"},
    "crash_points": {"crash_after_produce", "crash_after_send_offsets", "crash_after_commit", "crash_mid_restore"},
    "projection_deleted": {"projection_directory_deleted", "projection_partition_deleted"},
    "zombie": {"zombie_paused"},
    "rebalance_churn": {"instance_joined", "instance_left"},
    "broker_bounce": {"broker_kill_9", "broker_clean_restart"},
    "network_blackhole": {"broker_port_blackholed_5s", "broker_port_blackholed_8s", "blackhole_lifted"},
}


def assert_exactly_once(report: dict, name: str) -> None:
    assert not report.get("error"), f"{name} did not complete: {report.get('error')}\n{report.get('traceback')}"
    assert not report["unexpected_exits"], report["unexpected_exits"]
    assert not report["stalls"], report["stalls"]
    failed = {k: v for k, v in report["invariants"].items() if not v["ok"]}
    # In full: pytest shortens a dict in an assertion message, and the figures that say why are at its end.
    assert not failed, json.dumps({"failed": failed, "notes": report.get("notes"), "faults": report.get("faults")},
                                  indent=1, default=str)
    assert set(EVERY_SCENARIO) <= set(report["invariants"])
    for counter in ("duplicates", "missing", "mismatches", "open_transactions"):
        assert report[counter] == 0, (counter, report)
    assert report["results_observed"] == report["results_expected"] == report["events"] > SIZE.events
    assert report["releases_observed"] == report["releases_expected"] > 0
    # Ledger time came from the processors' own ticks, and the leases held back for late reports ran out.
    assert report["ticks_committed"] > 0
    assert report["lease_expiries"] >= report["faults"]["leases_shortened_for_late_reports"] > 0, report["faults"]
    assert INJECTED[name] <= set(report["faults"]), report["faults"]
    assert report["transactions_committed"] > 0


@pytest.mark.parametrize("name", list(SHARED_BROKER))
def test_scenario_on_the_shared_broker(name: str, shared_bootstrap: str, tmp_path: Path) -> None:
    report = run_scenario(name, 100 + list(SHARED_BROKER).index(name), SIZE, OUTAGES_S, tmp_path)
    assert_exactly_once(report, name)
    if name == "kill_9":
        assert report["faults"]["processor_kill_9"] == 3
    if name == "crash_points":
        assert report["faults"]["crash_mid_restore"] == 2
    if name == "zombie":
        zombie = report["invariants"]["I6"]
        assert zombie["ok"] and zombie["committed_records_before_resume"] == zombie["committed_records_after_resume"]
    if name == "rebalance_churn":
        assert report["faults"]["instance_joined"] == report["faults"]["instance_left"] == 2


def test_broker_hard_bounce_and_clean_restart(shared_bootstrap: str, tmp_path: Path) -> None:
    """On a cluster of the suite's own, a controller and a broker (the shared one is never touched): the broker
    is killed once (`make faults`: twice) and restarted cleanly once, each time after its controller fenced it.

    Safety and liveness: the processor recovers by itself from both restarts, with no operator and no
    watchdog. Two librdkafka behaviours made it need help before (docs/faults.md, findings 1 and 2): a
    transactional call blocking past its timeout (now bounded: the producer is given up and replaced) and a
    commit the restarting broker lost (the projection ahead of the committed offsets is now rebuilt from the
    changelog). The watchdog allows 120 s without progress: the broker's own restart takes 10-20 s here, and
    a rejoin can wait out the group's rebalance timeout (max.poll.interval.ms, 60 s) for members lost in the
    restart; a watchdog quicker than that kills each new processor while it waits, every time."""
    report = run_scenario("broker_bounce", 120, SIZE, OUTAGES_S, tmp_path, stall_s=120, hard_bounces=1)
    assert_exactly_once(report, "broker_bounce")
    assert report["faults"]["broker_kill_9"] == 1 and report["faults"]["broker_clean_restart"] == 1
    assert not report["operator_interventions"], report["operator_interventions"]


def test_broker_port_blackholed_in_a_private_network_namespace(shared_bootstrap: str, tmp_path: Path) -> None:
    report = run_scenario("network_blackhole", 121, SIZE, OUTAGES_S, tmp_path, stall_s=45)
    assert_exactly_once(report, "network_blackhole")
    assert "network namespace" in report["where"]
