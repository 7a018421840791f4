"""`make demo`: the worked example (examples/worked-example.jsonl) through the real pipeline, start to finish.

Provisions fresh topics on the broker, starts `settle run` with its clock in a file, plays the worked example
(`play`): its events are published with `settle produce`, and its Tick lines, which only the processor may
make, move the processor's clock instead, once everything before them is folded. Then it shows the committed
results, releases and the ledger, closes the parent to show the release to the global pool, and stops the
processor cleanly. Everything it shows is read back from Kafka (read_committed) or from the processor's
projection; a step that fails stops the demo with that step's own error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from confluent_kafka.admin import AdminClient

from branch_settlement.processors.kafka import topics
from branch_settlement.processors.kafka.clients import read_outputs
from branch_settlement.processors.kafka.connection import BOOTSTRAP_SERVERS_ENV, DEFAULT_BOOTSTRAP_SERVERS
from branch_settlement.schemas.partitioning import partition_of

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "worked-example.jsonl"
CLOSE = {"type": "ParentClosed", "event_id": "we-15", "idempotency_key": "wf-42/ParentClosed/1",
         "parent_id": "wf-42", "occurred_at_ms": 1764410400150, "outcome": "succeeded"}


def settle(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], cwd=REPO, text=True, **kwargs)


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(0.25)


def set_clock(clock_file: Path, now_ms: int) -> None:
    """Move the processor's clock (`settle run --clock-file`): written whole, then renamed into place."""
    part = clock_file.with_name(clock_file.name + ".part")
    part.write_text(f"{now_ms}\n")
    os.replace(part, clock_file)


def play(example: Path, workdir: Path, clock_file: Path, produce, results, partitions: int,
         timeout_s: float = 60.0) -> int:
    """Play a JSON Lines example through a running processor whose clock is `clock_file`, in the example's
    order: its events are published by `produce(path of a JSON Lines file)`; at each of its Tick lines, once
    `results()` (the committed result records) has every event published so far, the clock moves to the
    tick's time and the play waits until each of the `partitions` has folded its own tick at that time.
    Returns how many events were published."""
    published, batch, segment = 0, [], 0

    def flush() -> None:
        nonlocal published, batch, segment
        if not batch:
            return
        segment += 1
        path = workdir / f"segment-{segment}.jsonl"
        path.write_text("".join(batch))
        produce(path)
        published += len(batch)
        batch = []

    for line in example.read_text().splitlines(keepends=True):
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("type") != "Tick":
            batch.append(line)
            continue
        flush()
        wanted = published
        wait_for(lambda: sum(r["event_type"] != "Tick" for r in results()) >= wanted,
                 f"{wanted} events folded", timeout_s)
        set_clock(clock_file, event["now_ms"])
        now = event["now_ms"]
        wait_for(lambda: sum(r["event_type"] == "Tick" and r["ledger_time_ms"] == now for r in results()) >= partitions,
                 f"the processor's ticks at {now} in {partitions} partitions", timeout_s)
    flush()
    wanted = published
    wait_for(lambda: sum(r["event_type"] != "Tick" for r in results()) >= wanted, f"{wanted} events folded", timeout_s)
    return published


def main() -> int:
    example = EXAMPLE
    bootstrap = os.environ.get(BOOTSTRAP_SERVERS_ENV, DEFAULT_BOOTSTRAP_SERVERS)
    prefix = time.strftime("demo-%Y%m%dT%H%M%S.")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    spec = topics.load_spec(prefix=prefix)
    topics.apply(admin, spec)
    names = {t.logical_name: t.name for t in spec.topics}
    print(f"== topics {prefix}* created on {bootstrap}")
    state = Path(tempfile.mkdtemp(prefix="settle-demo-"))
    log_path = state / "processor.log"
    clock_file = state / "clock"
    common = ("--bootstrap-servers", bootstrap, "--topic-prefix", prefix)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "branch_settlement.processors.cli.main", "run", *common, "--state-dir", str(state),
                                 "--group-id", "demo", "--worker-slot", "demo", "--clock-file", str(clock_file),
                                 "--tick-interval-ms", "1"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "assigned partitions" in log_path.read_text(), "the processor to join its group")
        print(f"== processor running (pid {proc.pid}), log {log_path}; its clock is {clock_file}")

        def produce(path: Path) -> None:
            out = settle("produce", str(path), *common, capture_output=True)
            if out.returncode != 0:
                raise SystemExit(f"demo: settle produce {path.name} failed:\n{out.stderr.strip()}")
            print(f"== settle produce: {out.stdout.strip()}")

        partitions = spec.topic("branch-events").partitions
        config = {"bootstrap.servers": bootstrap}
        committed = lambda: [o.record for o in read_outputs(config, [names["settlement-results"]], idle_timeout_s=0.5)]
        play(example, state, clock_file, produce, committed, partitions)
        results = collect(bootstrap, names, expected=13 + 2 * partitions)
        home = partition_of("wf-42", partitions)
        print(f"\n== settlement-results (read_committed), parent wf-42 and the ticks of its partition {home}")
        for r in results:
            if r["parent_id"] == "wf-42" or r["event_type"] == "Tick" and r["input_partition"] == home:
                print(f"  {r['event_id']:<22} {r['event_type']:<16} {r['result']:<10} ledger time {r['ledger_time_ms']}")
        show_releases(bootstrap, names)
        print("\n== ledger, from the processor's projection (settle inspect wf-42)")
        settle("inspect", "wf-42", "--state-dir", str(state), "--group-id", "demo")
        closing = state / "close.jsonl"
        closing.write_text(json.dumps(CLOSE) + "\n")
        produce(closing)
        collect(bootstrap, names, expected=13 + 2 * partitions + 1)
        print("\n== after ParentClosed (outcome succeeded)")
        show_releases(bootstrap, names)
        settle("inspect", "wf-42", "--state-dir", str(state), "--group-id", "demo")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    print(f"\n== processor stopped ({'cleanly' if code == 0 else f'exit {code}'}); topics {prefix}* are kept "
          f"for inspection")
    return code


def collect(bootstrap: str, names: dict, expected: int) -> list[dict]:
    config = {"bootstrap.servers": bootstrap}
    found: list[dict] = []

    def enough() -> bool:
        found[:] = [o.record for o in read_outputs(config, [names["settlement-results"]], idle_timeout_s=1)]
        return len(found) >= expected

    wait_for(enough, f"{expected} results")
    return found


def show_releases(bootstrap: str, names: dict) -> None:
    print("\n== capacity-releases (read_committed)")
    for o in read_outputs({"bootstrap.servers": bootstrap}, [names["capacity-releases"]], idle_timeout_s=1):
        r = o.record
        if o.kind == "CapacityReleased":
            who = f"child {r['child_id']}" if r["child_id"] else "unassigned balance"
            print(f"  {r['parent_id']} {who:<18} {r['dimension']} {r['quantity']:>3} -> {r['destination']:<11} "
                  f"({r['reason']}; available after: {r['balance']['available']})")
        else:
            print(f"  {r['parent_id']} settled ({r['outcome']}): "
                  + ", ".join(f"{d} committed {b['committed']}, returned {b['returned_to_pool']}"
                              for d, b in r["dimensions"].items()))


if __name__ == "__main__":
    sys.exit(main())
