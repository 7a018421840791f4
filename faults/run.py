"""`python -m faults.run` (= `make faults`): the whole fault-injection suite, then faults/report.json and
faults/report.md. `--quick` runs the reduced sizes; `--only a,b` a subset of scenarios. Exit code 0: every
invariant held and no processor needed the watchdog; 1: an invariant failed; 2: every invariant held, but
a processor got stuck or exited unexpectedly (liveness).

Scenarios on the shared broker (SETTLE_BOOTSTRAP_SERVERS, default 127.0.0.1:9092) only use topics of
their own; the broker bounces run on a broker of the suite's own, the network faults on another one inside
a private network namespace, and the replicated scenarios (faults/replicated.py) on a cluster of three
controllers and three brokers of the suite's own (faults/cluster.py), `--seeds` times each. The shared
broker is never bounced, paused or cut off."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from faults import sim
from faults.kafka_io import REPO, OwnBroker, broker_answers
from faults.cluster import ReplicatedCluster
from faults.netns import run_in_namespace
from faults.replicated import REPLICATED, run_replicated
from faults.report import write_reports
from faults.scenarios import SHARED_BROKER, STALL_S, Run, Size, broker_bounce

ORDER = (*SHARED_BROKER, "broker_bounce", "network_blackhole", *REPLICATED)
# The replicated cluster's scenarios run `seeds` times each (seed, seed + 100, ...), on one cluster that the
# run starts once (and starts again only if it cannot be healed) and tears down at the end.
FULL = {"events": 100_000, "partitions": 8, "sim_runs": 5_000, "outages_s": (5, 15, 30), "seeds": 3}
QUICK = {"events": 5_000, "partitions": 4, "sim_runs": 1_000, "outages_s": (5, 12), "seeds": 1}
WORK = REPO / ".run" / "faults"


def shared_bootstrap() -> str:
    return os.environ.get("SETTLE_BOOTSTRAP_SERVERS", "127.0.0.1:9092")


def keep_broker_log(broker: OwnBroker, run_dir: Path) -> None:
    """The own cluster's data goes, its logs stay with the processors' logs: a finding needs both."""
    for role, log in broker.logs().items():
        if log.exists() and run_dir.is_dir():
            shutil.copyfile(log, run_dir / f"kafka-{role}.log")


class SharedCluster:
    """The replicated cluster of one `faults.run`: started on first use, started anew if a scenario left it
    beyond healing, torn down by close()."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.cluster: ReplicatedCluster | None = None
        self.generation = 0

    def get(self) -> ReplicatedCluster:
        if self.cluster is not None:
            try:
                self.cluster.up()
                return self.cluster
            except Exception as exc:  # noqa: BLE001 - a fresh cluster instead
                print(f"faults: the replicated cluster could not be healed ({exc}); starting a new one", flush=True)
                self.close()
        self.generation += 1
        self.cluster = ReplicatedCluster(self.work / f"replicated-cluster-{self.generation}")
        self.cluster.ensure_stopped()  # whatever an earlier run that was killed left there (its reaper's job too)
        shutil.rmtree(self.cluster.run_dir, ignore_errors=True)
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.ensure_stopped()
            if not os.environ.get("FAULTS_KEEP_BROKER_DATA"):
                shutil.rmtree(self.cluster.run_dir, ignore_errors=True)
            self.cluster = None


def run_scenario(name: str, seed: int, size: Size, outages_s: tuple, work: Path, stall_s: float = STALL_S,
                 hard_bounces: int = 2, cluster: SharedCluster | None = None) -> dict:
    """One scenario; a replicated one on `cluster` when given (else on a cluster of its own)."""
    started = time.monotonic()
    try:
        if name in REPLICATED:
            report = run_replicated(name, seed, size, work, cluster.get() if cluster else None, stall_s=stall_s)
        elif name == "network_blackhole":
            report = run_in_namespace(work / name, seed, size.events, size.partitions, outages_s, stall_s)
        elif name == "broker_bounce":
            broker = OwnBroker(work / name / "kafka")
            run, failed = None, True
            try:
                broker.up()
                run = Run(name, seed, size, broker.bootstrap, work / name / "run", stall_s=stall_s).setup()
                report = broker_bounce(run, broker, hard_bounces)
                failed = not report.get("ok")
                report["where"] = f"own cluster: controller and broker, the broker on 127.0.0.1:{broker.port}"
            finally:
                if run is not None:
                    if failed:  # the topics and the broker's data are the evidence: kept (kafka-dump-log reads them)
                        run.topics = None
                    run.cleanup()
                broker.ensure_stopped()
                keep_broker_log(broker, work / name / "run")
                if failed:
                    print(f"faults: {name} failed: the broker's data is kept in {work / name / 'kafka'}", flush=True)
                elif not os.environ.get("FAULTS_KEEP_BROKER_DATA"):
                    shutil.rmtree(work / name / "kafka", ignore_errors=True)
        else:
            run = Run(name, seed, size, shared_bootstrap(), work / name, stall_s=stall_s)
            try:
                run.setup()
                report = SHARED_BROKER[name](run)
                report["where"] = f"shared broker {shared_bootstrap()}, topics {run.topics.prefix}*"
            finally:
                run.cleanup()
    except Exception as exc:
        report = {"scenario": name, "seed": seed, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def git_commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "processors", "projections",
                            "schemas", "faults"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    return head.stdout.strip() + ("+uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes (5k events, 4 partitions)")
    parser.add_argument("--only", default="", help=f"comma-separated scenarios of {', '.join(ORDER)}, or sim")
    parser.add_argument("--seed", type=int, default=7000, help="base seed; scenario i uses seed + i")
    parser.add_argument("--events", type=int, help="events per scenario (overrides the size)")
    parser.add_argument("--seeds", type=int, help="runs of each replicated-cluster scenario (full: 3, quick: 1)")
    parser.add_argument("--out", default=str(REPO / "faults"), help="where report.json and report.md go")
    parser.add_argument("--merge", action="store_true",
                        help="replace only the chosen scenarios in an existing report.json (the rest is kept)")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.events:
        sizes["events"] = args.events
    if args.seeds:
        sizes["seeds"] = args.seeds
    chosen = [n for n in args.only.split(",") if n] or [*ORDER, "sim"]
    unknown = set(chosen) - set(ORDER) - {"sim"}
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    if any(n in SHARED_BROKER for n in chosen) and not broker_answers(shared_bootstrap()):
        print(f"faults: no broker answers on {shared_bootstrap()} (make kafka-up)", file=sys.stderr)
        return 2
    started = time.monotonic()
    commit_at_start = git_commit()
    scenarios = []
    size = Size(sizes["events"], sizes["partitions"])
    cluster = SharedCluster(WORK)
    try:
        for i, name in enumerate(n for n in ORDER if n in chosen):
            for k in range(sizes["seeds"] if name in REPLICATED else 1):
                seed = args.seed + i + 100 * k
                print(f"faults: {name} ({size.events} events, {size.partitions} partitions, seed {seed}) ...",
                      flush=True)
                report = run_scenario(name, seed, size, tuple(sizes["outages_s"]), WORK, cluster=cluster)
                scenarios.append(report)
                print(f"faults: {name}: {'OK' if report.get('ok') else 'FAILED'} in {report['wall_s']} s"
                      + (f" ({report['error']})" if report.get("error") else ""), flush=True)
    finally:
        cluster.close()
    simulation = None
    if "sim" in chosen:
        print(f"faults: simulation ({sizes['sim_runs']} seeded runs) ...", flush=True)
        sim_started = time.monotonic()
        try:
            simulation = {"ok": True, **sim.run_many(sizes["sim_runs"])}
        except AssertionError as exc:
            simulation = {"ok": False, "error": str(exc), "seconds": round(time.monotonic() - sim_started, 1)}
        print(f"faults: simulation: {'OK' if simulation['ok'] else 'FAILED'} in {simulation['seconds']} s", flush=True)
    document = {
        "suite": "faults", "mode": "quick" if args.quick else "full",
        # The processors are started from the work tree as it is when each starts: if it changed during the
        # run, both commits are named.
        "git_commit": commit_at_start, "git_commit_at_end": git_commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
        "base_seed": args.seed, "wall_s": round(time.monotonic() - started, 1),
        "ok": all(s.get("ok") for s in scenarios) and (simulation is None or simulation["ok"]),
        "scenarios": scenarios, "simulation": simulation,
    }
    if args.merge and (Path(args.out) / "report.json").exists():
        previous = json.loads((Path(args.out) / "report.json").read_text())
        # Every earlier entry of a scenario that ran again is replaced by its new entries (one per seed), in place.
        fresh: dict[str, list] = {}
        for s in scenarios:
            s["rerun"] = f"rerun alone at {document['git_commit']} (--merge)"
            fresh.setdefault(s["scenario"], []).append(s)
        merged = []
        for s in previous["scenarios"]:
            if s["scenario"] not in fresh:
                merged.append(s)
            elif not any(m["scenario"] == s["scenario"] for m in merged):
                merged.extend(fresh[s["scenario"]])
        named = {m["scenario"] for m in merged}
        document["scenarios"] = merged + [s for s in scenarios if s["scenario"] not in named]
        document["simulation"] = simulation or previous.get("simulation")
        document["wall_s"] = previous["wall_s"]
        document["git_commit"] = previous["git_commit"]
        document["git_commit_at_end"] = previous.get("git_commit_at_end", previous["git_commit"])
        document["ok"] = all(s.get("ok") for s in document["scenarios"]) and (
            document["simulation"] is None or document["simulation"]["ok"])
    scenarios = document["scenarios"]
    document["not_live"] = [s["scenario"] for s in scenarios if s.get("live") is False]
    document["live"] = not document["not_live"]
    write_reports(document, Path(args.out))
    print(f"faults: {'every invariant holds' if document['ok'] else 'INVARIANTS FAILED'}; "
          f"{'live' if document['live'] else 'NOT LIVE in ' + ', '.join(document['not_live'])}; "
          f"report in {args.out}/report.md")
    # 1: something was lost, doubled or left open. 2: all safe, but a processor got stuck or crashed.
    return 1 if not document["ok"] else (2 if not document["live"] else 0)


if __name__ == "__main__":
    sys.exit(main())
