"""A checkpoint's RocksDB batches alone, without Kafka or the fold: what the memtable's size, its bloom filter and
the write-ahead log cost in `RocksStore.write`'s two steps. Not a test: it reports.

    .venv/bin/python bench/store_write.py [--write-buffer-mb 2] [--no-memtable-bloom] [--no-wal]
                                          [--checkpoints 300] [--changes 340] [--partitions 8] [--seed 1]

`partitions` RocksStores with the project's options (projections/store.py) in a temporary directory; each
checkpoint writes one batch of `changes` changes to each, as the processor's store step does: 60% new keys
(as the idempotency records of new events, 40-byte keys, 60-byte values), 40% keys written before (as the
ledger's records of parents and children, 300-byte values). Prints, per checkpoint, the time filling the
batches (`fill_batch`, the compiled one where it is built) and writing them, the wall time, and the process's
CPU time (RocksDB's flush and compaction threads included). `--no-wal` only measures the log's share: the
processor keeps it (docs/decisions.md, 37).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import branch_settlement.projections.store as store_module  # noqa: E402
from branch_settlement.schemas import native  # noqa: E402

NEW_SHARE = 0.6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-buffer-mb", type=float,
                        default=store_module.WRITE_BUFFER_BYTES / (1 << 20),
                        help=f"one memtable's size (default {store_module.WRITE_BUFFER_BYTES >> 20}, the project's)")
    parser.add_argument("--no-memtable-bloom", action="store_true", help="without the memtable's bloom filter")
    parser.add_argument("--no-wal", action="store_true", help="without the write-ahead log (measurement only)")
    parser.add_argument("--checkpoints", type=int, default=300)
    parser.add_argument("--changes", type=int, default=340, help="changes per store and checkpoint")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    store_module.WRITE_BUFFER_BYTES = int(args.write_buffer_mb * (1 << 20))
    if args.no_memtable_bloom:
        store_module.MEMTABLE_BLOOM_RATIO = 0.0
    if native.compiled_function("fill_batch") is None:  # RocksStore.batch's compiled fill
        print("store_write: the compiled hot path is not built (make install builds it)", file=sys.stderr)
        return 1
    work_dir = Path(tempfile.mkdtemp(prefix="bench-store-"))
    try:
        stores = [store_module.RocksStore(work_dir / f"p{i}") for i in range(args.partitions)]
        if args.no_wal:
            for store in stores:
                options = store_module.write_options()
                options.disable_wal = True
                store._db.set_write_options(options)
        rnd = random.Random(args.seed)
        written: list[list[bytes]] = [[] for _ in stores]

        def changes(i: int) -> list[tuple[bytes, bytes]]:
            out = []
            for _ in range(args.changes):
                if written[i] and rnd.random() >= NEW_SHARE:
                    out.append((rnd.choice(written[i]), rnd.randbytes(300)))
                else:
                    key = b"i\0" + rnd.randbytes(19).hex().encode()
                    if rnd.random() < 0.3:
                        written[i].append(key)
                    out.append((key, rnd.randbytes(60)))
            return out

        batches = [[changes(i) for i in range(len(stores))] for _ in range(args.checkpoints)]
        filling = writing = 0.0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for n, checkpoint in enumerate(batches):
            for store, store_changes in zip(stores, checkpoint):
                started = time.perf_counter()
                batch = store.batch(store_changes, n)  # RocksStore.write's two steps, timed apart
                filled = time.perf_counter()
                store._db.write(batch)
                filling += filled - started
                writing += time.perf_counter() - filled
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        for store in stores:
            store.close()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    per = 1000 / args.checkpoints
    print(f"memtable {args.write_buffer_mb:g} MB{', no bloom' if args.no_memtable_bloom else ''}"
          f"{', no WAL' if args.no_wal else ''}: per checkpoint ({args.partitions} stores x {args.changes} changes) "
          f"fill {filling * per:.2f} ms, write {writing * per:.2f} ms; wall {wall * per:.2f} ms, "
          f"CPU {cpu * per:.2f} ms (RocksDB's threads included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
