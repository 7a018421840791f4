"""bench/results/latest.json and latest.md from one run's figures."""

from __future__ import annotations

import json
from pathlib import Path


def ratio(value: float | None, ceiling: float | None) -> float | None:
    return round(value / ceiling, 3) if value and ceiling else None


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and not value.is_integer():
        text = f"{value:,.1f}" if value < 1_000 else f"{value:,.0f}"
    else:
        text = f"{int(value):,}"
    return f"{text}{unit}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _met(ok: bool | None) -> str:
    return "–" if ok is None else ("yes" if ok else "**no**")


def markdown(doc: dict) -> str:
    s = doc["settings"]
    m = doc["machine"]
    rows = [("measurement", "value", "ceiling", "ratio", "target", "met")]
    t = doc["throughput"]
    rows.append(("processor throughput (events/s, end to end)", _fmt(doc["processor_events_per_s"]),
                 _fmt(doc["ceiling_events_per_s"]), _ratio(doc["processor_to_ceiling"]), "≥ 0.6 of ceiling",
                 _met(doc["targets"]["throughput"])))
    rows.append(("processor throughput, steady 10–90% (events/s)", _fmt(t["processor"]["steady_events_per_s"]),
                 _fmt(t["ceiling"]["steady_events_per_s"]),
                 _ratio(ratio(t["processor"]["steady_events_per_s"], t["ceiling"]["steady_events_per_s"])), "", ""))
    if len(t.get("rounds") or []) > 1:
        rows.append((f"the {len(t['rounds'])} rounds: throughput ratio (order; the median round is above)",
                     ", ".join(f"{_ratio(r['ratio'])} ({r['order']})" for r in t["rounds"]), "", "", "", ""))
        rows.append((f"the {len(t['rounds'])} rounds: CPU ratio", ", ".join(_ratio(r["cpu_ratio"]) for r in t["rounds"]),
                     "", "", "", ""))
    pc, cc = t["processor"].get("cpu_us_per_record"), t["ceiling"].get("cpu_us_per_record")
    rows.append(("processor CPU per input record (µs, every thread)", _fmt(pc), _fmt(cc),
                 _ratio(ratio(pc, cc)) if pc and cc else "–", "≤ 2× the ceiling's",
                 _met(pc <= 2 * cc) if pc and cc else "–"))
    lc = doc["latency"]["ceiling_at_50"]
    lf = doc["latency"]["ceiling_at_50_fixed_period"]
    for level in doc["latency"]["levels"]:
        load = f"{int(level['load'] * 100)}%"
        half = level["load"] == 0.5
        target = f"p99 ≤ {doc['latency']['target_p99_ms']} ms" if half else ""
        met = _met(doc["targets"]["latency"]) if half else ""
        rows.append((f"latency at {load} load ({_fmt(level['achieved_events_per_s'])} events/s): p50 / p99 / max (ms)",
                     f"{_fmt(level['p50'])} / {_fmt(level['p99'])} / {_fmt(level['max'])}",
                     f"{_fmt(lc['p50'])} / {_fmt(lc['p99'])} / {_fmt(lc['max'])}" if half else "",
                     f"p99 × {_ratio(ratio(level['p99'], lc['p99']))}" if half else "", target, met))
    rf, rt, rs = doc["replay"]["file"], doc["replay"]["topic"], doc["restore"]
    rows.append(("replay, file (`settle replay FILE`, events/s)", _fmt(rf["replay_events_per_s"]),
                 _fmt(rf["ceiling_events_per_s"]), _ratio(rf["to_ceiling"]), "", ""))
    rows.append(("replay, topic (`settle replay --topic`, audit, events/s)", _fmt(rt["replay_events_per_s"]),
                 _fmt(rt["ceiling_events_per_s"]), _ratio(rt["to_ceiling"]), "", ""))
    rows.append(("replay CPU per record, file / topic (µs, workers included)",
                 f"{_fmt(rf.get('replay_cpu_us_per_record'))} / {_fmt(rt.get('replay_cpu_us_per_record'))}", "", "",
                 "", ""))
    rows.append((f"restore from the changelog (children/s; {_fmt(rs['children'])} children)",
                 _fmt(rs["restore_children_per_s"]), _fmt(rs["ceiling_children_per_s"]), _ratio(rs["to_ceiling"]),
                 "", ""))
    rows.append(("restore: seconds per million children", _fmt(rs["restore_s_per_million_children"]), "", "", "", ""))
    rows.append(("restore: CPU per changelog record (µs)", _fmt(rs.get("restore_cpu_us_per_record")), "", "", "", ""))
    mem = doc["memory"]
    rows.append((f"peak RSS, {_fmt(mem['children_in_ledger'])} children in the ledger (MB)", _fmt(doc["peak_rss_mb"]),
                 "", "", "< 500 MB, flat", _met(doc["targets"]["memory"])))
    sc = doc["scaling"]
    rows.append(("scaling: 1 → 2 processes (events/s)",
                 f"{_fmt(sc['1']['events_per_s'])} → {_fmt(sc['2']['events_per_s'])}", _fmt(doc["ceiling_events_per_s"]),
                 f"× {_ratio(sc['speedup'])}", "", ""))
    if sc["2"].get("cpu_us_per_record"):
        rows.append(("scaling: CPU per input record, 1 → 2 processes (µs)",
                     f"{_fmt(sc['1'].get('cpu_us_per_record'))} → {_fmt(sc['2']['cpu_us_per_record'])}", "", "", "",
                     ""))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    cp = [("processor, full load", t["processor"]["checkpoints"][0]), ("pass-through, full load",
                                                                    t["ceiling"]["checkpoints"][0])]
    cp += [(f"processor, {int(level['load'] * 100)}% load", level["checkpoints"]) for level in doc["latency"]["levels"]]
    cp.append(("pass-through, 50% load", lc["checkpoints"]))
    cp.append(("pass-through, 50% load, fixed period", lf["checkpoints"]))
    cp_lines = ["| checkpoints | count | commit ms p50 / p99 | spacing ms p50 / p99 | events per checkpoint p50 |",
                "|---|---|---|---|---|"]
    for name, c in cp:
        if c.get("checkpoints", 0) >= 2:
            cp_lines.append(f"| {name} | {c['checkpoints']} | {_fmt(c['commit_ms_p50'])} / {_fmt(c['commit_ms_p99'])} "
                            f"| {_fmt(c['spacing_ms_p50'])} / {_fmt(c['spacing_ms_p99'])} "
                            f"| {_fmt(c['events_per_checkpoint_p50'])} |")
    phases = ", ".join(f"{k} {_fmt(v)}" for k, v in mem["peak_rss_mb_by_phase"].items())
    curve = ", ".join(f"{_fmt(p['children'])}: {_fmt(p['rss_mb'])}" for p in mem["rss_vs_ledger"])
    dirty = f" (uncommitted changes in {', '.join(doc['git']['dirty_files'])})" if doc["git"]["dirty_files"] else ""
    return "\n".join([
        f"# Benchmark results ({doc['mode']})", "",
        f"`{doc['command']}` at commit `{doc['git']['commit']}`{dirty}, {doc['started_at']}, "
        f"{doc['duration_s']:.0f} s. Implementation: {doc.get('implementation', 'python')}.", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {_fmt(m['memory_mb'])} MB; Python {m['python']}, "
        f"librdkafka {m['librdkafka']}, {doc['kafka']} (local, shared); load average "
        f"{m['load_avg_at_start'][0]:.1f} at start, {doc['load_avg_at_end'][0]:.1f} at end. The machine is shared: "
        "compare ratios, not absolute figures.", "",
        f"Settings: {s['partitions']} partitions, commit_interval_ms {s['commit_interval_ms']}, commit_events "
        f"{s['commit_events']}, workload seed {s['seed']} ({_fmt(t['processor']['records'])} input records incl. "
        f"undecodable records, no Ticks: the processor ticks from its clock), latency {s['latency_seconds']} s "
        f"per level. Throughput: {'a warm-up run of the processor (not counted), then ' if s.get('warmup') else ''}"
        f"{s.get('rounds', 1)} round(s) of processor and ceiling, the order alternating; the figures are the "
        "median round's.", "",
        *lines, "",
        "The latency ceiling is the pass-through at the processor's 50% rate, echoing each input record as its "
        "result: the same transactions and the same loop as `settle run`, with no fold. With a fixed-period loop "
        f"(checkpoint due {s['commit_interval_ms']} ms after the start of the previous one, consume never waiting "
        f"past it) the pass-through's p50 / p99 / max are {_fmt(lf['p50'])} / {_fmt(lf['p99'])} / {_fmt(lf['max'])} ms.",
        "",
        *cp_lines, "",
        f"Peak RSS by phase (MB): {phases}. RSS while the ledger grows (children: MB): {curve}.", "",
        "Ceilings: throughput, a transactional pass-through producing the processor's own committed outputs "
        "(same count, bytes and partitions) at the same commit cadence; file replay, decoding the same file; "
        "topic replay, consuming the same topics read_committed; restore, consuming the changelog. "
        "See docs/benchmarks.md.", ""])


def write(doc: dict, directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    json_path, md_path = directory / "latest.json", directory / "latest.md"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    md_path.write_text(markdown(doc))
    return json_path, md_path
