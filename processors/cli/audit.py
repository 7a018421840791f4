"""`settle audit PARENT_ID FILE`: the whole history of one parent, for people.

Folds every input of the file (one partition) through the processor's fold into a fresh in-memory
ledger, then shows what happened to the chosen parent: every event with its result, every state change,
every release and where it went, and the balances after each step. On the terminal as aligned tables
(`render_text`); with `--html OUT.html` also as one self-contained page that opens with a chart of the
balances per dimension and a timeline of the children (`render_html`).

The pieces, in processors/audit/: history.py (fold and collect), format.py (shared wording), text.py,
chart.py (SVG), html.py (the page).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from branch_settlement.processors.audit.history import History, Segment, Step, Timeline, parent_history
from branch_settlement.processors.audit.errors import UnknownParentError
from branch_settlement.processors.audit.html import CHART_DATA_ID, chart_data, render_html
from branch_settlement.processors.audit.text import render_text
from branch_settlement.errors import SettlementError

__all__ = [
    "CHART_DATA_ID",
    "History",
    "Segment",
    "Step",
    "Timeline",
    "UnknownParentError",
    "add_parser",
    "chart_data",
    "parent_history",
    "render_html",
    "render_text",
]

DESCRIPTION = """\
Show the whole history of one parent reservation: every event that touched it with its result, every
state change of the parent and its children, every release with its destination (parent or global pool),
and the parent's balances (committed, outstanding, pending, available, returned to pool, ...) after each
step, as aligned tables on stdout.

FILE holds the events of one partition, as JSON Lines (the events' JSON form: `settle contract`) or an Avro object container
file (e.g. from `settle export`). Every event of the file is folded, not only the parent's own: ticks
advance ledger time and expire leases for the whole partition. Lines that are not events are counted as
dead letters and otherwise ignored.

With --html OUT.html the same history is also written as one self-contained HTML page (no network
needed to view it): first a chart of the balances per dimension over the history, then a timeline of the
children's states, the final balances, every step and every release. The chart's data is embedded as
JSON (element id "chart-data") for scripts that check it."""


def add_parser(commands) -> None:
    """Register `audit` on a subparsers object (settle's COMMAND)."""
    p = commands.add_parser(
        "audit",
        help="one parent's history: events, state changes, releases, balances (text, or an HTML report)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("parent_id", metavar="PARENT_ID", help="the parent reservation to show (exact id)")
    p.add_argument("file", metavar="FILE", nargs="?",
                   help="events: JSON Lines or an Avro container file (one partition), or a `settle export` file; - "
                        "for standard input")
    p.add_argument("--topic", metavar="NAME", help="read the input topic (branch-events) instead of a file")
    p.add_argument("--html", metavar="OUT.html",
                   help="also write the self-contained HTML report to OUT.html (overwritten if it exists)")
    p.add_argument("--partition", type=int, default=None, metavar="N",
                   help="the partition the events came from (default: 0 for a plain file; found for a topic or "
                        "an export)")
    from branch_settlement.processors.cli import arguments

    arguments.add_kafka_command(p)
    arguments.add_wire_format(p)
    arguments.add_progress(p)
    p.set_defaults(run=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    from branch_settlement.processors.kafka import wire

    if bool(args.file) == bool(args.topic):
        raise SettlementError("give either FILE or --topic branch-events")
    if args.partition is not None and args.partition < 0:
        raise SettlementError("--partition must be >= 0")
    if args.html and not Path(args.html).resolve().parent.is_dir():
        raise SettlementError(f"--html {args.html}: no such directory {Path(args.html).resolve().parent}")
    import contextlib

    from branch_settlement.processors.cli.inputs import STDIN, input_file

    codec = wire.codec_for(args, writes=False)
    with input_file(args.file) if args.file else contextlib.nullcontext() as path:
        name = "standard input" if args.file == STDIN else os.path.basename(args.file or "")
        partition, inputs, source, partitions = _inputs(args, codec, path, name)
        history = parent_history(inputs, args.parent_id, codec, partition, partitions)
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    sys.stdout.write(render_text(history, color=color))
    if args.html:
        try:
            Path(args.html).write_text(render_html(history, source=source), encoding="utf-8")
        except OSError as err:
            raise SettlementError(f"cannot write {args.html}: {err.strerror or err}") from err
        print(f"\nHTML report written to {args.html}")
    return 0


def _inputs(args: argparse.Namespace, codec, path: str | None, name: str):
    """(partition, inputs of that partition, source name, the topic's partition count or None) for the
    parent: a plain file is one partition; a topic or an export file holds several, and the parent's events
    are in exactly one of them (with the processor's ticks merged in)."""
    from branch_settlement.processors.replay import export_format
    from branch_settlement.processors.replay.replayer import read_events

    if path is not None:
        if not export_format.is_export(path):
            return args.partition or 0, read_events(path, codec), name, None
        by_partition = export_format.read_export(path, codec)
        count = export_format.export_partition_count(path)
        source = name
    else:
        from branch_settlement.processors.kafka import connection
        from branch_settlement.processors.crosscheck import readers
        from branch_settlement.processors.cli.kafka_commands import topic_names

        if args.topic != "branch-events":
            raise SettlementError("--topic: only the input topic, branch-events, holds a parent's history")
        names = topic_names(args.topic_prefix, args.topic_spec)
        topic = names["branch-events"]
        client = connection.config_from_args(args)
        every_partition = readers.partitions_of(client, topic)
        count = len(every_partition)
        from branch_settlement.processors.cli.replay import _known_partitions

        partitions = _known_partitions(None if args.partition is None else [args.partition], every_partition,
                                       topic, "--partition")
        from branch_settlement.processors.crosscheck.progress import Progress

        total = sum(high - low for high, low in readers.input_bounds(client, topic, partitions).values())
        with Progress(total, unit="records", verb="read", mode=args.progress) as progress:
            by_partition = readers.read_folded_inputs(client, names, partitions, codec, progress)
        source = topic
    for partition, items in by_partition.items():
        if any(item.event is not None and item.event["parent_id"] == args.parent_id for item in items):
            return partition, items, f"{source} partition {partition}", count
    raise UnknownParentError(f"no event names parent {args.parent_id!r} in {source}")
