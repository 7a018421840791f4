"""Inline SVG for the HTML audit report: the balances of one dimension over the parent's history (a
stacked step area: the terms of SPEC §3 add up to capacity + overdrawn, so the stack shows where every
unit is at each step), and a Gantt-like timeline of the children's states.

Many events share one ledger time (ledger time moves only with ticks), so a chart over ledger time alone
draws most of a history as one vertical line. Each chart is therefore drawn twice: over the events in log
order, one column per step, with the ledger time of each run of steps under the axis (the default); and
over ledger time to scale. The page switches between them. Both use the same x scales for the balance
chart and the timeline, so a child's state change lines up with the balance step it caused.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from html import escape

from branch_settlement.processors.audit.format import TERM_LABELS, clock_ms, iso_ms, row_label, who
from branch_settlement.processors.audit.history import History, Segment, Step, Timeline
from branch_settlement.projections import model

EVENT_MODE = "event"
TIME_MODE = "time"
MODES = (EVENT_MODE, TIME_MODE)

WIDTH = 1160
LEFT = 118  # room for the timeline's row labels; the balance chart uses the same, so columns line up
RIGHT = 178  # room for the end-of-line labels (final values)
PLOT_WIDTH = WIDTH - LEFT - RIGHT

# Bottom to top of the stack. The terms add up to capacity + overdrawn (SPEC §3).
STACK = ("committed", "outstanding", "pending", "awaiting_confirmation", "lent", "returned_to_pool", "available")
# Always in the legend (the issue names them); the others appear when a history uses them.
ALWAYS = ("committed", "outstanding", "pending", "available", "returned_to_pool")
TERM_COLOURS = {
    "committed": "#2f4b7c",
    "outstanding": "#f59f3a",
    "pending": "#d1495b",
    "awaiting_confirmation": "#8e63b5",
    "lent": "#2a9d8f",
    "returned_to_pool": "#9aa5b4",
    "available": "#8cc98f",
    "overdrawn": "#b00020",
}
STATE_COLOURS = {
    model.RESERVED: "#a9c8ec",
    model.ACTIVATED: "#3f7fc1",
    model.PARTIALLY_CONSUMED: "#2a5f95",
    model.CANCEL_REQUESTED: "#f59f3a",
    model.EXPIRED: "#e8692e",
    model.RECONCILING: "#d1495b",
    model.STRANDED: "#8c1c2b",
    model.COMMITTED: "#2f4b7c",
    model.RELEASED: "#67b36b",
    model.PARENT_OPEN: "#a9c8ec",
    model.PARENT_CLOSING: "#f59f3a",
    model.PARENT_CLOSED: "#9aa5b4",
}
STATE_ORDER = (model.RESERVED, model.ACTIVATED, model.PARTIALLY_CONSUMED, model.CANCEL_REQUESTED, model.EXPIRED,
               model.RECONCILING, model.STRANDED, model.COMMITTED, model.RELEASED)
TERMINAL = frozenset({model.COMMITTED, model.RELEASED, model.PARENT_CLOSED})
TEXT_PX_PER_CHAR = 6.6  # 11.5 px sans-serif, a little generous: a label is drawn only where it fits
MIN_TICK_GAP_PX = 34
MIN_BAND_PX = 12  # narrower runs of one ledger time are not shaded: they would only make stripes


def _f(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _attrs(attrs: dict) -> str:
    """Keyword arguments as SVG attributes: `class_` -> class, `text_anchor` -> text-anchor."""
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{escape(str(v), quote=True)}"'
                   for k, v in attrs.items() if v is not None)


def _el(tag: str, content: str = "", **attrs) -> str:
    return f"<{tag}{_attrs(attrs)}>{content}</{tag}>" if content else f"<{tag}{_attrs(attrs)}/>"


def _text(x: float, y: float, text: str, title: str = "", **attrs) -> str:
    return f'<text x="{_f(x)}" y="{_f(y)}"{_attrs(attrs)}>{title}{escape(text)}</text>'


def _clip(text: str, max_chars: float) -> str:
    """`text`, shortened with an ellipsis to at most `max_chars` characters (the full text goes in a tooltip)."""
    limit = max(int(max_chars), 1)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _title(text: str) -> str:
    return f"<title>{escape(text)}</title>"


# -- x scales -------------------------------------------------------------------------------------------


@dataclass
class XScale:
    """Pixel x of every chart point's interval, in one mode. Point i holds from x0[i] to x1[i]."""

    mode: str
    points: list[Step]
    x0: list[float]
    x1: list[float]
    t_start: int = 0
    t_end: int = 0
    columns: list[list[int]] | None = None  # event mode: the point indexes drawn in each column

    @classmethod
    def build(cls, points: list[Step], mode: str) -> "XScale":
        if mode == EVENT_MODE:
            columns = _columns_of(points)
            col = PLOT_WIDTH / len(columns)
            x0, x1 = [], []
            for k, members in enumerate(columns):
                share = col / len(members)
                x0 += [LEFT + k * col + j * share for j in range(len(members))]
                x1 += [LEFT + k * col + (j + 1) * share for j in range(len(members))]
            return cls(mode, points, x0, x1, columns=columns)
        t_start, t_last = points[0].ledger_time_ms, points[-1].ledger_time_ms
        t_end = t_last + max((t_last - t_start) // 25, 1000)
        scale = cls(mode, points, [], [], t_start, t_end)
        times = [p.ledger_time_ms for p in points] + [t_end]
        scale.x0 = [scale.at_ms(t) for t in times[:-1]]
        scale.x1 = [scale.at_ms(t) for t in times[1:]]
        return scale

    @property
    def right(self) -> float:
        return LEFT + PLOT_WIDTH

    def at_ms(self, ms: int) -> float:
        return LEFT + PLOT_WIDTH * (ms - self.t_start) / (self.t_end - self.t_start)

    def index(self, offset: int) -> int:
        """The point at or after `offset` (every offset with a state change has a point)."""
        offsets = [p.offset for p in self.points]
        return min(bisect_left(offsets, offset), len(offsets) - 1)

    def boundary(self, offset: int | None, fraction: float, ms: int | None) -> float:
        if offset is None:
            return self.right
        if self.mode == TIME_MODE:
            return self.at_ms(ms)
        i = self.index(offset)
        return self.x0[i] + fraction * (self.x1[i] - self.x0[i])


def _columns_of(points: list[Step]) -> list[list[int]]:
    """Event mode draws one column per step, except that a run of ticks that changed nothing of the
    parent shares one column: the balances cannot move in it, and a long-lived parent sees many."""
    columns: list[list[int]] = []
    for i, point in enumerate(points):
        if point.quiet and columns and points[columns[-1][-1]].quiet:
            columns[-1].append(i)
        else:
            columns.append([i])
    return columns


def _nice_step(span: float, target: int) -> float:
    raw = span / max(target, 1)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 2.5, 5, 10):
        if factor * magnitude >= raw:
            return factor * magnitude
    return 10 * magnitude


TIME_STEPS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 15_000, 30_000, 60_000,
                 120_000, 300_000, 600_000, 900_000, 1_800_000, 3_600_000, 7_200_000, 21_600_000, 43_200_000,
                 86_400_000)


def _x_axis(scale: XScale, y: float) -> str:
    """Ticks and labels under a plot at `y`: offsets and runs of equal ledger time, or clock times."""
    parts = [_el("line", x1=_f(LEFT), x2=_f(scale.right), y1=_f(y), y2=_f(y), class_="axis")]
    date = iso_ms(scale.points[0].ledger_time_ms)[:10]
    if scale.mode == EVENT_MODE:
        col = PLOT_WIDTH / len(scale.columns)
        every = max(1, math.ceil(MIN_TICK_GAP_PX / col))
        for k, members in enumerate(scale.columns):
            if k % every:
                continue
            first = scale.points[members[0]]
            cx = (scale.x0[members[0]] + scale.x1[members[-1]]) / 2
            parts.append(_el("line", x1=_f(cx), x2=_f(cx), y1=_f(y), y2=_f(y + 4), class_="tick"))
            parts.append(_text(cx, y + 16, str(first.offset), class_="tick-label", text_anchor="middle"))
            if col >= 26:
                about = (f"{len(members)} ticks" if len(members) > 1 else "tick") if first.is_tick else (
                    first.child_id or "parent")
                parts.append(_text(cx, y + 29, _clip(about, every * col / TEXT_PX_PER_CHAR - 1),
                                   class_="tick-about", text_anchor="middle"))
        last_right = -1.0
        for i0, i1, ms in _time_runs(scale.points):
            left, right = scale.x0[i0], scale.x1[i1]
            if right - left < MIN_BAND_PX:
                continue
            parts.append(_el("path", d=f"M{_f(left + 2)} {_f(y + 36)}v4H{_f(right - 2)}v-4", class_="run"))
            centre = (left + right) / 2
            label = next((text for text in _clock_labels(ms) if len(text) * TEXT_PX_PER_CHAR + 4 <= right - left),
                         "")
            half = len(label) * TEXT_PX_PER_CHAR / 2
            if label and centre - half > last_right:
                parts.append(_text(centre, y + 54, label, class_="run-label", text_anchor="middle"))
                last_right = centre + half + 6
        parts.append(_text(LEFT, y + 74, f"steps in log order: input offset and what the step is about; "
                                         f"under them, the ledger time (UTC, {date}) of each run of steps",
                           class_="axis-title"))
        return "".join(parts)
    span = scale.t_end - scale.t_start
    step = next((s for s in TIME_STEPS_MS if span / s <= PLOT_WIDTH / 110), TIME_STEPS_MS[-1])
    first = -(-scale.t_start // step) * step
    for ms in range(first, scale.t_end + 1, step):
        x = scale.at_ms(ms)
        label = clock_ms(ms) if step < 1000 else clock_ms(ms)[:8]
        parts.append(_el("line", x1=_f(x), x2=_f(x), y1=_f(y), y2=_f(y + 4), class_="tick"))
        parts.append(_text(x, y + 16, label, class_="tick-label", text_anchor="middle"))
    parts.append(_text(LEFT, y + 38, f"ledger time (UTC, {date}), to scale", class_="axis-title"))
    return "".join(parts)


def _clock_labels(ms: int) -> list[str]:
    """Ways to say a ledger time under the axis, longest first: with milliseconds, then without them
    when they are zero."""
    full = clock_ms(ms)
    return [full, full[:8]] if ms % 1000 == 0 else [full]


def _time_runs(points: list[Step]) -> list[tuple[int, int, int]]:
    """(first index, last index, ledger time) of each run of consecutive points at the same ledger time."""
    runs: list[tuple[int, int, int]] = []
    for i, point in enumerate(points):
        if runs and runs[-1][2] == point.ledger_time_ms:
            runs[-1] = (runs[-1][0], i, point.ledger_time_ms)
        else:
            runs.append((i, i, point.ledger_time_ms))
    return runs


def _run_bands(scale: XScale, top: float, height: float) -> str:
    """Alternate shading behind runs of steps at one ledger time (event mode only)."""
    if scale.mode != EVENT_MODE:
        return ""
    bands = []
    for k, (i0, i1, _) in enumerate(_time_runs(scale.points)):
        if k % 2 and scale.x1[i1] - scale.x0[i0] >= MIN_BAND_PX:
            bands.append(_el("rect", x=_f(scale.x0[i0]), y=_f(top), width=_f(scale.x1[i1] - scale.x0[i0]),
                             height=_f(height), class_="band"))
    return "".join(bands)


# -- balance chart --------------------------------------------------------------------------------------

CHART_TOP = 40  # room above the plot for the release markers
CHART_PLOT_HEIGHT = 250
AXIS_HEIGHT = {EVENT_MODE: 84, TIME_MODE: 48}  # under a plot: ticks, labels, axis title


def terms_shown(history: History, dim: str) -> list[str]:
    """The stacked terms of one dimension worth a legend entry, bottom to top."""
    used = {term for p in history.points for term in STACK if p.balances[dim][term]}
    return [term for term in STACK if term in ALWAYS or term in used]


def balance_chart(history: History, dim: str, mode: str) -> str:
    points = history.points
    scale = XScale.build(points, mode)
    series = [p.balances[dim] for p in points]
    y_max = max(max(b["capacity"] + b["overdrawn"] for b in series), 1)
    step = _nice_step(y_max, 5)

    def y(value: float) -> float:
        return CHART_TOP + CHART_PLOT_HEIGHT * (1 - value / y_max)

    parts = [_run_bands(scale, CHART_TOP, CHART_PLOT_HEIGHT)]
    value = 0.0
    while value <= y_max + 1e-9:
        parts.append(_el("line", x1=_f(LEFT), x2=_f(scale.right), y1=_f(y(value)), y2=_f(y(value)), class_="grid"))
        parts.append(_text(LEFT - 8, y(value) + 4, _f(value), class_="tick-label", text_anchor="end"))
        value += step
    lower = [0] * len(series)
    for term in STACK:
        upper = [lo + b[term] for lo, b in zip(lower, series)]
        if any(b[term] for b in series):
            parts.append(_area(scale, lower, upper, y, term))
        lower = upper
    capacity = [b["capacity"] for b in series]
    cap_path = "".join(f"{'M' if i == 0 else 'L'}{_f(scale.x0[i])} {_f(y(c))}H{_f(scale.x1[i])}"
                       for i, c in enumerate(capacity))
    parts.append(_el("path", d=cap_path, class_="capacity"))
    parts.append(_el("line", x1=_f(LEFT), x2=_f(LEFT), y1=_f(CHART_TOP), y2=_f(CHART_TOP + CHART_PLOT_HEIGHT),
                     class_="axis"))
    parts.append(_columns(scale, points, dim, CHART_TOP, CHART_PLOT_HEIGHT))
    parts.append(_release_markers(scale, points, dim))
    parts.append(_end_labels(scale, series[-1], y))
    parts.append(_x_axis(scale, CHART_TOP + CHART_PLOT_HEIGHT))
    parts.append(_text(14, CHART_TOP + CHART_PLOT_HEIGHT / 2, f"{dim}", class_="axis-title",
                       transform=f"rotate(-90 14 {_f(CHART_TOP + CHART_PLOT_HEIGHT / 2)})", text_anchor="middle"))
    height = CHART_TOP + CHART_PLOT_HEIGHT + AXIS_HEIGHT[mode]
    return _el("svg", "".join(parts), class_=f"balance-chart by-{mode}", viewBox=f"0 0 {WIDTH} {height}",
               role="img", aria_label=f"{dim} balances of parent {history.parent_id} over "
                                      f"{'the events' if mode == EVENT_MODE else 'ledger time'}",
               data_dimension=dim, data_mode=mode)


def _area(scale: XScale, lower: list[int], upper: list[int], y, term: str) -> str:
    top = "".join(f"{'M' if i == 0 else 'L'}{_f(scale.x0[i])} {_f(y(u))}H{_f(scale.x1[i])}"
                  for i, u in enumerate(upper))
    bottom = "".join(f"L{_f(scale.x1[i])} {_f(y(lo))}H{_f(scale.x0[i])}" for i, lo in reversed(list(enumerate(lower))))
    return _el("path", d=top + bottom + "Z", fill=TERM_COLOURS[term], class_=f"area term-{term}", data_term=term)


def _columns(scale: XScale, points: list[Step], dim: str, top: float, height: float) -> str:
    """One transparent column per step, with its balances as a tooltip; highlighted on hover."""
    cols = []
    for i, point in enumerate(points):
        width = scale.x1[i] - scale.x0[i]
        if width <= 0:
            continue
        balance = point.balances[dim]
        terms = ", ".join(f"{TERM_LABELS[t]} {balance[t]}" for t in model.BALANCE_TERMS if balance[t])
        tip = (f"offset {point.offset} · {iso_ms(point.ledger_time_ms)}\n{point.event_type} "
               f"{who(point.child_id, point.attempt_id)} → {point.result}\n{dim}: {terms}")
        cols.append(_el("rect", _title(tip), x=_f(scale.x0[i]), y=_f(top), width=_f(width), height=_f(height),
                        class_="col"))
    return "".join(cols)


RELEASE_COLOURS = {model.DESTINATION_PARENT: "#3d8b40", model.DESTINATION_POOL: "#6b7688"}


def _release_markers(scale: XScale, points: list[Step], dim: str) -> str:
    """A marker above the plot where capacity of `dim` was released: who released how much, green when
    it went back to the parent, grey when (any of it) went to the global pool. Releases that fall on one
    x (one step, or one ledger time to scale) share a marker; a label that would overlap is left out."""
    marks: list[tuple[float, list[dict]]] = []
    for i, point in enumerate(points):
        releases = [rel for rel in point.releases if rel["dimension"] == dim]
        if not releases:
            continue
        cx = (scale.x0[i] + scale.x1[i]) / 2 if scale.mode == EVENT_MODE else scale.x0[i]
        if marks and abs(marks[-1][0] - cx) < 1:
            marks[-1][1].extend(releases)
        else:
            marks.append((cx, releases))
    parts = []
    last_right = -1.0
    top = CHART_TOP - 4
    for cx, releases in marks:
        pool = any(rel["destination"] == model.DESTINATION_POOL for rel in releases)
        colour = RELEASE_COLOURS[model.DESTINATION_POOL if pool else model.DESTINATION_PARENT]
        tip = "\n".join(f"offset {rel['input_offset']}: release {rel['child_id'] or 'available'} "
                         f"{rel['quantity']} → {rel['destination']} ({rel['reason']})" for rel in releases)
        parts.append(_el("path", _title(tip), d=f"M{_f(cx - 5)} {_f(top - 7)}h10l-5 7z", fill=colour,
                         class_="release-marker"))
        total = sum(rel["quantity"] for rel in releases)
        sources = sorted({rel["child_id"] for rel in releases if rel["child_id"]})
        label = " ".join(filter(None, [_clip("+".join(sources), 12), str(total), "→ pool" if pool else ""]))
        half = len(label) * TEXT_PX_PER_CHAR / 2
        if cx - half > last_right and len(sources) <= 3:
            parts.append(_text(cx, top - 12, label, class_="release-label", text_anchor="middle", fill=colour))
            last_right = cx + half + 4
    return "".join(parts)


def _end_labels(scale: XScale, final: dict, y) -> str:
    """Final values at the right end of the plot, next to their band; moved apart so none overlap."""
    labels = []
    lower = 0
    for term in STACK:
        if final[term]:
            labels.append([y(lower + final[term] / 2), term, final[term]])
        lower += final[term]
    labels.append([y(final["capacity"]), "capacity", final["capacity"]])
    labels.sort(key=lambda item: item[0])
    gap = 15
    for k in range(1, len(labels)):
        labels[k][0] = max(labels[k][0], labels[k - 1][0] + gap)
    overflow = labels[-1][0] - (CHART_TOP + CHART_PLOT_HEIGHT)
    if overflow > 0:
        for item in labels:
            item[0] -= overflow
    parts = []
    for label_y, term, value in labels:
        if term == "capacity":
            text = f"capacity {value}" + (f", overdrawn {final['overdrawn']}" if final["overdrawn"] else "")
            parts.append(_el("line", x1=_f(scale.right + 10), x2=_f(scale.right + 20), y1=_f(label_y),
                             y2=_f(label_y), class_="capacity"))
            parts.append(_text(scale.right + 26, label_y + 4, text,
                               class_="overdrawn-label" if final["overdrawn"] else "capacity-label"))
            continue
        parts.append(_el("rect", x=_f(scale.right + 10), y=_f(label_y - 5), width="10", height="10", rx="2",
                         fill=TERM_COLOURS[term]))
        parts.append(_text(scale.right + 26, label_y + 4, f"{TERM_LABELS[term]} {value}", class_="end-label"))
    return "".join(parts)


# -- children's timeline ---------------------------------------------------------------------------------

ROW_HEIGHT = 24
ROW_LABEL_PX_PER_CHAR = 7.6  # 13 px bold
ROW_GAP = 8
GANTT_TOP = 8


def timeline_chart(history: History, mode: str) -> str:
    scale = XScale.build(history.points, mode)
    rows = list(history.timelines.values())
    plot_height = len(rows) * (ROW_HEIGHT + ROW_GAP)
    parts = [_run_bands(scale, GANTT_TOP, plot_height)]
    for r, timeline in enumerate(rows):
        top = GANTT_TOP + r * (ROW_HEIGHT + ROW_GAP) + ROW_GAP / 2
        parts.append(_row(scale, timeline, top, history))
    parts.append(_x_axis(scale, GANTT_TOP + plot_height))
    height = GANTT_TOP + plot_height + AXIS_HEIGHT[mode]
    return _el("svg", "".join(parts), class_=f"timeline-chart by-{mode}", viewBox=f"0 0 {WIDTH} {height}",
               role="img", aria_label=f"states of the children of {history.parent_id}", data_mode=mode)


def _row(scale: XScale, timeline: Timeline, top: float, history: History) -> str:
    label = row_label(timeline.child_id)
    attempts = ", ".join(timeline.attempts)
    mid = top + ROW_HEIGHT / 2
    room = (LEFT - 16) / ROW_LABEL_PX_PER_CHAR
    shown = label if len(label) <= room else label[:int(room) - 1] + "…"
    parts = [_el("line", x1=_f(LEFT), x2=_f(scale.right), y1=_f(mid), y2=_f(mid), class_="row-rule"),
             _text(10, mid + 4, shown, _title(f"{label} {attempts}".strip()), class_="row-label")]
    if attempts and len(shown) + 1 + len(attempts) * 0.85 <= room:
        parts.append(_text(10 + (len(shown) + 1) * ROW_LABEL_PX_PER_CHAR, mid + 4, attempts, class_="row-attempts"))
    for seg in timeline.segments:
        parts.append(_segment(scale, seg, timeline.child_id, top))
    parts.append(_text(scale.right + 10, mid + 4, timeline.state, class_="row-state"))
    return "".join(parts)


def _segment(scale: XScale, seg: Segment, child_id: str, top: float) -> str:
    x0 = scale.boundary(seg.start_offset, seg.start_fraction, seg.start_ms)
    x1 = scale.boundary(seg.end_offset, seg.end_fraction, seg.end_ms)
    width = max(x1 - x0, 3.0)
    x0 = min(x0, scale.right - width)
    end = "now" if seg.end_offset is None else f"offset {seg.end_offset} · {iso_ms(seg.end_ms)}"
    tip = (f"{row_label(child_id)}{' · ' + seg.attempt_id if seg.attempt_id else ''}"
           f"{' · lease generation ' + str(seg.lease_generation) if seg.attempt_id else ''}\n{seg.state}: "
           f"offset {seg.start_offset} · {iso_ms(seg.start_ms)} → {end}\n{seg.note}")
    terminal = seg.state in TERMINAL and seg.end_offset is None
    parts = [_el("rect", _title(tip), x=_f(x0), y=_f(top), width=_f(width), height=str(ROW_HEIGHT), rx="3",
                 fill=STATE_COLOURS.get(seg.state, "#888"), class_="seg terminal" if terminal else "seg",
                 data_state=seg.state)]
    label = seg.state.replace("_", " ")
    if width >= len(label) * TEXT_PX_PER_CHAR + 10:
        dark = seg.state in (model.RESERVED, model.PARENT_OPEN, model.RELEASED, model.PARENT_CLOSED) or terminal
        parts.append(_text(x0 + 6, top + ROW_HEIGHT / 2 + 4, label,
                           class_="seg-label dark" if dark else "seg-label"))
    return "".join(parts)
