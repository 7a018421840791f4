"""Where a checkpoint's time goes in `settle run`, and how much of the run the processor spends in its
checkpoints: one processor process (exactly-once defaults) over the seeded realistic backlog, as in
bench/run.py's throughput measurement, then its DEBUG log read back. Not a test: it reports.

    .venv/bin/python bench/checkpoint_phases.py [--events 100000] [--seed 7] [--ceiling] [-- EXTRA settle run FLAGS]

Each committed checkpoint logs its steps (processors/kafka/checkpoint.py): encode (the ledger changes),
produce (begin + handing every record to librdkafka), flush (waiting for the broker's acks), offsets
(send_offsets_to_transaction), commit (commit_transaction), store (the RocksDB batches). Prints the run's
rate, each step's total and its share of the run's wall time, the CPU the process used, how much of the run its
main thread was on a CPU and how much of the machine's CPU time was idle (which tells a main thread waiting for
the broker's round trips from one waiting for a core). With `--ceiling`, then the pass-through ceiling
(bench/suite/passthrough.py) on the processor's outputs, its steps (produce, flush, offsets, commit) reported
the same way, and the two runs' ratios. Needs the broker;
topics `bench.<run id>.phases.*` are deleted at the end.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.suite import backlog, report, throughput  # noqa: E402
from bench.suite.env import Env  # noqa: E402
from bench.suite.procs import Procs  # noqa: E402
from branch_settlement.processors.kafka.connection import DEFAULT_BOOTSTRAP_SERVERS  # noqa: E402

LINE = re.compile(r"checkpoint committed: (\d+) events, (\d+) records, ([\d.]+) ms \(([^)]*)\)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000, help="generator events (default 100,000)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP_SERVERS)
    parser.add_argument("--ceiling", action="store_true",
                        help="then run the pass-through ceiling on the processor's outputs and report its steps too")
    parser.add_argument("--keep-log", action="store_true", help="keep the processor's log and print where")
    parser.add_argument("extra", nargs="*", help="more `settle run` flags (after --)")
    args = parser.parse_args()
    env = Env(args.bootstrap_servers)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-phases-"))
    procs = Procs(work_dir)
    runs = []
    try:
        topic_set = env.topic_set("phases")
        records = backlog.realistic(args.seed, args.events, topic_set.partitions)
        extra = tuple(args.extra)
        original = procs.processor
        procs.processor = lambda *a, **k: original(*a, **{**k, "extra_args": extra})
        run, _ = throughput.run_processors(env, procs, topic_set, records, 1, work_dir, "phases")
        runs.append(("processor", run, _log(work_dir, "processor-")))
        if args.ceiling:
            ceiling, _ = throughput.run_ceiling(env, procs, topic_set, run, env.topic_set("phases-ceiling"),
                                                work_dir / "plan.pickle", label="phases-ceiling")
            runs.append(("pass-through ceiling", ceiling, _log(work_dir, "phases-ceiling")))
    finally:
        procs.stop_all()
        env.delete_all()
    for name, run, log in runs:
        print_steps(name, run, log)
    if len(runs) == 2:
        (_, p, _), (_, c, _) = runs
        print(f"\nprocessor / ceiling: {report.ratio(p.throughput.events_per_s, c.throughput.events_per_s)} of its "
              f"throughput, {report.ratio(p.cpu_us_per_record, c.cpu_us_per_record)}x its CPU per input record")
    if args.keep_log:
        print(f"the logs are kept in {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0


def _log(work_dir: Path, prefix: str) -> str:
    return (work_dir / next(p.name for p in work_dir.iterdir() if p.name.startswith(prefix))).read_text()


def print_steps(name: str, run, log: str) -> None:
    wall_s = run.throughput.seconds
    totals: dict[str, float] = {}
    longest: dict[str, float] = {}
    checkpoints = events = 0
    for n, _records, total_ms, phases in LINE.findall(log):
        checkpoints += 1
        events += int(n)
        totals["checkpoint (all)"] = totals.get("checkpoint (all)", 0.0) + float(total_ms)
        longest["checkpoint (all)"] = max(longest.get("checkpoint (all)", 0.0), float(total_ms))
        for part in phases.split(", "):
            step, ms = part.rsplit(" ", 1)
            totals[step] = totals.get(step, 0.0) + float(ms)
            longest[step] = max(longest.get(step, 0.0), float(ms))
    print(f"{name}: {run.throughput.records:,} input records in {wall_s:.2f} s: "
          f"{run.throughput.records / wall_s:,.0f}/s; {checkpoints} checkpoints, "
          f"{events / max(checkpoints, 1):,.0f} events each; "
          f"CPU {run.cpu_us_per_record or 0:.1f} µs per input record (every thread)")
    if run.main_thread_busy is not None and run.machine_idle is not None:
        print(f"its main thread on a CPU {run.main_thread_busy:.0%} of the run; the machine's cores idle "
              f"{run.machine_idle:.0%} of theirs")
    print(f"{'step':<18}{'total ms':>10}{'share of the run':>18}{'ms per checkpoint':>20}{'longest ms':>12}")
    for step, ms in totals.items():
        print(f"{step:<18}{ms:>10.0f}{ms / 10 / wall_s:>17.1f}%{ms / max(checkpoints, 1):>20.1f}"
              f"{longest[step]:>12.1f}")


if __name__ == "__main__":
    sys.exit(main())
