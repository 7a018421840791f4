"""Human output as aligned tables: one helper for every command (machine output is `--json`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], indent: str = "  ",
          numeric: Sequence[bool] | None = None) -> list[str]:
    """The lines of a table: a header row, then one line per row, columns separated by two spaces. A column
    is right-aligned when `numeric` says so (default: when every value in it is a number, as text or not)."""
    rows = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    if numeric is None:
        numeric = [bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(cell.rjust(w) if right else cell.ljust(w)
                                   for cell, w, right in zip(cells, widths, numeric))).rstrip()

    return [line(list(headers))] + [line(row) for row in rows]


def _is_number(text: str) -> bool:
    return text.replace(",", "").replace(".", "", 1).lstrip("-").isdigit()


__all__ = ["table"]
