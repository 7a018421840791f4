"""`settle audit --html`: one self-contained HTML page (inline CSS, SVG and a few lines of JS; nothing
fetched from the network) about one parent. The balance chart comes first; then the children's timeline,
the final balances, every step and every release. The chart's data is embedded as JSON in
`<script type="application/json" id="chart-data">`, so a test (or an auditor's script) can check it
against the ledger without parsing SVG.
"""

from __future__ import annotations

import json
from html import escape

from branch_settlement.processors.ledger import results
from branch_settlement.processors.audit.chart import (MODES, STACK, STATE_COLOURS, STATE_ORDER, TERM_COLOURS,
                                                      balance_chart, terms_shown, timeline_chart)
from branch_settlement.processors.audit.format import (TERM_LABELS, clock_ms, iso_ms, plural, release_source,
                                                       revocation_line, step_changes, who)
from branch_settlement.processors.audit.history import PARENT_ROW, History
from branch_settlement.projections import model

CHART_DATA_ID = "chart-data"


def chart_data(history: History) -> dict:
    """What the charts draw, as data: per dimension, the balances after every step (the last point is
    the final ledger); per child (and the parent, child_id ""), its state segments."""
    return {
        "parent_id": history.parent_id,
        "partition": history.partition,
        "status": history.status,
        "outcome": history.outcome,
        "stack": list(STACK),
        "dimensions": {
            dim: {
                "kind": balance["kind"],
                "capacity": balance["capacity"],
                "points": [
                    {"offset": p.offset, "ledger_time_ms": p.ledger_time_ms, "event_type": p.event_type,
                     "result": p.result, **p.balances[dim]}
                    for p in history.points
                ],
            }
            for dim, balance in history.dimensions.items()
        },
        "loans": [
            {"loan_id": loan["loan_id"], "borrower": loan["borrower"], "quantities": dict(loan["quantities"]),
             "state": loan["state"], "revocation_requested": loan["revocation_requested"],
             "usage": dict(loan["usage"]),
             **{f"{what}_offset": step.offset for what, step in history.loan_steps(loan["loan_id"]).items()}}
            for loan in history.loans
        ],
        "timelines": [
            {"child_id": timeline.child_id, "segments": [
                {"state": s.state, "attempt_id": s.attempt_id, "lease_generation": s.lease_generation,
                 "start_offset": s.start_offset, "start_fraction": s.start_fraction, "start_ms": s.start_ms,
                 "end_offset": s.end_offset, "end_fraction": s.end_fraction, "end_ms": s.end_ms}
                for s in timeline.segments]}
            for timeline in history.timelines.values()
        ],
    }


def _json_script(data: dict) -> str:
    # "<" escaped as \u003c keeps the JSON valid and the script element unbreakable by any id in it.
    text = json.dumps(data, sort_keys=False, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return f'<script type="application/json" id="{CHART_DATA_ID}">{text}</script>'


def render_html(history: History, *, source: str = "") -> str:
    """The report as one HTML document. `source` (a file name) is only shown, never read."""
    title = f"Audit of parent {history.parent_id}"
    body = "".join([
        _header(history, source),
        _charts(history),
        _timeline(history),
        _balances(history),
        _loans(history),
        _events(history),
        _releases(history),
        _footer(history, source),
    ])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head>"
            f'<body class="mode-event">{body}{_json_script(chart_data(history))}<script>{JS}</script>'
            f"</body></html>\n")


def _pill(text: str, kind: str) -> str:
    return f'<span class="pill pill-{escape(kind)}">{escape(text)}</span>'


def _span(first_ms: int, last_ms: int) -> str:
    first, last = iso_ms(first_ms), iso_ms(last_ms)
    if first[:10] == last[:10]:
        return f"{first[:10]} {clock_ms(first_ms)} → {clock_ms(last_ms)} UTC"
    return f"{first} → {last}"


def _header(history: History, source: str) -> str:
    steps = history.steps
    facts = [
        f"outcome <b>{escape(history.outcome)}</b>" if history.outcome else "no outcome yet",
        plural(len(history.children), "child", "children"),
        f"{plural(len(steps), 'step')} ({plural(sum(1 for s in steps if s.is_tick), 'tick')})",
        plural(len(history.releases), "release"),
        f"ledger time {escape(_span(steps[0].ledger_time_ms, steps[-1].ledger_time_ms))}",
    ]
    switch = "".join(
        f'<label><input type="radio" name="mode" value="{mode}"{" checked" if mode == "event" else ""}>'
        f'{"steps in log order" if mode == "event" else "ledger time to scale"}</label>' for mode in MODES)
    return (f'<header><div class="title"><h1>Parent <span class="id">{escape(history.parent_id)}</span></h1>'
            f'{_pill(history.status, history.status)}'
            f'<div class="switch" role="radiogroup" aria-label="x axis">x axis {switch}</div></div>'
            f'<p class="facts">{" · ".join(facts)}</p></header>')


def _legend(items: list[tuple[str, str, str]]) -> str:
    return '<ul class="legend">' + "".join(
        f'<li><i style="background:{colour}"></i>{escape(label)}<b>{escape(value)}</b></li>'
        for label, colour, value in items) + "</ul>"


def _charts(history: History) -> str:
    figures = []
    for dim, balance in history.dimensions.items():
        terms = list(reversed(terms_shown(history, dim)))
        items = [(TERM_LABELS[t], TERM_COLOURS[t], str(balance[t])) for t in terms]
        if balance["overdrawn"] or any(p.balances[dim]["overdrawn"] for p in history.points):
            items.append(("overdrawn (above capacity)", TERM_COLOURS["overdrawn"], str(balance["overdrawn"])))
        svgs = "".join(balance_chart(history, dim, mode) for mode in MODES)
        figures.append(
            f'<figure class="card chart"><figcaption><h2>{escape(dim)}</h2>'
            f'<span class="sub">{escape(balance["kind"])} · capacity {balance["capacity"]} · '
            f'balances after each step; ▼ a release: green back to the parent, grey to the global pool'
            f'</span></figcaption>'
            f'{_legend(items)}{svgs}</figure>')
    return '<section class="charts">' + "".join(figures) + "</section>"


def _timeline(history: History) -> str:
    present = {seg.state for t in history.timelines.values() if t.child_id != PARENT_ROW for seg in t.segments}
    items = [(state.replace("_", " "), STATE_COLOURS[state], "") for state in STATE_ORDER if state in present]
    svgs = "".join(timeline_chart(history, mode) for mode in MODES)
    return (f'<section class="card"><h2>Children</h2><p class="sub">one row per child, coloured by state; '
            f'hover a segment for its attempt, lease generation, offsets and ledger times</p>'
            f'{_legend(items)}{svgs}</section>')


def _balances(history: History) -> str:
    head = "".join(f"<th>{escape(TERM_LABELS[t])}</th>" for t in model.BALANCE_TERMS)
    rows = "".join(
        f"<tr><th>{escape(dim)}</th><td>{escape(b['kind'])}</td>"
        + "".join(f'<td class="num{" zero" if not b[t] else ""}">{b[t]}</td>' for t in model.BALANCE_TERMS)
        + "</tr>" for dim, b in history.dimensions.items())
    settled = history.settled
    note = ""
    if settled is not None:
        note = (f'<p class="sub">settled at offset {settled["input_offset"]} '
                f'({escape(iso_ms(settled["ledger_time_ms"]))}), outcome {escape(settled["outcome"])}</p>')
    return (f'<section class="card"><h2>Final balances</h2>{note}<table class="grid-table"><thead><tr>'
            f"<th>dimension</th><th>kind</th>{head}</tr></thead><tbody>{rows}</tbody></table></section>")


def _quantities(quantities: dict) -> str:
    return ", ".join(f"{dim} {q}" for dim, q in sorted(quantities.items())) or "nothing"


def _at(step) -> str:
    return f'offset {step.offset} ({escape(iso_ms(step.ledger_time_ms))})' if step is not None else "-"


def _loans(history: History) -> str:
    """Explicit borrowing: every loan of the parent, when it was lent, asked back and returned."""
    loans = history.loans
    if not loans:
        return ""
    rows = []
    for loan in loans:
        steps = history.loan_steps(loan["loan_id"])
        asked = steps.get("asked")
        asked_why = next((revocation_line(rec) for rec in (asked.revocations if asked else ())
                          if rec["loan_id"] == loan["loan_id"]), "")
        returned = steps.get("returned")
        rows.append(
            f'<tr><th>{escape(loan["loan_id"])}</th><td>{escape(loan["borrower"])}</td>'
            f'<td>{escape(_quantities(loan["quantities"]))}</td><td>{_at(steps.get("lent"))}</td>'
            f'<td>{_at(asked)}{"<br>" + escape(asked_why) if asked_why else ""}</td>'
            f'<td>{_at(returned)}</td>'
            f'<td>{escape(_quantities(loan["usage"])) if returned else "-"}</td>'
            f'<td>{_pill(loan["state"], "ok" if loan["state"] == model.LOAN_RETURNED else "open")}</td></tr>')
    return (f'<section class="card loans"><h2>Loans</h2><p class="sub">capacity lent to other workloads under the '
            f'parent\'s lending limit; a loan asked back is returned by its borrower, with what it used</p>'
            f'<table class="grid-table"><thead><tr><th>loan</th><th>borrower</th><th>lent</th><th>lent at</th>'
            f'<th>asked back</th><th>returned at</th><th>used</th><th>state</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></section>')


def _result_kind(code: str) -> str:
    if code == results.OK:
        return "ok"
    if code in (results.DUPLICATE, results.OVERDRAWN):
        return "warn"
    return "bad"


def _events(history: History) -> str:
    rows = []
    before = None
    for step in history.steps:
        changes = step_changes(step, before)
        if step.balances is not None:
            before = step.balances
        cls = ' class="quiet"' if step.quiet else ""
        rows.append(
            f"<tr{cls}><td class=\"num\">{step.offset}</td><td class=\"time\">{escape(iso_ms(step.ledger_time_ms))}"
            f"</td><td>{escape(step.event_type)}</td><td>{escape(who(step.child_id, step.attempt_id))}</td>"
            f"<td>{_pill(step.result, _result_kind(step.result))}</td>"
            f"<td class=\"changes\">{'<br>'.join(escape(line) for line in changes)}</td></tr>")
    return (f'<section class="card"><h2>Events</h2><p class="sub">every input that touched the parent, with '
            f'its result and what it changed</p><table class="grid-table events"><thead><tr><th>offset</th>'
            f"<th>ledger time (UTC)</th><th>event</th><th>child/attempt</th><th>result</th><th>what changed</th>"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table></section>")


def _releases(history: History) -> str:
    releases = history.releases
    if not releases:
        return '<section class="card"><h2>Releases</h2><p class="sub">none</p></section>'
    rows = "".join(
        f'<tr><td class="num">{rel["input_offset"]}</td><td class="time">{escape(iso_ms(rel["ledger_time_ms"]))}</td>'
        f'<td>{escape(release_source(rel))}</td>'
        f'<td>{escape(rel["dimension"])}</td><td class="num">{rel["quantity"]}</td>'
        f'<td>{_pill(rel["destination"], "pool" if rel["destination"] == model.DESTINATION_POOL else "parent")}'
        f'</td><td>{escape(rel["reason"])}</td></tr>' for rel in releases)
    return (f'<section class="card"><h2>Releases</h2><table class="grid-table"><thead><tr><th>offset</th>'
            f"<th>ledger time (UTC)</th><th>from</th><th>dimension</th><th>quantity</th><th>destination</th>"
            f"<th>reason</th></tr></thead><tbody>{rows}</tbody></table></section>")


def _footer(history: History, source: str) -> str:
    where = f" of <code>{escape(source)}</code>" if source else ""
    return (f"<footer>settle audit: a replay{where} (partition {history.partition}, "
            f"{plural(history.inputs, 'input')}, {plural(history.dead_letters, 'dead letter')}) through the "
            f"processor's fold into a fresh in-memory ledger.</footer>")


CSS = """
:root{--ink:#1d2433;--muted:#5f6b7d;--line:#e3e7ee;--bg:#f4f6f9;--card:#fff}
*{box-sizing:border-box}
body{margin:0;padding:22px 28px 40px;background:var(--bg);color:var(--ink);
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans","Helvetica Neue",Arial,sans-serif}
header{margin:0 2px 14px}
.title{display:flex;align-items:center;gap:12px;margin-bottom:4px}
h1{font-size:22px;margin:0;font-weight:650;letter-spacing:-.01em}
h1 .id{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace;font-weight:600}
h2{font-size:16px;margin:0 0 2px;font-weight:650}
.facts{margin:0;color:var(--muted)}
.facts b{color:var(--ink);font-weight:600}
.switch{color:var(--muted);font-size:13px;margin-left:auto}
.switch label{margin-left:10px;cursor:pointer}
.switch input{margin:0 4px 0 0;vertical-align:-1px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:14px 18px 10px;margin:0 0 16px;
 box-shadow:0 1px 2px rgba(16,24,40,.04)}
figure{margin:0 0 16px}
figcaption{display:flex;align-items:baseline;gap:12px}
.sub{color:var(--muted);font-size:12.5px;margin:0 0 6px}
.legend{list-style:none;display:flex;flex-wrap:wrap;gap:4px 18px;margin:8px 0 2px;padding:0;font-size:13px}
.legend li{display:flex;align-items:center;gap:6px}
.legend i{display:inline-block;width:12px;height:12px;border-radius:3px}
.legend b{font-weight:600;font-variant-numeric:tabular-nums}
svg{display:block;width:100%;height:auto;overflow:visible}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif}
.mode-event .by-time,.mode-time .by-event{display:none}
.grid{stroke:#e9edf3;stroke-width:1}
.axis{stroke:#9aa3b2;stroke-width:1}
.tick{stroke:#9aa3b2}
.tick-label{font-size:11px;fill:#5f6b7d;font-variant-numeric:tabular-nums}
.axis-title{font-size:11.5px;fill:#5f6b7d}
.run{fill:none;stroke:#b7c0cd}
.tick-about{font-size:10.5px;fill:#8a94a6}
.release-label{font-size:11.5px;font-weight:650;font-variant-numeric:tabular-nums}
.run-label{font-size:11px;fill:#39455a;font-variant-numeric:tabular-nums}
.band{fill:#f3f5f9}
.area{stroke:rgba(255,255,255,.85);stroke-width:1;fill-opacity:.95}
.capacity{fill:none;stroke:#1d2433;stroke-width:1.3;stroke-dasharray:5 4}
.capacity-label{font-size:11.5px;fill:#1d2433;font-weight:600}
.overdrawn-label{font-size:11.5px;fill:#b00020;font-weight:600}
.end-label{font-size:12px;fill:#1d2433;font-variant-numeric:tabular-nums}
.col{fill:transparent}
.col:hover{fill:rgba(29,36,51,.07)}
.row-rule{stroke:#eef1f5}
.row-label{font-size:13px;font-weight:650;fill:#1d2433}
.row-attempts{font-size:11.5px;fill:#5f6b7d}
.row-state{font-size:12px;fill:#39455a}
.seg{stroke:#fff;stroke-width:1}
.seg.terminal{fill-opacity:.72}
.seg:hover{stroke:#1d2433;stroke-width:1.5}
.seg-label{font-size:11.5px;fill:#fff;pointer-events:none}
.seg-label.dark{fill:#1d2433}
table{border-collapse:collapse;width:100%;font-size:13px}
th{text-align:left;font-weight:600;color:var(--muted);font-size:12px;padding:6px 10px;
 border-bottom:1px solid var(--line)}
tbody th{color:var(--ink)}
td{padding:5px 10px;border-bottom:1px solid #f0f2f6;vertical-align:top}
tbody tr:nth-child(even){background:#fafbfd}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.zero{color:#b3bac6}
td.time{font-variant-numeric:tabular-nums;white-space:nowrap;color:#39455a}
td.changes{color:#39455a}
tr.quiet td{color:#9aa3b2}
.pill{display:inline-block;padding:1px 9px;border-radius:999px;font-size:12px;font-weight:600;white-space:nowrap}
.pill-ok,.pill-parent{background:#e3f4e4;color:#22662a}
.pill-warn{background:#fff1d6;color:#8a5a00}
.pill-bad,.pill-expired{background:#fde2e4;color:#9b1c2c}
.pill-pool,.pill-closed{background:#e8ebf0;color:#3b4556}
.pill-open{background:#dcebfb;color:#1f5a99}
.pill-closing{background:#fff1d6;color:#8a5a00}
header .pill{font-size:13px;padding:2px 12px}
footer{color:var(--muted);font-size:12px;margin-top:8px}
code{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace;font-size:.95em}
"""

JS = """
for (const input of document.querySelectorAll('input[name="mode"]')) {
  input.addEventListener('change', () => { document.body.className = 'mode-' + input.value; });
}
"""
