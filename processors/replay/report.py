"""Plain-text views of a ledger for people: `settle replay` without --json."""

from __future__ import annotations

from collections import Counter
from typing import TextIO

from branch_settlement.projections import model

# Column headings of the balance table, in BALANCE_TERMS order.
_HEADINGS = ("capacity", "available", "outstanding", "pending", "awaiting", "lent", "to_pool", "committed",
             "overdrawn")


def _quantities(quantities: dict) -> str:
    return " ".join(f"{dim}={q}" for dim, q in sorted(quantities.items())) or "-"


def balance_table(dimensions: dict) -> list[str]:
    width = max([len("dimension")] + [len(dim) for dim in dimensions])
    lines = ["  " + "dimension".ljust(width) + "".join(h.rjust(12) for h in _HEADINGS)]
    for dim, balance in dimensions.items():
        lines.append("  " + dim.ljust(width) + "".join(str(balance[t]).rjust(12) for t in model.BALANCE_TERMS))
    return lines


def print_summary(result, ledger: dict, out: TextIO) -> None:
    codes = Counter(res["result"] for res in result.outputs.results)
    tally = ", ".join(f"{n} {code}" for code, n in sorted(codes.items(), key=lambda kv: (-kv[1], kv[0])))
    out.write(f"{result.events} events folded: {tally or 'none'}; {len(result.dead_letters)} dead letters\n")
    for parent_id, parent in ledger["parents"].items():
        out.write(f"\nparent {parent_id} ({parent['status']})\n")
        out.write("\n".join(balance_table(parent["dimensions"])) + "\n")
    if ledger["children"]:
        out.write("\nchildren\n")
        width = max(len(k) for k in ledger["children"])
        for key, child in ledger["children"].items():
            out.write(f"  {key.ljust(width)}  {child['state']:<18} attempt {child['attempt_id']:<10} "
                      f"reserved {_quantities(child['reserved'])}  consumed {_quantities(child['consumed'])}\n")
    releases = result.outputs.releases
    out.write(f"\nreleases ({len(releases)})\n")
    for rel in releases:
        who = f"{rel['parent_id']}/{rel['child_id']}" if rel["child_id"] else rel["parent_id"]
        out.write(f"  {who}  {rel['dimension']} {rel['quantity']} -> {rel['destination']} ({rel['reason']})\n")
    rejected = [res for res in result.outputs.results if res["result"] not in ("ok", "duplicate")]
    if rejected:
        out.write(f"\nnot applied ({len(rejected)})\n")
        for res in rejected:
            out.write(f"  offset {res['input_offset']} {res['event_id']}: {res['result']} {res['detail']}\n")
    if result.dead_letters:
        out.write(f"\ndead letters ({len(result.dead_letters)})\n")
        for letter in result.dead_letters:
            out.write(f"  line {letter['line']}: {letter['reason']}\n")
