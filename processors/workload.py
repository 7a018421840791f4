"""A seeded, realistic workload of branch events, for benchmarks, integration tests and demos.

Parents with 4–64 children each; per child attempt: reservation, activation, a few usage reports and an
outcome. The mix (fractions of children): retries that keep their capacity, speculative pairs with a
winner, timeouts that go through reconciliation and settle by a late report, skips; plus duplicate
deliveries and malformed records over the whole stream. Events carry ledger-plausible times; Ticks are
included so that a file replays with leases expiring as they would live.

`generate()` yields JSON-ready dicts, or `str` for a malformed record (a JSON Lines line that is not an
event). The same seed gives the same stream.
"""

from __future__ import annotations

import heapq
import json
import random
from dataclasses import dataclass
from typing import Iterator

START_MS = 1_764_410_400_000
CHILD_LEASE_TTL_MS = 30_000
TICK_INTERVAL_MS = 1_000
EVENT_SPACING_MS = 5  # mean time between two events of one child


@dataclass(frozen=True)
class Mix:
    retries: float = 0.10
    speculative: float = 0.05
    timeouts: float = 0.03
    skips: float = 0.02
    duplicates: float = 0.05
    malformed: float = 0.01
    min_children: int = 4
    max_children: int = 64
    concurrent_parents: int = 8


class _Parent:
    """Emits one parent's events with their times into the shared schedule."""

    def __init__(self, gen: "Generator", parent_id: str, start_ms: int) -> None:
        self.g = gen
        self.id = parent_id
        self.t = start_ms
        self.n = 0

    def at(self, t_ms: int, etype: str, key: str, **fields) -> None:
        self.n += 1
        event = {"type": etype, "event_id": f"{self.id}-{self.n}", "idempotency_key": f"{self.id}/{key}",
                 "parent_id": self.id, "occurred_at_ms": t_ms, **fields}
        self.g.schedule(t_ms, event)

    def step(self) -> int:
        self.t += self.g.rng.randint(1, 2 * EVENT_SPACING_MS)
        return self.t

    def run(self) -> int:
        rng, mix = self.g.rng, self.g.mix
        children = rng.randint(mix.min_children, mix.max_children)
        sizes = [rng.randint(10, 1_000) for _ in range(children)]
        capacity = int(sum(sizes) * 1.25)
        self.at(self.step(), "ParentReserved", "ParentReserved/1",
                capacity={"tokens": {"quantity": capacity, "kind": "logical"}}, lease_ttl_ms=3_600_000,
                policy={"max_live_children": children + 8, "reconciliation_timeout_ms": 600_000,
                        "lending_limit": {}})
        last = self.t
        for index, size in enumerate(sizes):
            last = max(last, self.child(f"c{index}", size))
        self.at(last + 1, "ParentClosed", "ParentClosed/1", outcome="succeeded")
        return last

    def child(self, child_id: str, size: int) -> int:
        rng, mix = self.g.rng, self.g.mix
        attempt = f"{child_id}-a1"
        self.at(self.step(), "ChildReserved", f"{child_id}/{attempt}/reserve", child_id=child_id,
                branch_id=child_id, attempt_id=attempt, quantities={"tokens": size})
        roll = rng.random()
        if roll < mix.skips:
            self.at(self.step(), "ChildSkipped", f"{child_id}/{attempt}/skip", child_id=child_id,
                    attempt_id=attempt, reason="pruned")
            return self.t
        t0 = self.t
        if roll < mix.skips + mix.speculative:
            return self.speculative_pair(child_id, size)
        used = self.run_attempt(child_id, attempt, 1, size)
        if roll < mix.skips + mix.speculative + mix.retries:
            retry = f"{child_id}-a2"
            self.at(self.step(), "ChildFailed", f"{child_id}/{attempt}/fail", child_id=child_id,
                    attempt_id=attempt, lease_generation=1, activated=True, usage={"tokens": used},
                    reason="worker lost", retry_attempt_id=retry)
            used = self.run_attempt(child_id, retry, 2, size - used)
            attempt, generation = retry, 2
        else:
            generation = 1
        if roll > 1 - mix.timeouts:
            # no outcome before the lease ends: reconciliation, then a late final report
            late = t0 + CHILD_LEASE_TTL_MS + rng.randint(2_000, 20_000)
            self.at(late, "UsageReported", f"{child_id}/{attempt}/late", child_id=child_id, attempt_id=attempt,
                    lease_generation=generation, usage_report_id="late", usage={"tokens": rng.randint(0, 5)},
                    final=True)
            return late
        self.at(self.step(), "ChildCompleted", f"{child_id}/{attempt}/complete", child_id=child_id,
                attempt_id=attempt, lease_generation=generation, usage={"tokens": used})
        return self.t

    def run_attempt(self, child_id: str, attempt: str, generation: int, size: int) -> int:
        """Activation and a few non-final usage reports; returns the usage reported so far."""
        rng = self.g.rng
        self.at(self.step(), "ChildActivated", f"{child_id}/{attempt}/activate", child_id=child_id,
                attempt_id=attempt, lease_generation=generation, lease_ttl_ms=CHILD_LEASE_TTL_MS)
        used = 0
        for report in range(rng.randint(0, 3)):
            delta = rng.randint(0, max(size // 4, 0))
            used += delta
            self.at(self.step(), "UsageReported", f"{child_id}/{attempt}/u{report}", child_id=child_id,
                    attempt_id=attempt, lease_generation=generation, usage_report_id=f"u{report}",
                    usage={"tokens": delta}, final=False)
        return used

    def speculative_pair(self, child_id: str, size: int) -> int:
        rng = self.g.rng
        twin = f"{child_id}-spec"
        self.at(self.step(), "ChildReserved", f"{twin}/{twin}-a1/reserve", child_id=twin, branch_id=child_id,
                attempt_id=f"{twin}-a1", quantities={"tokens": size})
        a = self.run_attempt(child_id, f"{child_id}-a1", 1, size)
        b = self.run_attempt(twin, f"{twin}-a1", 1, size)
        self.at(self.step(), "SpeculativeWinner", f"{child_id}/winner", branch_id=child_id,
                winner_attempt_id=f"{child_id}-a1")
        self.at(self.step(), "ChildCompleted", f"{child_id}/{child_id}-a1/complete", child_id=child_id,
                attempt_id=f"{child_id}-a1", lease_generation=1, usage={"tokens": a + rng.randint(0, 5)})
        self.at(self.step(), "CancelAcknowledged", f"{twin}/{twin}-a1/ack", child_id=twin, attempt_id=f"{twin}-a1",
                lease_generation=1, usage={"tokens": b})
        return self.t


class Generator:
    def __init__(self, seed: int, mix: Mix = Mix()) -> None:
        self.rng = random.Random(seed)
        self.mix = mix
        self._heap: list[tuple[int, int, dict]] = []
        self._seq = 0

    def schedule(self, t_ms: int, event: dict) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t_ms, self._seq, event))

    def generate(self, events: int, ticks: bool = True, partition: int = 0) -> Iterator[dict | str]:
        """About `events` records (the last parents finish their lifecycles), in time order."""
        rng, mix = self.rng, self.mix
        planned, parents, next_tick = 0, 0, START_MS
        starts = [START_MS + i * 50 for i in range(mix.concurrent_parents)]
        emitted: list[dict] = []
        out = 0
        while self._heap or planned < events:
            while planned < events and (not self._heap or len(starts) and starts[0] <= self._heap[0][0]):
                start = heapq.heappop(starts) if starts else self._heap[0][0]
                before = self._seq
                end = _Parent(self, f"wf-{parents:06d}", start).run()
                parents += 1
                planned += self._seq - before
                heapq.heappush(starts, end + rng.randint(0, 200))
            if not self._heap:
                break
            t_ms, _, event = heapq.heappop(self._heap)
            while ticks and next_tick <= t_ms:
                yield {"type": "Tick", "event_id": f"tick-{partition}-{next_tick}",
                       "idempotency_key": f"tick/{partition}/{next_tick}", "parent_id": "",
                       "occurred_at_ms": next_tick, "now_ms": next_tick}
                next_tick += TICK_INTERVAL_MS
            yield event
            emitted.append(event)
            out += 1
            if rng.random() < mix.duplicates and emitted:
                original = emitted[-1 - rng.randint(0, min(len(emitted) - 1, 20))]
                yield dict(original, event_id=original["event_id"] + "-dup")
            if rng.random() < mix.malformed:
                yield rng.choice(['{"type": "ChildReserved", "event_id": "broken"', "not json at all",
                                  json.dumps({"type": "UsageReported", "event_id": "x", "parent_id": "p"})])
        if ticks:  # let every lease and reconciliation in flight run out
            final = next_tick + CHILD_LEASE_TTL_MS + 30_000
            yield {"type": "Tick", "event_id": f"tick-{partition}-{final}", "idempotency_key": f"tick/{partition}/{final}",
                   "parent_id": "", "occurred_at_ms": final, "now_ms": final}


def write_jsonl(path: str, seed: int, events: int, mix: Mix = Mix(), ticks: bool = True) -> int:
    count = 0
    with open(path, "w") as out:
        for record in Generator(seed, mix).generate(events, ticks):
            out.write((record if isinstance(record, str) else json.dumps(record, separators=(",", ":"))) + "\n")
            count += 1
    return count
