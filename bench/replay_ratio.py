"""Replay against the live processor, side by side in one run (the target: a replay runs at least twice as
fast as the live processor).

    .venv/bin/python bench/replay_ratio.py                 # 40k generator events (bench-quick's size)
    .venv/bin/python bench/replay_ratio.py --events 100000 --repeat 2

One run: fresh topics `bench.<run id>.ratio.*`; the seeded realistic workload (bench/suite/backlog.py) goes
through one `settle run` process (exactly-once defaults, the backlog released at once, timed until the group
committed every offset: bench/suite/throughput.py); then, each in a fresh process, `settle replay FILE`'s path
over the same workload as JSON Lines and `settle replay --topic`'s audit replay of the processor's topics with
the live ledgers of its state directory (bench/suite/recovery.py), `--repeat` times; then the processor again
on fresh topics. Prints each rate, its ratio to the faster processor run, and the CPU time per input record of
each (user + system, every thread and worker process). Every topic and group is deleted at the end. The
machine is shared and noisy: compare the ratios, and the CPU per record, which the load moves less.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.suite import backlog, recovery, throughput  # noqa: E402
from bench.suite.env import Env, git_commit  # noqa: E402
from bench.suite.procs import Procs  # noqa: E402
from branch_settlement.processors.kafka.connection import DEFAULT_BOOTSTRAP_SERVERS  # noqa: E402


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=40_000, help="generator events (default %(default)s)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=1, help="replays per kind (the processor runs once)")
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP_SERVERS)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--setup-only", metavar="DIR", help="only run the processor; keep its topics, group and "
                        "state in DIR (setup.json says where) for profiling the replays; delete them yourself")
    args = parser.parse_args()

    work_dir = Path(tempfile.mkdtemp(prefix="bench-replay-ratio-"))
    env, procs = Env(args.bootstrap_servers), Procs(work_dir)
    doc = {"command": " ".join(["bench/replay_ratio.py", *sys.argv[1:]]), "git": git_commit(),
           "load_avg_at_start": list(os.getloadavg())}
    kept = False
    records = None

    def run_processor(label: str):
        """One `settle run` through the backlog on fresh topics: (topics, run, events/s, CPU us per record)."""
        nonlocal records
        topic_set = env.topic_set(label)
        if records is None:
            records = backlog.realistic(args.seed, args.events, topic_set.partitions)
            log(f"run {env.run_id}: the processor over {len(records):,} input records")
        run, _ = throughput.run_processors(env, procs, topic_set, records, 1, work_dir, label, keep_running=True)
        procs.stop_all()
        cpu_us = run.cpu_us_per_record
        log(f"  processor {run.throughput.events_per_s:,.0f} events/s, {cpu_us:.0f} us CPU per input record")
        return topic_set, run, run.throughput.events_per_s, cpu_us

    try:
        topic_set, run, first_rate, first_cpu = run_processor("ratio")
        if args.setup_only:
            keep = Path(args.setup_only)
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copytree(run.state_dir, keep / "state")
            (keep / "workload.jsonl").write_text("\n".join(backlog.realistic_jsonl_lines(args.seed, args.events)) + "\n")
            (keep / "setup.json").write_text(json.dumps({"names": topic_set.names, "partitions": topic_set.partitions,
                                                         "prefix": topic_set.prefix, "group": run.group,
                                                         "state_dir": str(keep / "state"),
                                                         "processor_events_per_s": first_rate}, indent=2))
            kept = True
            log(f"kept topics {topic_set.prefix}* and group {run.group}; see {keep}/setup.json")
            return 0
        jsonl = work_dir / "workload.jsonl"
        jsonl.write_text("\n".join(backlog.realistic_jsonl_lines(args.seed, args.events)) + "\n")
        files, topics = [], []
        for _ in range(args.repeat):
            files.append(recovery.run(["file", str(jsonl)]))
            f = files[-1]
            log(f"  file replay {f['replay_events_per_s']:,} events/s (x {f['replay_events_per_s'] / first_rate:.2f}), "
                f"{f['replay_cpu_us_per_record']:.0f} us CPU per record")
            topics.append(recovery.run(["topic", "--bootstrap-servers", env.bootstrap_servers, "--names",
                                        json.dumps(topic_set.names), "--partitions", str(topic_set.partitions),
                                        "--state-dir", str(run.state_dir), "--group", run.group]))
            t = topics[-1]
            log(f"  topic replay {t['replay_events_per_s']:,} events/s (x {t['replay_events_per_s'] / first_rate:.2f}), "
                f"{t['replay_cpu_us_per_record']:.0f} us CPU per record, agrees: {t['agrees']}, "
                f"{t['compared']:,} outputs compared, live ledgers: {t['live_ledgers']}")
            if not t["agrees"]:
                raise RuntimeError(f"the audit replay diverges from a clean run: {t}")
        env.delete(topic_set)
        # the processor again after the replays: the ratios are to the faster of its two runs
        second_set, _, second_rate, second_cpu = run_processor("ratio-after")
        env.delete(second_set)
        processor = max(first_rate, second_rate)
        best_file = max(f["replay_events_per_s"] for f in files)
        best_topic = max(t["replay_events_per_s"] for t in topics)
        doc.update({"input_records": len(records), "processor_events_per_s": round(processor),
                    "processor_runs_events_per_s": [round(first_rate), round(second_rate)],
                    "processor_cpu_us_per_record": round(min(first_cpu, second_cpu), 1),
                    "file": files, "topic": topics,
                    "file_to_processor": round(best_file / processor, 2),
                    "topic_to_processor": round(best_topic / processor, 2),
                    "load_avg_at_end": list(os.getloadavg())})
    finally:
        procs.stop_all()
        if not kept:
            env.delete_all()
        shutil.rmtree(work_dir, ignore_errors=True)
    print(f"processor {doc['processor_runs_events_per_s'][0]:,} and {doc['processor_runs_events_per_s'][1]:,} "
          f"events/s (before and after the replays); file replay {best_file:,} events/s "
          f"(x {doc['file_to_processor']} the faster); topic replay {best_topic:,} events/s "
          f"(x {doc['topic_to_processor']}); CPU us per record: processor {doc['processor_cpu_us_per_record']:.0f}, "
          f"file replay {min(f['replay_cpu_us_per_record'] for f in files):.0f}, topic replay "
          f"{min(t['replay_cpu_us_per_record'] for t in topics):.0f}; "
          f"load {doc['load_avg_at_start'][0]:.1f} -> {doc['load_avg_at_end'][0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
