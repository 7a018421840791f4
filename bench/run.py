"""The benchmark suite of `settle run` against the local broker. Not a test: it measures and
reports; it asserts nothing.

    .venv/bin/python bench/run.py            # full run (make bench), about 13 minutes here
    .venv/bin/python bench/run.py --quick    # the same measurements, smaller (make bench-quick), < 5 minutes

Everything is measured in one run, side by side, each figure next to its ceiling, because the machine is
shared and noisy: ratios travel, absolute figures do not.

1. throughput of one `settle run` process (exactly-once defaults) on the seeded realistic workload, and the
   ceiling: a transactional pass-through producing the processor's own outputs at the same commit cadence.
   A freshly started broker gets faster for minutes (its JIT), so one processor run first warms it, not counted;
   then five rounds (one in --quick) of processor and ceiling, the order alternating (P C, C P, P C, ...), and the
   round with the median ratio is the headline; every round is reported;
2. scaling: the same workload with two processes in one group;
3. latency from produce to a read_committed result at 25/50/75% of the throughput measured in 1;
4. replay of a file and of the topic, each with its ceiling (decoding / consuming the same records);
5. peak RSS of the processor with a large ledger (and RSS as the ledger grows), then restore of that ledger
   from the changelog, with its ceiling (consuming the changelog).

Writes bench/results/latest.json and latest.md. Every topic is created under `bench.<run id>.` and deleted at
the end; every process started is stopped. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.suite import backlog, latency, memory, recovery, report, throughput  # noqa: E402
from bench.suite.env import Env, git_commit, kafka_version, machine  # noqa: E402
from bench.suite.procs import PROCESSOR_FLAGS, TICK_INTERVAL_MS, Procs  # noqa: E402
from branch_settlement.processors.kafka.config import ProcessorConfig  # noqa: E402
from branch_settlement.schemas import native  # noqa: E402
from branch_settlement.processors.kafka.connection import DEFAULT_BOOTSTRAP_SERVERS  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LATENCY_FRACTIONS = (0.25, 0.5, 0.75)
THROUGHPUT_TARGET = 0.6
RSS_TARGET_MB = 500
# "Flat": RSS may grow by less than this per 100k more children in the ledger.
RSS_FLAT_MB_PER_100K_CHILDREN = 10.0


@dataclass(frozen=True)
class Settings:
    mode: str
    seed: int = 7
    # generator events of the throughput / replay workload: a million, so that each round lasts 15-25 s and
    # one stalled transaction (100-300 ms, either side) moves it by 1-2%, not 5-10% (docs/decisions.md, 36)
    events: int = 1_000_000
    children: int = 1_000_000  # children in the ledger for the memory test
    on_top_events: int = 20_000  # realistic events folded over the large ledger, per phase
    latency_seconds: float = 30.0  # per load level
    latency_warmup_s: float = 5.0
    warmup: bool = True  # one processor run before the measured rounds, not counted
    rounds: int = 5  # processor and ceiling, the order alternating; the median ratio is the headline
    bootstrap_servers: str = DEFAULT_BOOTSTRAP_SERVERS


QUICK = Settings(mode="quick", events=40_000, children=100_000, on_top_events=5_000, latency_seconds=10.0,
                 latency_warmup_s=3.0, rounds=1)
FULL = Settings(mode="full")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def rss_growth_mb_per_100k(curve: list[dict]) -> float | None:
    """Least-squares slope of RSS over children, on the second half of the fill (after warm-up)."""
    points = [(p["children"], p["rss_mb"]) for p in curve if p["children"] > 0]
    points = points[len(points) // 2:]
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return round(sum((x - mx) * (y - my) for x, y in points) / sxx * 100_000, 1) if sxx else None


class Suite:
    """One run: the environment, the processes, and a section method per measurement."""

    def __init__(self, settings: Settings, work_dir: Path) -> None:
        self.settings = settings
        self.work_dir = work_dir
        self.env = Env(settings.bootstrap_servers)
        self.procs = Procs(work_dir)
        self.plan = work_dir / "ceiling-plan.pickle"  # the processor's outputs, for the pass-through

    def throughput(self) -> dict:
        """A warm-up run, then `rounds` rounds of one processor and its ceiling, the order alternating (P then C,
        C then P, ...) so that a broker still warming up (its JIT, its page cache) favours neither side. The
        headline is the round whose ratio is the median (the lower one of an even count); every round is kept."""
        s, env, procs = self.settings, self.env, self.procs
        self.p1 = env.topic_set("p1")
        records = backlog.realistic(s.seed, s.events, self.p1.partitions)
        if s.warmup:
            log(f"throughput: warm-up, one processor, {len(records):,} input records (not counted)")
            w = env.topic_set("warmup")
            warm, _ = throughput.run_processors(env, procs, w, records, 1, self.work_dir, "warmup")
            env.delete(w)
            log(f"  warm-up {warm.throughput.events_per_s:,.0f} events/s")
        rounds: list[dict] = []
        first = None
        for i in range(s.rounds):
            order = ("processor", "ceiling") if i % 2 == 0 else ("ceiling", "processor")
            log(f"throughput round {i + 1} of {s.rounds}: {' then '.join(order)}, {len(records):,} input records")
            done: dict = {"order": "P, C" if i % 2 == 0 else "C, P"}
            for side in order:
                if side == "processor":
                    label = "p1" if i == 0 else f"p1-{i + 1}"
                    topics = self.p1 if i == 0 else env.topic_set(label)
                    done["processor"], _ = throughput.run_processors(env, procs, topics, records, 1, self.work_dir,
                                                                     label)
                    if i == 0:
                        first = done["processor"]
                    else:
                        env.delete(topics)
                    log(f"  processor {done['processor'].throughput.events_per_s:,.0f} events/s")
                else:
                    c = env.topic_set(f"ceiling-{i + 1}")
                    # the ceiling copies round 1's input and produces round 1's outputs: the same in every round
                    done["ceiling"], done["counts"] = throughput.run_ceiling(env, procs, self.p1, first, c, self.plan,
                                                                             label=f"ceiling-{i + 1}")
                    env.delete(c)
                    log(f"  ceiling (pass-through) {done['ceiling'].throughput.events_per_s:,.0f} events/s")
            done["ratio"] = report.ratio(done["processor"].throughput.events_per_s,
                                         done["ceiling"].throughput.events_per_s)
            rounds.append(done)
        pick = sorted(rounds, key=lambda r: r["ratio"])[(len(rounds) - 1) // 2]
        run1, ceiling, output_counts = pick["processor"], pick["ceiling"], pick["counts"]
        log(f"  median round: {report.ratio(run1.throughput.events_per_s, ceiling.throughput.events_per_s)} of the "
            f"ceiling (rounds: {', '.join(str(r['ratio']) for r in rounds)}); two processors ...")
        p2 = env.topic_set("p2")
        run2, _ = throughput.run_processors(env, procs, p2, records, 2, self.work_dir, "p2")
        env.delete(p2)
        log(f"  two processors {run2.throughput.events_per_s:,.0f} events/s")
        self.max_rate = run1.throughput.events_per_s
        p, c = run1.throughput.events_per_s, ceiling.throughput.events_per_s
        return {
            "ceiling_events_per_s": round(c), "processor_events_per_s": round(p),
            "processor_to_ceiling": report.ratio(p, c),
            "throughput": {"processor": run1.as_dict(),
                           "ceiling": {**ceiling.as_dict(), "output_records": output_counts,
                                       "output_records_per_input": round(sum(output_counts.values()) / len(records), 2)},
                           "warmup": warm.as_dict() if s.warmup else None,
                           "rounds": [round_summary(r) for r in rounds],
                           "median_round": rounds.index(pick) + 1},
            "scaling": {"1": run1.as_dict(), "2": run2.as_dict(),
                        "speedup": round(run2.throughput.events_per_s / p, 2),
                        "2_to_ceiling": report.ratio(run2.throughput.events_per_s, c)},
        }

    def latency(self) -> dict:
        s, env, procs = self.settings, self.env, self.procs
        rates = [(fraction, fraction * self.max_rate) for fraction in LATENCY_FRACTIONS]
        topics_l = env.topic_set("latency")
        needed = latency.records_needed(rates, s.latency_seconds, s.latency_warmup_s)
        records = backlog.realistic(s.seed + 1, needed, topics_l.partitions)
        log(f"latency at {', '.join(f'{f:.0%}' for f in LATENCY_FRACTIONS)} of {self.max_rate:,.0f} events/s, "
            f"{s.latency_seconds:.0f} s each")
        levels = latency.measure(
            env, topics_l, records, rates, s.latency_seconds, s.latency_warmup_s,
            start=lambda: procs.processor(env.bootstrap_servers, topics_l.prefix, self.work_dir / "state-latency",
                                          env.group("latency"), f"{env.run_id}-latency"),
            stop=procs.stop)
        env.delete(topics_l)
        for level in levels:
            log_latency(f"{level.fraction:.0%}", level)
        ceilings = {}
        for schedule in ("end", "start"):
            log(f"  the same at 50% through the pass-through, interval from the {schedule} of the last checkpoint")
            topics_c = env.topic_set(f"latency-ceiling-{schedule}")
            [ceilings[schedule]] = latency.measure(
                env, topics_c, records, [(0.5, 0.5 * self.max_rate)], s.latency_seconds, s.latency_warmup_s,
                start=lambda: throughput.start_passthrough(env, procs, self.plan, topics_c,
                                                           f"latency-ceiling-{schedule}", echo=True, schedule=schedule),
                stop=procs.stop)
            env.delete(topics_c)
            log_latency("  pass-through", ceilings[schedule])
        self.plan.unlink()
        levels_doc = [level.as_dict() for level in levels]
        target_p99 = 2 * ProcessorConfig().commit_interval_ms
        at_half = next(level for level in levels_doc if level["load"] == 0.5)
        return {
            "latency_ms": {f"{int(level['load'] * 100)}%": {k: level[k] for k in ("p50", "p99", "max")}
                           for level in levels_doc},
            "latency": {"target_p99_ms": target_p99, "max_rate_events_per_s": round(self.max_rate),
                        "levels": levels_doc, "ceiling_at_50": ceilings["end"].as_dict(),
                        "ceiling_at_50_fixed_period": ceilings["start"].as_dict()},
            "latency_target_met": at_half["p99"] is not None and at_half["p99"] <= target_p99,
        }

    def replay(self) -> dict:
        s, env = self.settings, self.env
        log("replay: file, then topic")
        jsonl = self.work_dir / "workload.jsonl"
        jsonl.write_text("\n".join(backlog.realistic_jsonl_lines(s.seed, s.events)) + "\n")
        replay_file = recovery.run(["file", str(jsonl)])
        jsonl.unlink()
        replay_topic = recovery.run(["topic", "--bootstrap-servers", env.bootstrap_servers, "--names",
                                     json.dumps(self.p1.names), "--partitions", str(self.p1.partitions)])
        env.delete(self.p1)
        log(f"  file {replay_file['replay_events_per_s']:,} events/s, topic {replay_topic['replay_events_per_s']:,} "
            f"events/s (agrees: {replay_topic['agrees']})")
        for part in (replay_file, replay_topic):
            part["to_ceiling"] = report.ratio(part["replay_events_per_s"], part["ceiling_events_per_s"])
        return {"replay_events_per_s": replay_file["replay_events_per_s"],
                "replay_topic_events_per_s": replay_topic["replay_events_per_s"],
                "replay": {"file": replay_file, "topic": replay_topic}}

    def memory_and_restore(self) -> dict:
        s, env = self.settings, self.env
        log(f"memory: {s.children:,} children in the ledger")
        m = env.topic_set("memory")
        top = backlog.realistic(s.seed + 2, 3 * s.on_top_events, m.partitions)
        thirds = [top[i * len(top) // 3:(i + 1) * len(top) // 3] for i in range(3)]
        mem = memory.measure(env, self.procs, m, s.children, thirds, self.work_dir).as_dict()
        log(f"  peak RSS {mem['peak_rss_mb']} MB by phase {mem['peak_rss_mb_by_phase']}; restore ...")
        restored = recovery.run(["restore", "--bootstrap-servers", env.bootstrap_servers, "--names",
                                 json.dumps(m.names), "--group", env.group("memory"), "--partitions",
                                 str(m.partitions)])
        env.delete(m)
        log(f"  restore {restored['restore_children_per_s']:,} children/s")
        restored["to_ceiling"] = report.ratio(restored["restore_children_per_s"], restored["ceiling_children_per_s"])
        growth = mem["rss_growth_mb_per_100k_children"] = rss_growth_mb_per_100k(mem["rss_vs_ledger"])
        return {"restore_children_per_s": restored["restore_children_per_s"], "peak_rss_mb": mem["peak_rss_mb"],
                "restore": restored, "memory": mem,
                "memory_target_met": mem["peak_rss_mb"] < RSS_TARGET_MB and growth is not None
                and growth < RSS_FLAT_MB_PER_100K_CHILDREN}

    def close(self) -> None:
        self.procs.stop_all()
        self.env.delete_all()


def round_summary(r: dict) -> dict:
    p, c = r["processor"], r["ceiling"]
    return {"order": r["order"], "processor_events_per_s": round(p.throughput.events_per_s),
            "ceiling_events_per_s": round(c.throughput.events_per_s), "ratio": r["ratio"],
            "steady_ratio": report.ratio(p.throughput.steady_events_per_s, c.throughput.steady_events_per_s),
            "processor_cpu_us_per_record": p.cpu_us_per_record, "ceiling_cpu_us_per_record": c.cpu_us_per_record,
            "cpu_ratio": report.ratio(p.cpu_us_per_record, c.cpu_us_per_record)}


def log_latency(label: str, level) -> None:
    d = level.as_dict()
    log(f"  {label}: p50 {d['p50']} ms, p99 {d['p99']} ms, max {d['max']} ms")


def run(settings: Settings, work_dir: Path, command: str) -> dict:
    started, started_wall = time.monotonic(), datetime.now(timezone.utc)
    defaults = ProcessorConfig()
    doc: dict = {"benchmark": "settle run end to end", "mode": settings.mode, "command": command,
                 "started_at": started_wall.isoformat(timespec="seconds"), "git": git_commit(), "machine": machine(),
                 "kafka": kafka_version(),
                 # what every process of the run folds with (SETTLE_IMPLEMENTATION, docs/implementations.md)
                 "implementation": native.describe(native.select())}
    suite = Suite(settings, work_dir)
    log(f"run {suite.env.run_id}: topics bench.{suite.env.run_id}.*, logs in {work_dir}")
    try:
        for section in (suite.throughput, suite.latency, suite.replay, suite.memory_and_restore):
            doc.update(section())
    finally:
        suite.close()
    doc["settings"] = {**asdict(settings), "partitions": suite.p1.partitions,
                       "commit_interval_ms": defaults.commit_interval_ms, "commit_events": defaults.commit_events,
                       "processor_flags": f"{' '.join(PROCESSOR_FLAGS)} (the processor ticks from the system clock "
                       f"every {TICK_INTERVAL_MS} ms, the production default, onto ledger-ticks; the input carries "
                       "no Ticks; DEBUG logs each checkpoint's duration); the rest default"}
    doc["targets"] = {"throughput": doc["processor_to_ceiling"] >= THROUGHPUT_TARGET,
                      "latency": doc.pop("latency_target_met"), "memory": doc.pop("memory_target_met")}
    doc["load_avg_at_end"] = list(os.getloadavg())
    doc["duration_s"] = round(time.monotonic() - started, 1)
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes: the whole suite in under 5 minutes")
    parser.add_argument("--bootstrap-servers", default=DEFAULT_BOOTSTRAP_SERVERS)
    parser.add_argument("--seed", type=int, help="workload seed (default 7)")
    parser.add_argument("--events", type=int, help="generator events of the throughput workload "
                        f"(default {FULL.events:,}; quick {QUICK.events:,})")
    parser.add_argument("--children", type=int, help=f"children in the ledger for the memory test "
                        f"(default {FULL.children:,}; quick {QUICK.children:,})")
    parser.add_argument("--latency-seconds", type=float, help="seconds per latency load level "
                        f"(default {FULL.latency_seconds:.0f}; quick {QUICK.latency_seconds:.0f})")
    parser.add_argument("--rounds", type=int, help="rounds of processor and ceiling, the order alternating; the "
                        f"median ratio is the headline (default {FULL.rounds}; quick {QUICK.rounds})")
    parser.add_argument("--no-warmup", action="store_true", help="no warm-up run before the measured rounds")
    parser.add_argument("--output-dir", default=str(RESULTS_DIR), help="where latest.json and latest.md go")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (always kept on failure)")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    overrides = {k: v for k, v in (("seed", args.seed), ("events", args.events), ("children", args.children),
                                   ("latency_seconds", args.latency_seconds), ("rounds", args.rounds),
                                   ("warmup", False if args.no_warmup else None)) if v is not None}
    settings = replace(settings, bootstrap_servers=args.bootstrap_servers, **overrides)
    if settings.rounds < 1:
        parser.error("--rounds must be at least 1")
    command = " ".join(["bench/run.py", *sys.argv[1:]])
    work_dir = Path(tempfile.mkdtemp(prefix="bench-run-"))
    try:
        doc = run(settings, work_dir, command)
    except BaseException:
        log(f"failed; logs kept in {work_dir}")
        raise
    json_path, md_path = report.write(doc, Path(args.output_dir))
    print(md_path.read_text())
    log(f"written {json_path} and {md_path} in {doc['duration_s']:.0f} s")
    if args.keep_logs:
        log(f"logs kept in {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
