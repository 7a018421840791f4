"""The scenarios on the replicated cluster (faults/cluster.py: three controllers, three brokers, replication
factor 3, min.insync.replicas 2 for every topic and for __consumer_offsets and __transaction_state). The
processors tick as everywhere else (faults/processes.py); the stream, the reader and the verifier are the
shared broker's. Each fault is found on the cluster when it is injected (which broker leads the input, which
one coordinates the processor's transactions, which controller is active), and the scenario waits, as an
operator would, until the cluster has healed (every broker listed, every ISR whole) before the next one:
with min.insync.replicas 2 the cluster survives one broker at a time.

What a replicated cluster adds to the verifier's invariants:

R1  the layout: every topic of the scenario, __consumer_offsets and __transaction_state have replication
    factor 3, min.insync.replicas 2 and no unclean leader election, read back from the cluster, and at the
    end every partition of the scenario's topics has a leader and its whole ISR;
R2  no committed output lost or rewritten by a failover: every record the read_committed reader saw
    committed during the run (on settlement-results and capacity-releases, before, during and after each
    leader's death) is in the final log at the same offset with the same key and value. acks=all with
    min.insync.replicas 2 (and no unclean election) promises it; a new leader that truncated a committed
    record would break it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from faults.cluster import BROKER_IDS, ReplicatedCluster
from faults.kafka_io import TICKS_TOPIC, read_partitions, record_digest
from faults.scenarios import STALL_S, Run, Size

LAYOUT = ("own cluster: 3 KRaft controllers (a quorum) and 3 brokers on 127.0.0.1, replication factor 3, "
          "min.insync.replicas 2, the internal topics alike")
# How many faults each scenario injects: the input is published in 2n + 1 parts (Run.publish_next), fault i
# comes at three quarters of part 2i + 1, the next part is published right after the fault (the publisher goes
# through the failover too) and the one after once the cluster has healed, so every fault lands while the
# processor has input to fold, and so does the next one, whatever the machine's speed.
FAULTS = {"leader_kill": 2, "coordinator_kill": 2, "controller_kill": 2, "rolling_restart": 3, "rebalance_kill": 2}
TXN_ID_PREFIX = "branch-settlement"  # the processor's default --transactional-id-prefix (processors/kafka/config.py)


def transactional_id(run: Run, slot: str) -> str:
    """transactional.id = topic prefix + prefix-worker_slot (processors/kafka/config.py)."""
    return f"{run.topics.prefix}{TXN_ID_PREFIX}-{slot}"


class Faults:
    """What the scenario did to the cluster, and what it took to heal."""

    def __init__(self, run: Run, cluster: ReplicatedCluster, count: int) -> None:
        self.run = run
        self.cluster = cluster
        self.count = count
        self.actions: list[dict] = []
        self.seen_at_faults: list[int] = []  # records the reader had seen committed at each fault

    def progress(self) -> float:
        return round(self.run.progress() / max(self.run.expected, 1), 3)

    def note(self, **what) -> None:
        self.actions.append({"at_fraction": self.progress(), **what})

    def at(self, i: int) -> float:
        """The fraction of the results at which fault i (from 0) is injected."""
        return (2 * i + 0.75) / (2 * self.count + 1)

    def fractions(self):
        return [self.at(i) for i in range(self.count)]

    def mark_seen(self) -> None:
        self.seen_at_faults.append(sum(len(v) for v in list(self.run.reader.seen.values())))

    def kill_broker(self, node: int, kind: str, why: str) -> None:
        """kill -9 a broker under load, wait until the controller has fenced it, start it again, wait until
        every ISR is whole."""
        run, cluster = self.run, self.cluster
        self.mark_seen()
        led = sum(1 for v in cluster.leaders(run.topics.names.values()).values() if v == node)
        run.fault(kind)
        at = self.progress()
        cluster.kill9(node)
        run.publish_next()
        fenced_s = cluster.wait_fenced(node, poll=run.supervise)
        cluster.start(node)
        healed_s = cluster.wait_healthy(poll=run.supervise)
        run.publish_next()
        self.note(at_fraction=at, fault=kind, node=node, why=why, led_partitions_of_the_scenario=led,
                  fenced_after_s=round(fenced_s, 1),
                  whole_again_after_restart_s=round(healed_s, 1))

    def restart_broker(self, node: int) -> None:
        """A clean restart: SIGTERM (controlled shutdown: its leaders move first), start, ISR whole again."""
        run, cluster = self.run, self.cluster
        self.mark_seen()
        run.fault("broker_rolling_restart")
        at = self.progress()
        started = time.monotonic()
        cluster.stop(node)
        stopped_s = time.monotonic() - started
        run.publish_next()
        fenced_s = cluster.wait_fenced(node, poll=run.supervise)
        cluster.start(node)
        healed_s = cluster.wait_healthy(poll=run.supervise)
        run.publish_next()
        self.note(at_fraction=at, fault="broker_rolling_restart", node=node, stop_s=round(stopped_s, 1),
                  unlisted_after_s=round(fenced_s, 1), whole_again_after_restart_s=round(healed_s, 1))

    def checks(self) -> dict:
        """R1 and R2, once every processor has stopped."""
        return {"R1": self.layout(), "R2": self.survived()}

    def layout(self) -> dict:
        names = list(self.run.topics.names.values())
        layout = self.cluster.check_layout(names)
        healed_s = None
        try:
            healed_s = self.cluster.wait_healthy(timeout_s=120)
            not_whole = []
        except TimeoutError:
            not_whole = self.cluster.under_replicated(set(names))
        problems = layout["problems"] + not_whole[:5]
        return {**layout, "ok": layout["ok"] and not not_whole, "problems": problems,
                "mismatches": len(problems), "isr_whole_at_end": not not_whole,
                "waited_for_isr_s": None if healed_s is None else round(healed_s, 1)}

    def survived(self) -> dict:
        reader = self.run.reader
        final: dict[tuple[str, int], dict[int, bytes]] = {}
        for topic in (reader.results_topic, reader.releases_topic):
            for p, records in read_partitions(self.run.bootstrap, topic, decode=False).items():
                final[(topic, p)] = {offset: record_digest(key, value) for offset, key, value in records}
        return {**compare_seen({k: list(v) for k, v in list(reader.seen.items())}, final),
                "seen_committed_at_each_fault": self.seen_at_faults}


def compare_seen(seen: dict, final: dict) -> dict:
    """R2 over what the reader saw ((topic, partition) -> [(offset, digest)]) and the final logs ((topic,
    partition) -> {offset: digest}): every record seen must be there, at its offset, unchanged."""
    missing = changed = checked = 0
    examples = []
    for where, records in seen.items():
        got = final.get(where, {})
        for offset, digest in records:
            checked += 1
            if got.get(offset) == digest:
                continue
            if offset in got:
                changed += 1
            else:
                missing += 1
            if len(examples) < 5:
                examples.append(f"{where[0]}[{where[1]}]@{offset} {'changed' if offset in got else 'gone'}")
    return {"ok": checked > 0 and not missing and not changed, "records_checked": checked, "missing": missing,
            "mismatches": changed, "examples": examples}


# -- the scenarios ------------------------------------------------------------------------------------------


def leader_kill(run: Run, faults: Faults) -> dict:
    """kill -9 of the broker that leads branch-events[0], then of the one that leads the most partitions of the
    outputs, changelog and ticks, each under load and started again."""
    run.wait_running(run.start("a"))
    run.wait_fraction(faults.at(0))
    node = faults.cluster.leader(run.topics.name("branch-events"), 0)
    faults.kill_broker(node, "input_leader_kill_9", "leader of branch-events[0]")
    run.wait_fraction(faults.at(1))
    outputs = [run.topics.name(t) for t in ("settlement-results", "capacity-releases", "settlement-audit",
                                            "branch-events-dlq", "ledger-changelog", TICKS_TOPIC)]
    leaders = faults.cluster.leaders(outputs)
    node = max(BROKER_IDS, key=lambda n: sum(1 for v in leaders.values() if v == n))
    led = sorted(k for k, v in leaders.items() if v == node)
    faults.kill_broker(node, "output_leader_kill_9", f"leader of {len(led)} output partitions, e.g. {led[:3]}")
    return run.finish("a", extra_checks=faults.checks)


def coordinator_kill(run: Run, faults: Faults) -> dict:
    """kill -9 of the broker that is the transaction coordinator of the processor's transactional id (asked of
    the cluster each time: it moves to another replica of its __transaction_state partition), twice."""
    run.wait_running(run.start("a"))
    for fraction in faults.fractions():
        run.wait_fraction(fraction)
        info = faults.cluster.coordinator(transactional_id(run, "a"))
        faults.kill_broker(info["coordinator"], "txn_coordinator_kill_9",
                           f"coordinator of {transactional_id(run, 'a')} (__transaction_state"
                           f"[{info['txn_state_partition']}], transaction {info['state']})")
    return run.finish("a", extra_checks=faults.checks)


def controller_kill(run: Run, faults: Faults) -> dict:
    """kill -9 of the active controller (the quorum's leader), twice: the other two elect a new leader;
    the killed one is started again and rejoins as a follower."""
    run.wait_running(run.start("a"))
    cluster = faults.cluster
    for fraction in faults.fractions():
        run.wait_fraction(fraction)
        old = cluster.active_controller()
        faults.mark_seen()
        run.fault("active_controller_kill_9")
        at = faults.progress()
        cluster.kill9(old)
        run.publish_next()
        new, elected_s = cluster.wait_new_controller(old, poll=run.supervise)
        cluster.start(old)
        healed_s = cluster.wait_healthy(poll=run.supervise)
        run.publish_next()
        faults.note(at_fraction=at, fault="active_controller_kill_9", node=old, new_active_controller=new,
                    new_leader_after_s=round(elected_s, 1), whole_again_after_restart_s=round(healed_s, 1))
    return run.finish("a", extra_checks=faults.checks)


def rolling_restart(run: Run, faults: Faults) -> dict:
    """A clean restart of each broker in turn, the next only once every ISR is whole again
    (as an operator's rolling restart waits for no under-replicated partitions)."""
    run.wait_running(run.start("a"))
    for fraction, node in zip(faults.fractions(), BROKER_IDS):
        run.wait_fraction(fraction)
        faults.restart_broker(node)
    return run.finish("a", extra_checks=faults.checks)


def _tail(proc) -> int:
    try:
        return proc.log_path.stat().st_size
    except OSError:
        return 0


def _since(proc, offset: int) -> str:
    with open(proc.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _wait_revoked(run: Run, members: dict, joiner, timeout_s: float = 90) -> str:
    """Until one of `members` (slot -> (process, log offset when the joiner started)) logs that it revoked its
    partitions for the joiner's rebalance: the rebalance is then in progress. Returns that member's slot."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for slot, (proc, offset) in members.items():
            if "revoked partitions" in _since(proc, offset):
                return slot
        if not joiner.alive():
            break
        run.supervise()
        time.sleep(0.01)
    raise TimeoutError(f"no member revoked its partitions for {joiner.slot}'s join within {timeout_s:.0f} s")


def rebalance_kill(run: Run, faults: Faults) -> dict:
    """kill -9 of a processor during a rebalance a second instance's join started: first the old member, once
    it has revoked its partitions and before it is assigned again (its successor must take over after its
    session expires; it is started again and rejoins); then a third instance, the joiner, while the others
    have revoked and before it has been assigned anything. Then one leaves cleanly and the first owns
    everything again."""
    a = run.start("a")
    run.wait_running(a)
    run.wait_fraction(faults.at(0))
    members = {"a": (a, _tail(a))}
    b = run.start("b")
    run.fault("instance_joined")
    _wait_revoked(run, members, b)
    mid = "assigned partitions" not in _since(a, members["a"][1]).split("revoked partitions")[-1]
    at = faults.progress()
    faults.mark_seen()
    run.release("a").kill()
    run.fault("processor_kill_9_in_rebalance")
    run.publish_next()
    faults.note(at_fraction=at, fault="processor_kill_9_in_rebalance", killed="a (the old member)",
                revoked_and_not_yet_assigned=mid)
    run.faults["killed_between_revoke_and_assign"] += int(mid)
    run.wait_running(run.start("a"))
    run.publish_next()
    run.wait_fraction(faults.at(1))
    members = {slot: (proc, _tail(proc)) for slot, proc in run.managed.items()}
    c = run.start("c")
    run.fault("instance_joined")
    revoked_by = _wait_revoked(run, members, c)
    mid = "assigned partitions" not in c.output()
    at = faults.progress()
    faults.mark_seen()
    run.release("c").kill()
    run.fault("joiner_kill_9_in_rebalance")
    run.publish_next()
    faults.note(at_fraction=at, fault="joiner_kill_9_in_rebalance", killed="c (the joiner)", revoked_by=revoked_by,
                joiner_not_yet_assigned=mid)
    run.faults["killed_between_revoke_and_assign"] += int(mid)
    run.wait_fraction(faults.at(1) + 1 / (2 * faults.count + 1))  # into the part published after the kill
    run.publish_next()
    run.fault("instance_left")
    run.release("b").stop()
    return run.finish("a", extra_checks=faults.checks)


REPLICATED = {
    "leader_kill": leader_kill,
    "coordinator_kill": coordinator_kill,
    "controller_kill": controller_kill,
    "rolling_restart": rolling_restart,
    "rebalance_kill": rebalance_kill,
}


def run_replicated(name: str, seed: int, size: Size, work: Path, cluster: ReplicatedCluster | None = None,
                   stall_s: float = STALL_S) -> dict:
    """One scenario on `cluster` (started or healed first), or on a cluster of its own that it tears down.
    The nodes' logs are copied beside the processors' logs."""
    own = cluster is None
    if own:
        cluster = ReplicatedCluster(work / f"{name}-cluster")
    run = None
    run_dir = work / name / f"seed-{seed}"
    first_action = len(cluster.events)
    try:
        started = time.monotonic()
        cluster.up()
        cluster_up_s = time.monotonic() - started
        run = Run(name, seed, size, cluster.bootstrap, run_dir, stall_s=stall_s, replication_factor=3,
                  input_parts=2 * FAULTS[name] + 1).setup()
        faults = Faults(run, cluster, FAULTS[name])
        report = REPLICATED[name](run, faults)
        report["where"] = LAYOUT
        report["cluster"] = {"brokers": cluster.bootstrap, "faults": faults.actions,
                             "node_actions": cluster.events[first_action:],
                             "cluster_up_or_healed_s": round(cluster_up_s, 1)}
        return report
    finally:
        if run is not None:
            run.cleanup()
        if own:
            cluster.ensure_stopped()
        if run_dir.is_dir():
            for label, log in cluster.logs().items():
                if log.exists():
                    shutil.copyfile(log, run_dir / f"kafka-{label}.log")
        if own:
            shutil.rmtree(cluster.run_dir, ignore_errors=True)
