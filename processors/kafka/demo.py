"""`make demo`: the worked example (SPEC §13) through the real pipeline, start to finish.

Provisions fresh topics on the broker, starts `settle run`, publishes the worked example with
`settle produce`, shows the committed results, releases and the ledger, then closes the parent to show the
release to the global pool, and stops the processor cleanly. Everything it shows is read back from Kafka
(read_committed) or from the processor's projection.
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

REPO = Path(__file__).resolve().parents[2]
CLOSE = {"type": "ParentClosed", "event_id": "we-15", "idempotency_key": "wf-42/ParentClosed/1",
         "parent_id": "wf-42", "occurred_at_ms": 1764410400150, "outcome": "succeeded"}


def settle(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], cwd=REPO, text=True, **kwargs)


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(0.5)


def main() -> int:
    example = Path(os.environ.get("SHARED_DIR", REPO.parent / "shared")) / "examples" / "worked-example.jsonl"
    bootstrap = os.environ.get(BOOTSTRAP_SERVERS_ENV, DEFAULT_BOOTSTRAP_SERVERS)
    prefix = time.strftime("demo-%Y%m%dT%H%M%S.")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    spec = topics.load_spec(prefix=prefix)
    topics.apply(admin, spec)
    names = {t.logical_name: t.name for t in spec.topics}
    print(f"== topics {prefix}* created on {bootstrap}")
    state = Path(tempfile.mkdtemp(prefix="settle-demo-"))
    log_path = state / "processor.log"
    common = ("--bootstrap-servers", bootstrap, "--topic-prefix", prefix)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "branch_settlement.processors.cli.main", "run", *common, "--state-dir", str(state),
                                 "--group-id", "demo", "--worker-slot", "demo", "--tick-interval-ms", "0"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "assigned partitions" in log_path.read_text(), "the processor to join its group")
        print(f"== processor running (pid {proc.pid}), log {log_path}")
        out = settle("produce", str(example), *common, capture_output=True)
        print(f"== settle produce {example.name}: {out.stdout.strip()}")
        results = collect(bootstrap, names, expected=13 + 2 * 8)
        print("\n== settlement-results (read_committed), parent wf-42")
        for r in results:
            if r["parent_id"] == "wf-42":
                print(f"  {r['event_id']:<7} {r['event_type']:<16} {r['result']}")
        show_releases(bootstrap, names)
        print("\n== ledger, from the processor's projection (settle inspect wf-42)")
        settle("inspect", "wf-42", "--state-dir", str(state), "--group-id", "demo")
        closing = state / "close.jsonl"
        closing.write_text(json.dumps(CLOSE) + "\n")
        settle("produce", str(closing), *common, capture_output=True)
        collect(bootstrap, names, expected=13 + 2 * 8 + 1)
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
