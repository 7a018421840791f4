"""Soak benchmark: months of ledger time through the fold, offline. Not a test: it reports, it does not assert.

    .venv/bin/python bench/soak.py [--days 40] [--parents-per-day 1500] [--children 4] [--full]
                                   [--retention-days 7] [--sample-days 4] [--out bench/results/soak]

Parents open and close continuously: every hour of ledger time `--parents-per-day`/24 parents are reserved,
each with `--children` children reserved, activated and completed, and closed; then a tick moves ledger time
to the next hour (24 ticks a day). Everything goes through the processor's own path: the fold (with its
timers, so retention compacts at ticks exactly as in `settle run`), the RocksDB projection written at each
checkpoint (every 2,000 events), and changelog-shaped writes (the checkpoint's changes, (key, value or None for
a delete), are what `settle run` produces to the compacted changelog topic; their bytes are counted).

Two runs, with the ledger's retention (default 7 days of ledger time) and without it (never compacted), and
every `--sample-days` of ledger time, for each:
- rocksdb_mb:           the projection's directory on disk (SST files and log), after a flush;
- changelog_written_mb: bytes of every changelog record written so far (key + value);
- changelog_live:       what the compacted topic keeps, once compacted (the latest record of each key that is
                        not a delete): keys and MB. It is what a restore reads;
- restore_s:            a restore: those live records written in batches into an empty RocksDB projection, and
                        a ledger view opened on it (which loads the timer heap), timed;
- rss_mb:               the process's resident memory;
- parents, children:    live (not compacted) parents and children records, and tombstones.
Each run is a process of its own (its RSS is its own). `--full` is the long run (180 days at 10,000 parents a
day: 25 million events each run). Writes
`<out>.json`, `<out>.md` (the table) and `<out>.svg` (a plot).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
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
from branch_settlement.projections import keys, model  # noqa: E402
from branch_settlement.projections.store import RocksStore  # noqa: E402
from branch_settlement.schemas.codec import default_codec  # noqa: E402

HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS
T0 = 1_764_547_200_000  # 2025-12-01
CHECKPOINT_EVENTS = 2_000
RESTORE_BATCH = 10_000  # records per RocksDB batch, as processors/kafka/restore.py writes


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def dir_mb(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total / 1e6


class Events:
    """The events of one parent's life, as the codec's canonical dicts (built once, then copied with ids)."""

    def __init__(self, children: int) -> None:
        codec = default_codec()
        self.children = children
        self.templates = []
        pid = "{p}"
        base = {"parent_id": pid, "occurred_at_ms": 0}
        self.templates.append(codec.event_from_json({**base, "type": "ParentReserved", "event_id": "x",
                                                     "idempotency_key": "x", "lease_ttl_ms": 2 * DAY_MS,
                                                     "capacity": {"tokens": {"quantity": 1000, "kind": "logical"}},
                                                     "policy": {"max_live_children": 16,
                                                                "reconciliation_timeout_ms": HOUR_MS,
                                                                "lending_limit": {}}}))
        for c in range(children):
            child = {"child_id": f"c{c}", "attempt_id": f"c{c}-a1"}
            self.templates.append(codec.event_from_json({**base, **child, "type": "ChildReserved", "event_id": "x",
                                                         "idempotency_key": "x", "branch_id": f"c{c}",
                                                         "quantities": {"tokens": 100}}))
            self.templates.append(codec.event_from_json({**base, **child, "type": "ChildActivated", "event_id": "x",
                                                         "idempotency_key": "x", "lease_generation": 1,
                                                         "lease_ttl_ms": HOUR_MS}))
            self.templates.append(codec.event_from_json({**base, **child, "type": "ChildCompleted", "event_id": "x",
                                                         "idempotency_key": "x", "lease_generation": 1,
                                                         "usage": {"tokens": 60 + c}}))
        self.templates.append(codec.event_from_json({**base, "type": "ParentClosed", "event_id": "x",
                                                     "idempotency_key": "x", "outcome": "succeeded"}))
        self.tick = codec.event_from_json({"type": "Tick", "event_id": "x", "idempotency_key": "x", "parent_id": "",
                                           "occurred_at_ms": 0, "now_ms": 0})

    def parent(self, parent_id: str):
        for n, template in enumerate(self.templates):
            event = dict(template)
            event["parent_id"] = parent_id
            event["event_id"] = f"{parent_id}-{n}"
            event["idempotency_key"] = f"{parent_id}/{n}"
            yield event

    def tick_at(self, now_ms: int) -> dict:
        return dict(self.tick, now_ms=now_ms, event_id=f"tick-{now_ms}", idempotency_key=f"tick/0/{now_ms}")


def restore(source: RocksStore, directory: str) -> tuple[float, int, int]:
    """What a restore from the compacted changelog does with the records it keeps: (seconds, keys, bytes)."""
    codec = default_codec()
    started = time.perf_counter()
    target = RocksStore(os.path.join(directory, "restored"))
    batch, count, size = [], 0, 0
    for key, value in source.scan(b""):
        if key == keys.CHANGELOG_OFFSET_KEY:
            continue
        batch.append((key, value))
        count += 1
        size += len(key) + len(value)
        if len(batch) >= RESTORE_BATCH:
            target.write(batch, count)
            batch = []
    target.write(batch, count)
    view = open_view(target, codec)  # loads the timer heap and the partition's metadata
    seconds = time.perf_counter() - started
    del view
    target.close()
    shutil.rmtree(os.path.join(directory, "restored"))
    return seconds, count, size


def soak(days: int, parents_per_day: int, children: int, retention_days: float | None, sample_days: int,
         report) -> list[dict]:
    model.CLOSED_PARENT_RETENTION_MS = None if retention_days is None else int(retention_days * DAY_MS)
    events = Events(children)
    directory = tempfile.mkdtemp(prefix="soak-")
    store = RocksStore(os.path.join(directory, "partition-0"))
    codec = default_codec()
    view = open_view(store, codec)
    fold = Fold(view)
    out = Outputs()
    offset, since_checkpoint, written, parents = 0, 0, 0, 0
    rows = []
    started = time.perf_counter()
    per_hour = parents_per_day / 24

    def checkpoint() -> None:
        nonlocal written, since_checkpoint
        changes = view.changes()
        written += sum(len(key) + (len(value) if value is not None else 0) for key, value in changes)
        store.write(changes, offset)
        view.mark_committed()
        out.clear()
        since_checkpoint = 0
        gc_tuning.after_checkpoint()

    due = 0.0
    try:
        for hour in range(days * 24):
            now_ms = T0 + hour * HOUR_MS
            fold.apply(events.tick_at(now_ms), offset, out)
            offset += 1
            due += per_hour
            while due >= 1:
                due -= 1
                for event in events.parent(f"wf-{parents:08d}"):
                    fold.apply(event, offset, out)
                    offset += 1
                    since_checkpoint += 1
                    if since_checkpoint >= CHECKPOINT_EVENTS:
                        checkpoint()
                parents += 1
            if (hour + 1) % (24 * sample_days) == 0:
                checkpoint()
                store._db.flush()
                seconds, live_keys, live_bytes = restore(store, directory)
                counts = {kind: sum(1 for _ in store.scan(keys.prefix(kind)))
                          for kind in (keys.PARENT, keys.CHILD, keys.IDEMPOTENCY, keys.TIMER)}
                compacted = sum(1 for _, value in store.scan(keys.prefix(keys.PARENT))
                                if codec.decode(value)[1]["compacted_at_ms"] is not None)
                row = {"day": (hour + 1) // 24, "events": offset, "parents_opened": parents,
                       "rocksdb_mb": round(dir_mb(os.path.join(directory, "partition-0")), 1),
                       "changelog_written_mb": round(written / 1e6, 1),
                       "changelog_live_keys": live_keys, "changelog_live_mb": round(live_bytes / 1e6, 2),
                       "restore_s": round(seconds, 2), "rss_mb": round(rss_mb(), 0),
                       "parent_records": counts[keys.PARENT], "tombstones": compacted,
                       "children": counts[keys.CHILD], "idempotency": counts[keys.IDEMPOTENCY],
                       "timers": counts[keys.TIMER], "heap": view.pending_timer_count(),
                       "wall_s": round(time.perf_counter() - started, 1)}
                rows.append(row)
                report(row)
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    return rows


COLUMNS = ("day", "events", "rocksdb_mb", "changelog_written_mb", "changelog_live_keys", "changelog_live_mb",
           "restore_s", "rss_mb", "children", "idempotency", "tombstones", "timers")


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def svg(runs: dict[str, list[dict]], metrics: tuple[str, ...] = ("changelog_live_mb", "rocksdb_mb", "restore_s",
                                                                  "rss_mb")) -> str:
    """Small multiples, one panel per metric, one line per run, against ledger days (hand-written SVG)."""
    width, height, pad = 300, 200, 40
    colours = {"retention": "#1f77b4", "no retention": "#d62728"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(metrics)}" height="{height + 30}" '
             'font-family="sans-serif" font-size="11">']
    for i, metric in enumerate(metrics):
        x0 = i * width
        points = [(row["day"], row[metric]) for rows in runs.values() for row in rows]
        max_x = max(d for d, _ in points) or 1
        max_y = max(v for _, v in points) or 1
        parts.append(f'<text x="{x0 + pad}" y="14">{metric} (max {max_y})</text>')
        parts.append(f'<line x1="{x0 + pad}" y1="{height}" x2="{x0 + width - 10}" y2="{height}" stroke="black"/>')
        parts.append(f'<line x1="{x0 + pad}" y1="20" x2="{x0 + pad}" y2="{height}" stroke="black"/>')
        parts.append(f'<text x="{x0 + width // 2}" y="{height + 15}">ledger day (max {max_x})</text>')
        for name, rows in runs.items():
            path = " ".join(f"{x0 + pad + (row['day'] / max_x) * (width - pad - 10):.1f},"
                            f"{height - (row[metric] / max_y) * (height - 25):.1f}" for row in rows)
            parts.append(f'<polyline fill="none" stroke="{colours.get(name, "black")}" stroke-width="2" '
                         f'points="{path}"/>')
    parts.append(f'<text x="10" y="{height + 28}" fill="#1f77b4">retention</text>'
                 f'<text x="90" y="{height + 28}" fill="#d62728">no retention</text></svg>')
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=int, default=40)
    parser.add_argument("--parents-per-day", type=int, default=1_500)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--retention-days", type=float, default=model.CLOSED_PARENT_RETENTION_MS / DAY_MS)
    parser.add_argument("--sample-days", type=int, default=4)
    parser.add_argument("--full", action="store_true", help="180 days at 10,000 parents a day")
    parser.add_argument("--only", choices=("retention", "no retention"))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "soak"))
    args = parser.parse_args()
    if args.full:
        args.days, args.parents_per_day, args.sample_days = 180, 10_000, 10
    runs = {}
    for name, retention in (("retention", args.retention_days), ("no retention", None)):
        if args.only and args.only != name:
            continue
        if not args.only:  # each run in a process of its own, so that its RSS is its own
            with tempfile.TemporaryDirectory() as scratch:
                out = os.path.join(scratch, "run")
                subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", name, "--out", out], check=True)
                runs[name] = json.loads(Path(out + ".json").read_text())["runs"][name]
            continue
        print(f"== {name}: {args.days} days, {args.parents_per_day} parents a day of {args.children} children "
              f"({args.parents_per_day * (2 + 3 * args.children)} events a day)", flush=True)
        runs[name] = soak(args.days, args.parents_per_day, args.children, retention, args.sample_days,
                          lambda row: print(json.dumps(row), flush=True))
    if args.only:
        Path(args.out + ".json").write_text(json.dumps({"runs": runs}) + "\n")
        return
    command = " ".join(["bench/soak.py", *sys.argv[1:]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"command": command, "args": vars(args), "runs": runs},
                                                   indent=1) + "\n")
    Path(args.out + ".md").write_text(f"`{command}`\n\n" + "\n\n".join(f"**{name}**\n\n{table(rows)}"
                                                                      for name, rows in runs.items()) + "\n")
    Path(args.out + ".svg").write_text(svg(runs))
    for name, rows in runs.items():
        print(f"\n{name}\n{table(rows)}")


if __name__ == "__main__":
    main()
