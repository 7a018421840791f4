"""`settle audit` on a terminal: one parent's balances, children, events and releases as aligned tables.

Colour is off unless asked for (the CLI asks when stdout is a terminal and NO_COLOR is unset); cells
are padded before they are coloured, so columns stay aligned either way.
"""

from __future__ import annotations

from typing import Callable

from branch_settlement.processors.ledger import results
from branch_settlement.processors.audit.format import (ARROW, applied, iso_ms, plural, release_source, step_changes,
                                                       who)
from branch_settlement.processors.audit.history import History, Step
from branch_settlement.processors.replay.report import balance_table

_STYLES = {"bold": "1", "dim": "2", "green": "32", "yellow": "33", "red": "31", "cyan": "36"}


class _Painter:
    def __init__(self, color: bool) -> None:
        self.color = color

    def __call__(self, text: str, style: str) -> str:
        return f"\x1b[{_STYLES[style]}m{text}\x1b[0m" if self.color and text.strip() else text

    def result(self, code: str, padded: str) -> str:
        if code in results.APPLIED:
            return self(padded, "green" if code == results.OK else "yellow")
        return self(padded, "yellow" if code == results.DUPLICATE else "red")


def render_text(history: History, *, color: bool = False) -> str:
    paint = _Painter(color)
    sections = [
        _header(history, paint),
        [paint("Balances (final)", "bold")] + balance_table(history.dimensions),
        _children(history, paint),
        _events(history, paint),
        _releases(history, paint),
    ]
    return "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n"


def _header(history: History, paint: _Painter) -> list[str]:
    steps = history.steps
    first, last = steps[0].ledger_time_ms, steps[-1].ledger_time_ms
    lines = [
        paint(f"Parent {history.parent_id}", "bold")
        + f"  status {history.status}, outcome {history.outcome or '-'}",
        f"partition {history.partition}: {plural(history.inputs, 'input')} read, {len(steps)} touch this "
        f"parent ({plural(sum(1 for s in steps if s.is_tick), 'tick')}), "
        f"{plural(len(history.children), 'child', 'children')}, {plural(len(history.releases), 'release')}, "
        f"{plural(history.dead_letters, 'dead letter')}",
        f"ledger time {iso_ms(first)} {ARROW} {iso_ms(last)}",
    ]
    settled = history.settled
    if settled is not None:
        lines.append(f"settled at offset {settled['input_offset']} ({iso_ms(settled['ledger_time_ms'])}), "
                     f"outcome {settled['outcome']}")
    return lines


def _children(history: History, paint: _Painter) -> list[str]:
    rows = []
    for child_id, child in history.children.items():
        timeline = history.timelines.get(child_id)
        path = f" {ARROW} ".join(timeline.states()) if timeline else child["state"]
        rows.append([child_id, ", ".join(timeline.attempts) if timeline else child["attempt_id"],
                     str(child["lease_generation"]), child["state"], _quantities(child["reserved"]),
                     _quantities(child["consumed"]), path])
    if not rows:
        return [paint("Children", "bold"), "  (none)"]
    headings = ["child", "attempts", "gen", "state", "reserved", "consumed", "states passed through"]
    return [paint(f"Children ({len(rows)})", "bold")] + _table(headings, rows, right={2})


def _events(history: History, paint: _Painter) -> list[str]:
    headings = ["offset", "ledger time", "event", "child/attempt", "result", "what changed"]
    rows: list[list[str]] = []
    codes: list[str] = []
    before = None
    for group in _group_quiet_ticks(history.steps):
        step = group[-1]
        changes = step_changes(step, before) or ["-"]
        if len(group) > 1:
            offsets = f"{group[0].offset}-{step.offset}"
            rows.append([offsets, iso_ms(step.ledger_time_ms), f"Tick x{len(group)}", "-", step.result,
                         "ledger time advanced"])
            codes.append(step.result)
        else:
            rows.append([str(step.offset), iso_ms(step.ledger_time_ms), step.event_type,
                         who(step.child_id, step.attempt_id), step.result, changes[0]])
            codes.append(step.result)
            for more in changes[1:]:
                rows.append(["", "", "", "", "", more])
                codes.append("")
        if step.balances is not None:
            before = step.balances
    def result_cell(row: int, col: int, padded: str) -> str:
        return paint.result(codes[row], padded) if col == 4 and codes[row] else padded

    body = _table(headings, rows, right={0}, decorate=result_cell)
    applied_count = sum(1 for s in history.steps if applied(s))
    title = f"Events ({len(history.steps)} steps, {applied_count} applied)"
    return [paint(title, "bold")] + body


def _group_quiet_ticks(steps: list[Step]) -> list[list[Step]]:
    """Runs of ticks that changed nothing of the parent become one row."""
    groups: list[list[Step]] = []
    for step in steps:
        if step.quiet and groups and groups[-1][-1].quiet:
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


def _releases(history: History, paint: _Painter) -> list[str]:
    releases = history.releases
    if not releases:
        return [paint("Releases", "bold"), "  (none)"]
    rows = [[str(rel["input_offset"]), iso_ms(rel["ledger_time_ms"]),
             release_source(rel),
             rel["dimension"], str(rel["quantity"]), rel["destination"], rel["reason"]]
            for rel in releases]
    headings = ["offset", "ledger time", "from", "dimension", "quantity", "destination", "reason"]
    totals = {}
    for rel in releases:
        key = (rel["dimension"], rel["destination"])
        totals[key] = totals.get(key, 0) + rel["quantity"]
    summary = "; ".join(f"{dim} {q} {ARROW} {dest}" for (dim, dest), q in sorted(totals.items()))
    return ([paint(f"Releases ({len(releases)})", "bold")] + _table(headings, rows, right={0, 4})
            + [f"  total: {summary}"])


def _table(headings: list[str], rows: list[list[str]], right: set[int] = frozenset(),
           decorate: Callable[[int, int, str], str] | None = None) -> list[str]:
    """Aligned columns, two spaces apart, indented by two; the last column is not padded. `decorate`
    (row index, column index, padded cell) may colour a body cell after it was padded."""
    widths = [max([len(headings[i])] + [len(row[i]) for row in rows]) for i in range(len(headings))]

    def line(cells: list[str], row: int | None) -> str:
        padded = [cell.rjust(w) if i in right else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(cells, widths))]
        padded[-1] = cells[-1]
        if decorate is not None and row is not None:
            padded = [decorate(row, i, cell) for i, cell in enumerate(padded)]
        return ("  " + "  ".join(padded)).rstrip()

    return [line(headings, None)] + [line(cells, i) for i, cells in enumerate(rows)]


def _quantities(quantities: dict) -> str:
    return " ".join(f"{dim}={q}" for dim, q in sorted(quantities.items())) or "-"
