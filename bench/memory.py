"""Peak RSS of `settle run` with a large ledger, alone: the memory section of bench/run.py
(bench/suite/memory.py) without the rest of the suite, for ledgers too large for a suite run.

    .venv/bin/python bench/memory.py --children 1000000 --output-dir bench/results/children-1m
    .venv/bin/python bench/memory.py --children 5000000 --output-dir bench/results/children-5m   # ~30 min here

One processor folds the ledger fill (parents of 64 children, one ChildReserved each) while its VmRSS is
sampled against the children committed, then a realistic batch; a second reopens the projections and folds
another; a third restores them from the changelog and folds a third. Each phase's figure is the kernel's
VmHWM of that process. Writes OUTPUT_DIR/memory.json and memory.md. Needs the broker (`make kafka-up`);
topics `bench.<run id>.memory.*` and the run's consumer groups are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import RSS_FLAT_MB_PER_100K_CHILDREN, RSS_TARGET_MB, rss_growth_mb_per_100k  # noqa: E402
from bench.suite import backlog, memory  # noqa: E402
from bench.suite.env import Env, git_commit, kafka_version, machine  # noqa: E402
from bench.suite.procs import Procs  # noqa: E402
from branch_settlement.processors.kafka.connection import DEFAULT_BOOTSTRAP_SERVERS  # noqa: E402
from branch_settlement.projections import store, view  # noqa: E402


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def markdown(doc: dict) -> str:
    m, mem = doc["machine"], doc["memory"]
    fill = mem["fill"]
    phases = ", ".join(f"{phase} {mb:,.1f}" for phase, mb in mem["peak_rss_mb_by_phase"].items())
    curve = ", ".join(f"{p['children']:,}: {p['rss_mb']:,.1f}" for p in mem["rss_vs_ledger"])
    growth = mem["rss_growth_mb_per_100k_children"]
    return "\n".join([
        f"# Peak RSS of `settle run` with {mem['children_in_ledger']:,} children in the ledger",
        "",
        f"`{doc['command']}` at commit `{doc['git']['commit']}`"
        f"{' (uncommitted: ' + ', '.join(doc['git']['dirty_files']) + ')' if doc['git']['dirty_files'] else ''}, "
        f"{doc['started_at']}, {doc['duration_s']:,.0f} s.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_mb']:,} MB; Python {m['python']}, librdkafka "
        f"{m['librdkafka']}, {doc['kafka']} (shared); load average {m['load_avg_at_start'][0]:.1f} at start, "
        f"{doc['load_avg_at_end'][0]:.1f} at end.",
        "",
        f"Processor memory settings (defaults): view cache {doc['settings']['view_cache_mb']} MB (estimated) for the "
        f"whole process; RocksDB block cache {doc['settings']['rocksdb_cache_mb']} MB shared by every partition, "
        f"memtables {doc['settings']['rocksdb_write_buffers_mb']} MB in all (charged to that cache).",
        "",
        "| measurement | value | target | met |",
        "|---|---|---|---|",
        f"| peak RSS, {mem['children_in_ledger']:,} children (MB) | {mem['peak_rss_mb']:,.1f} | < {RSS_TARGET_MB} "
        f"| {'yes' if mem['peak_rss_mb'] < RSS_TARGET_MB else '**no**'} |",
        f"| RSS growth over the second half of the fill (MB per 100k children) | "
        f"{'–' if growth is None else f'{growth:,.1f}'} | < {RSS_FLAT_MB_PER_100K_CHILDREN:g} (flat) | "
        f"{'yes' if growth is not None and growth < RSS_FLAT_MB_PER_100K_CHILDREN else '**no**'} |",
        f"| fill: input records, events/s (10–50%, 50–90%) | {fill['records']:,}, {fill['events_per_s']:,.0f} "
        f"({fill['events_per_s_10_to_50']:,}, {fill['events_per_s_50_to_90']:,}) | | |",
        "| restart with a restore from the changelog (s, to partitions assigned) | "
        f"{mem['processor_restart_with_restore_s']} | | |",
        "",
        f"Peak RSS by phase (MB): {phases}.",
        "",
        f"RSS while the ledger grows (children: MB): {curve}.",
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=1_000_000)
    parser.add_argument("--on-top-events", type=int, default=20_000,
                        help="realistic generator events folded over the large ledger, per phase")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP_SERVERS)
    parser.add_argument("--output-dir", required=True, help="where memory.json and memory.md go")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    started, started_wall = time.monotonic(), datetime.now(timezone.utc)
    doc: dict = {"benchmark": "settle run peak RSS with a large ledger",
                 "command": " ".join([".venv/bin/python bench/memory.py", *sys.argv[1:]]),
                 "started_at": started_wall.isoformat(timespec="seconds"), "git": git_commit(), "machine": machine(),
                 "kafka": kafka_version(),
                 "settings": {"children": args.children, "on_top_events": args.on_top_events, "seed": args.seed,
                              "view_cache_mb": view.cache_budget().bytes >> 20,
                              "rocksdb_cache_mb": store.ROCKSDB_CACHE_BYTES // 2**20,
                              "rocksdb_write_buffers_mb": store.ROCKSDB_WRITE_BUFFERS_BYTES // 2**20}}
    work_dir = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    env = Env(args.bootstrap_servers)
    procs = Procs(work_dir)
    log(f"run {env.run_id}: {args.children:,} children, topics bench.{env.run_id}.memory.*, logs in {work_dir}")
    try:
        topic_set = env.topic_set("memory")
        top = backlog.realistic(args.seed + 2, 3 * args.on_top_events, topic_set.partitions)
        thirds = [top[i * len(top) // 3:(i + 1) * len(top) // 3] for i in range(3)]
        mem = memory.measure(env, procs, topic_set, args.children, thirds, work_dir).as_dict()
        mem["rss_growth_mb_per_100k_children"] = rss_growth_mb_per_100k(mem["rss_vs_ledger"])
        doc["memory"] = mem
    except BaseException:
        log(f"failed; logs kept in {work_dir}")
        raise
    finally:
        procs.stop_all()
        env.delete_all()
    doc["load_avg_at_end"] = list(os.getloadavg())
    doc["duration_s"] = round(time.monotonic() - started, 1)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "memory.md").write_text(markdown(doc))
    print(markdown(doc))
    log(f"peak RSS {mem['peak_rss_mb']} MB by phase {mem['peak_rss_mb_by_phase']}; written {out}/memory.{{json,md}}")
    if args.keep_logs:
        log(f"logs kept in {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
