"""RSS of the fold over a growing ledger, without Kafka. Not a test: it reports.

    .venv/bin/python bench/memory_fold.py --children 1000000 [--partitions 8] [--store rocks|memory]
                                          [--checkpoint-events 2000] [--tracemalloc] [--avro]

What the processor does to memory, minus the broker: `partitions` RocksDB projections (one LedgerView and
Fold each, as `PartitionTask` builds them: a fold of one partition of `partitions`), the ledger fill of
bench/suite/backlog.py (parents of 64 children, one ChildReserved each) routed to the partitions by parent
as the producer's partitioner does (Kafka's murmur2, schemas/partitioning.py), a checkpoint every
`checkpoint-events` events (changes encoded, the views' buffers forgotten, the RocksDB batches written, in
the processor's order). Prints VmRSS against children folded, the view caches' size and RocksDB's own
memory figures; with `--tracemalloc`, the Python allocations that grew most between the first and the last
tenth of the fill (slow: use it on 100-200k children). With `--realistic N`, the seeded workload follows:
its events routed the same way, its Ticks folded into every partition as the processor folds its own
(Fold.tick, before the partition's next input offset: the workload's times stand in for the clock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.suite.backlog import ledger_fill_events  # noqa: E402
from branch_settlement.processors.kafka.ticks import tick_event  # noqa: E402
from branch_settlement.processors.ledger.fold import Fold  # noqa: E402
from branch_settlement.processors.ledger.outputs import Outputs  # noqa: E402
from branch_settlement.projections import view as view_module  # noqa: E402
from branch_settlement.projections.store import MemoryStore, RocksStore  # noqa: E402
from branch_settlement.projections.view import LedgerView  # noqa: E402
from branch_settlement.schemas.codec import default_codec  # noqa: E402
from branch_settlement.schemas.partitioning import partition_of  # noqa: E402

OUTPUT_RECORDS = (("results", "SettlementResult"), ("releases", "CapacityReleased"), ("audits", "AuditRecord"),
                  ("settled", "ParentSettled"))


def status_kb() -> dict[str, int]:
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, value = line.split(":", 1)
            found[name] = int(value.split()[0])
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--store", choices=("rocks", "memory"), default="rocks")
    parser.add_argument("--checkpoint-events", type=int, default=2000)
    parser.add_argument("--points", type=int, default=20, help="RSS samples over the fill")
    parser.add_argument("--realistic", type=int, default=0,
                        help="then this many events of the seeded realistic workload (its ticks folded into every "
                             "partition, as the processor's own)")
    parser.add_argument("--avro", action="store_true", help="encode and decode every event, as the processor does")
    parser.add_argument("--cache-mb", type=int, help="the process-wide view cache budget, estimated MB "
                        f"(default {view_module.DEFAULT_CACHE_BYTES >> 20})")
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--state-dir", help="where the RocksDB projections go (default: a temporary directory)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    if args.tracemalloc:
        import tracemalloc
        tracemalloc.start(8)
    if args.cache_mb is not None:
        view_module.set_cache_budget(args.cache_mb << 20)
    codec = default_codec()
    tmp = tempfile.TemporaryDirectory(prefix="memory-fold-", dir=args.state_dir)
    stores = [RocksStore(os.path.join(tmp.name, f"partition-{p}")) if args.store == "rocks" else MemoryStore()
              for p in range(args.partitions)]
    views = [LedgerView(store, codec.encode, codec.decode) for store in stores]
    folds = [Fold(view, p, args.partitions) for p, view in enumerate(views)]
    outs = [Outputs() for _ in range(args.partitions)]
    offsets = [0] * args.partitions
    dirty: set[int] = set()
    every = max(1, args.children // args.points)
    curve = []
    children = events = 0
    snapshots = []
    started = time.perf_counter()
    realistic = []
    if args.realistic:  # generated before the fill, so its memory is in the baseline
        from branch_settlement.processors.workload import Generator
        realistic = [codec.event_from_json(item) for item in Generator(9).generate(args.realistic)
                     if not isinstance(item, str)]
    print(f"start: RSS {status_kb()['VmRSS'] / 1024:.1f} MB", flush=True)

    def checkpoint() -> None:
        for p in sorted(dirty):
            out = outs[p]
            for attr, name in OUTPUT_RECORDS:
                for record in getattr(out, attr):
                    codec.encode(name, record)
            out.clear()
            changes = views[p].changes()
            views[p].mark_committed()
            stores[p].write(changes, offsets[p])
        dirty.clear()

    for event in ledger_fill_events(args.children):
        p = partition_of(event["parent_id"], args.partitions)
        event = codec.event_from_json(event)
        if args.avro:
            event = codec.decode_event(codec.encode_event(event))
        folds[p].apply(event, offsets[p], outs[p])
        offsets[p] += 1
        dirty.add(p)
        events += 1
        if event["type"] == "ChildReserved":
            children += 1
            if children % every == 0:
                status = status_kb()
                cached = view_module.cache_budget().cached_records()
                curve.append({"children": children, "rss_mb": round(status["VmRSS"] / 1024, 1), "cached": cached,
                              "timers": sum(v.pending_timer_count() for v in views)})
                print(f"{children:>10,} children  RSS {status['VmRSS'] / 1024:7.1f} MB  cached records {cached:>8,}"
                      f"  {time.perf_counter() - started:6.0f} s", flush=True)
                if args.tracemalloc and (children == every or children // every == args.points):
                    snapshots.append(tracemalloc.take_snapshot())
        if events % args.checkpoint_events == 0:
            checkpoint()
    checkpoint()
    if args.realistic:
        fill_rss = status_kb()["VmRSS"]
        for n, event in enumerate(realistic):
            if event["type"] == "Tick":  # the processor's tick of each partition, at its input position
                for p in range(args.partitions):
                    folds[p].tick(tick_event(p, event["now_ms"]), offsets[p], outs[p])
                    dirty.add(p)
            else:
                p = partition_of(event["parent_id"], args.partitions)
                folds[p].apply(event, offsets[p], outs[p])
                offsets[p] += 1
                dirty.add(p)
            if (n + 1) % args.checkpoint_events == 0:
                checkpoint()
            if (n + 1) % max(1, args.realistic // 5) == 0:
                print(f"realistic {n + 1:>8,} events  RSS {status_kb()['VmRSS'] / 1024:7.1f} MB  cached records "
                      f"{view_module.cache_budget().cached_records():>8,}  timers "
                      f"{sum(v.pending_timer_count() for v in views):,}", flush=True)
        checkpoint()
        print(f"realistic events added {(status_kb()['VmRSS'] - fill_rss) / 1024:+.1f} MB", flush=True)
    status = status_kb()
    rocks = {}
    if args.store == "rocks":
        for prop in ("rocksdb.cur-size-all-mem-tables", "rocksdb.estimate-table-readers-mem"):
            try:
                rocks[prop] = sum(s._db.property_int_value(prop) or 0 for s in stores)
            except Exception as exc:  # a property the binding does not expose
                rocks[prop] = repr(exc)
        from branch_settlement.projections import store as store_module
        if store_module._shared:
            rocks["shared block cache usage"] = store_module._shared["cache"].get_usage()
            rocks["shared block cache pinned"] = store_module._shared["cache"].get_pinned_usage()
            rocks["write buffer manager usage"] = store_module._shared["write_buffers"].get_usage()
    print(f"end: {children:,} children, {events:,} events in {time.perf_counter() - started:.0f} s; "
          f"RSS {status['VmRSS'] / 1024:.1f} MB, peak {status['VmHWM'] / 1024:.1f} MB; "
          f"cache budget {view_module.cache_budget().bytes >> 20} MB (estimated)")
    for prop, value in rocks.items():
        print(f"  {prop}: {value if isinstance(value, str) else f'{value / 2**20:.1f} MB'}")
    if len(snapshots) == 2:
        print("tracemalloc: grew most between the first and the last sample")
        for stat in snapshots[1].compare_to(snapshots[0], "traceback")[:12]:
            print(f"  {stat.size_diff / 2**20:+8.1f} MB  {stat.count_diff:+9,} blocks")
            for line in stat.traceback.format()[-6:]:
                print("     ", line)
    doc = {"children": children, "events": events, "partitions": args.partitions, "store": args.store,
           "checkpoint_events": args.checkpoint_events, "rss_mb": round(status["VmRSS"] / 1024, 1),
           "peak_rss_mb": round(status["VmHWM"] / 1024, 1), "view_cache_mb": view_module.cache_budget().bytes >> 20,
           "rocksdb": rocks, "curve": curve}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    for store in stores:
        store.close()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
