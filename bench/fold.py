"""Benchmark of the fold alone, outside Kafka. Not a test: it reports, it does not assert.

    .venv/bin/python bench/fold.py [--events 100000] [--seed 7] [--checkpoint-events 1000] [--repeat 1]

Three figures on one seeded realistic workload (processors/workload.py), all one process:
- fold:            fold + in-memory store, events already decoded (state encoded at each checkpoint);
- fold+rocksdb:    the same into a RocksDB projection;
- fold+rocksdb+avro: also decoding every input from Avro single-object bytes and encoding every
                   output (results, releases, audit records, parent summaries) to Avro, as the processor does.
Each figure is the fastest of `--repeat` runs (on a shared machine, the run least disturbed by others), in
wall-clock events/s and in CPU microseconds per event (process time: what the load of other processes moves
least, so the figure to compare between runs on a busy machine).
Writes bench/results/fold.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from branch_settlement.processors import gc_tuning  # noqa: E402
from branch_settlement.processors.ledger.fold import Fold  # noqa: E402
from branch_settlement.processors.ledger.outputs import Outputs  # noqa: E402
from branch_settlement.processors.replay.replayer import open_view  # noqa: E402
from branch_settlement.processors.workload import Generator  # noqa: E402
from branch_settlement.projections.store import MemoryStore, RocksStore  # noqa: E402
from branch_settlement.schemas.codec import default_codec  # noqa: E402
from branch_settlement.processors.ledger.outputs import OUTPUT_ROUTES  # noqa: E402

# (Outputs list, record name), from the one routing table.
OUTPUT_RECORDS = tuple((attr, name) for attr, _, name in OUTPUT_ROUTES)


def workload(seed: int, events: int) -> list[dict]:
    codec = default_codec()
    decoded = []
    for record in Generator(seed).generate(events):
        if isinstance(record, str):
            continue  # malformed records never reach the fold
        decoded.append(codec.event_from_json(record))
    return decoded


def run(events: list[dict], store, checkpoint_events: int, avro: bool) -> tuple[float, float, int]:
    codec = default_codec()
    inputs = [codec.encode_event(e) for e in events] if avro else events
    view = open_view(store, codec)
    fold = Fold(view)
    out = Outputs()
    produced = 0
    cpu_started = time.process_time()
    started = time.perf_counter()
    for offset, item in enumerate(inputs):
        event = codec.decode_event(item) if avro else item
        fold.apply(event, offset, out)
        if (offset + 1) % checkpoint_events == 0 or offset + 1 == len(inputs):
            if avro:
                for attr, name in OUTPUT_RECORDS:
                    for record in getattr(out, attr):
                        codec.encode(name, record)
            produced += out.count()
            out.clear()
            store.write(view.changes(), offset)
            view.mark_committed()
            gc_tuning.after_checkpoint()  # as the processor does
    return time.perf_counter() - started, time.process_time() - cpu_started, produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--checkpoint-events", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per figure; the fastest is reported")
    parser.add_argument("--default-gc", action="store_true",
                        help="leave the cyclic collector as CPython sets it (no freezing at checkpoints)")
    args = parser.parse_args()
    gc_tuning.enabled = not args.default_gc
    events = workload(args.seed, args.events)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make_store, avro in (
            ("fold", lambda path: MemoryStore(), False),
            ("fold+rocksdb", RocksStore, False),
            ("fold+rocksdb+avro", RocksStore, True),
        ):
            runs = []
            for attempt in range(args.repeat):
                store = make_store(os.path.join(tmp, f"{name}-{attempt}"))  # every run starts empty
                runs.append(run(events, store, args.checkpoint_events, avro))
                store.close()
            seconds, _, produced = min(runs)
            cpu_seconds = min(cpu for _, cpu, _ in runs)
            cpu_us = cpu_seconds / len(events) * 1e6
            figures[name] = {"events_per_s": round(len(events) / seconds), "seconds": round(seconds, 3),
                             "cpu_us_per_event": round(cpu_us, 2), "outputs": produced}
            print(f"{name:<20} {len(events) / seconds:>10,.0f} events/s  {cpu_us:7.2f} CPU us/event  "
                  f"({len(events)} events, {produced} outputs, {seconds:.2f} s)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    load = os.getloadavg()[0]
    report = {"benchmark": "fold", "git_commit": commit, "events": len(events), "seed": args.seed,
              "load_average_at_end": round(load, 2),
              "checkpoint_events": args.checkpoint_events, "repeat": args.repeat, "default_gc": args.default_gc,
              "python": platform.python_version(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "figures": figures}
    target = Path(__file__).resolve().parent / "results" / "fold.json"
    target.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {target}")


if __name__ == "__main__":
    main()
