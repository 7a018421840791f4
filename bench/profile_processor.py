"""Profile `settle run`'s hot path in-process, on the same seeded workload as bench/run.py. Not a test.

    .venv/bin/python bench/profile_processor.py [--events 60000] [--profiler pyinstrument|cprofile] [--top 30]

The processor (processors.kafka.processor.Processor, exactly-once defaults, its ticks from the system clock at
the default interval: the input carries no Ticks) runs in this process against its own topics on the local
broker: the backlog is written in a transaction held open until the processor owns
every partition, then released; the run stops when every input offset is committed. Reports:
- wall-clock split of the run into the processor's stages (consume, decode, fold, output encoding, the transaction
  steps, the RocksDB write), timed by wrapping each stage's entry point;
- the profiler's own report (pyinstrument: wall-clock call tree, including time blocked in librdkafka;
  cProfile: CPU by function) written to bench/results/profile.txt (or --output).
Topics are deleted afterwards.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.suite import backlog  # noqa: E402
from bench.suite.env import INPUT, Env  # noqa: E402
from bench.suite.procs import TICK_INTERVAL_MS  # noqa: E402
from branch_settlement.processors.kafka import checkpoint as checkpoint_module  # noqa: E402
from branch_settlement.processors.kafka import processor as processor_module  # noqa: E402
from branch_settlement.processors.kafka import processor_clients as clients_module  # noqa: E402
from branch_settlement.processors.kafka.config import ProcessorConfig  # noqa: E402
from branch_settlement.processors.kafka.partition import PartitionTask  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - started
            CALLS[name] += 1
    return wrapper


def timed_class(base, steps: tuple[str, ...], prefix: str = "kafka."):
    """A subclass of a confluent-kafka client whose `steps` are timed. A subclass, not a wrapper: the
    processor's rebalance callbacks check that the consumer calling them is its own."""
    namespace = {}
    for step in steps:
        def method(self, *args, _step=step, **kwargs):
            started = time.perf_counter()
            try:
                return getattr(base, _step)(self, *args, **kwargs)
            finally:
                TIMES[prefix + _step] += time.perf_counter() - started
                CALLS[prefix + _step] += 1
        namespace[step] = method
    return type(f"Timed{base.__name__}", (base,), namespace)


TimedProducer = timed_class(clients_module.Producer, ("begin_transaction", "produce", "flush",
                                                      "send_offsets_to_transaction", "commit_transaction"))
TimedConsumer = timed_class(clients_module.Consumer, ("consume",))


def instrument(processor) -> None:
    """Wrap the stages of one Processor instance and of the modules it calls."""
    codec = processor.codec
    codec.decode_event = timed("decode (Avro in)", codec.decode_event)
    clients_module.Producer, clients_module.Consumer = TimedProducer, TimedConsumer
    checkpoint_module.encode_checkpoint = timed("encode (ledger changes)", checkpoint_module.encode_checkpoint)
    PartitionTask.write_committed = timed("store write (RocksDB batch)", PartitionTask.write_committed)
    PartitionTask.apply = timed(APPLY, PartitionTask.apply)
    original_init = PartitionTask.__init__

    def task_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.fold.apply = timed("fold", self.fold.apply)
    PartitionTask.__init__ = task_init
    processor.checkpoint = timed("checkpoint (total)", processor.checkpoint)
    processor._load_partitions = timed("assignment (committed offsets + restore)", processor._load_partitions)


def run(args) -> None:
    env = Env(args.bootstrap_servers)
    topic_set = env.topic_set("profile")
    try:
        records = backlog.realistic(args.seed, args.events, topic_set.partitions)
        load = backlog.HeldLoad(env.client_config(), topic_set.name(INPUT), records, f"bench-{env.run_id}-profile")
        with tempfile.TemporaryDirectory(prefix="bench-profile-") as state_dir:
            config = ProcessorConfig(bootstrap_servers=args.bootstrap_servers, group_id=env.group("profile"),
                                     topic_prefix=topic_set.prefix, state_dir=state_dir,
                                     worker_slot=f"profile-{env.run_id}", tick_interval_ms=TICK_INTERVAL_MS,
                                     session_timeout_ms=6000)
            processor = processor_module.Processor(config, topic_set.names)
            instrument(processor)
            targets = load.per_partition
            state = {"released": None, "started": None}

            def should_stop() -> bool:
                tasks = processor.tasks
                if state["released"] is None:
                    if sorted(tasks) == list(range(topic_set.partitions)):
                        TIMES.clear()
                        CALLS.clear()
                        state["released"] = load.release()
                        profiler.start()
                    return False
                return all(tasks[p].committed_position >= n for p, n in targets.items() if p in tasks) \
                    and len(tasks) == topic_set.partitions

            profiler = Profiler(args.profiler)
            processor.run(should_stop)
            wall = time.monotonic() - state["released"]
            profiler.stop()
        report = stage_report(wall, load.count)
        print(report)
        Path(args.output).write_text(report + "\n\n" + profiler.report(args.top))
        print(f"profile written to {args.output}")
    finally:
        env.delete_all()


class Profiler:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.impl = None

    def start(self) -> None:
        if self.kind == "none":
            return
        if self.kind == "pyinstrument":
            from pyinstrument import Profiler as Pyinstrument
            self.impl = Pyinstrument(interval=0.001)
        else:
            self.impl = cProfile.Profile()
        self.impl.enable() if self.kind == "cprofile" else self.impl.start()

    def stop(self) -> None:
        if self.impl is not None:
            self.impl.disable() if self.kind == "cprofile" else self.impl.stop()

    def report(self, top: int) -> str:
        if self.impl is None:
            return "(no profiler)"
        if self.kind == "pyinstrument":
            return self.impl.output_text(unicode=False, color=False, show_all=False)
        out = io.StringIO()
        stats = pstats.Stats(self.impl, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        return out.getvalue()


# Stages that do not contain one another: the rest of the wall time is the loop itself.
APPLY = "fold + outputs encoded (PartitionTask.apply)"
ENCODE_OUTPUTS = "outputs encoded (Avro out, as folded)"
TOP_LEVEL = ("checkpoint (total)", APPLY, "decode (Avro in)", "kafka.consume",
             "assignment (committed offsets + restore)")


def stage_report(wall_s: float, records: int) -> str:
    lines = [f"{records} input records in {wall_s:.2f} s: {records / wall_s:,.0f} records/s (under the profiler)",
             f"{'stage (indented: inside the stage above)':<44}{'seconds':>9}{'share':>8}{'us/record':>11}"
             f"{'calls':>10}"]
    times = dict(TIMES)
    if APPLY in times:  # what apply does besides the fold: encode each output record
        times[ENCODE_OUTPUTS] = times[APPLY] - times.get("fold", 0.0)
    other = wall_s - sum(times.get(name, 0.0) for name in TOP_LEVEL)
    inside = {APPLY: ["fold", ENCODE_OUTPUTS],
              "checkpoint (total)": sorted((n for n in times if n not in TOP_LEVEL and n not in ("fold", ENCODE_OUTPUTS)),
                                           key=lambda n: -times[n])}
    rows = []
    for name in sorted((n for n in times if n in TOP_LEVEL), key=lambda n: -times[n]):
        rows.append((name, times[name]))
        rows.extend(("  " + child, times[child]) for child in inside.get(name, []) if child in times)
    rows.append(("other (consume loop, metrics, dead letters, ...)", other))
    for label, seconds in rows:
        lines.append(f"{label:<44}{seconds:>9.2f}{seconds / wall_s:>8.0%}{seconds / records * 1e6:>11.1f}"
                     f"{CALLS.get(label.strip(), ''):>10}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=60_000, help="workload size (generator events)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--profiler", choices=("pyinstrument", "cprofile", "none"), default="pyinstrument",
                        help="none: only the stage timers (closest to the real speed)")
    parser.add_argument("--top", type=int, default=30, help="cProfile: functions listed")
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--output", default=str(Path(__file__).resolve().parent / "results" / "profile.txt"))
    run(parser.parse_args())


if __name__ == "__main__":
    main()
