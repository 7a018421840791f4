"""`settle replay` (a file or the topic) and `settle export` (a topic range to an Avro file)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone

from branch_settlement.errors import SettlementError
from branch_settlement.schemas import native
from branch_settlement.processors.cli import arguments

EXIT_AGREES = 0
EXIT_DIVERGES = 1
MAX_DIVERGENCES_SHOWN = 50


def add_parsers(commands) -> None:
    p = commands.add_parser(
        "replay", help="fold events from a file or from the topic; against the topic, compare with the outputs",
        description="Fold events through the same fold as the processor. From a FILE (JSON Lines of events in their "
                    "JSON form, `settle contract`; an Avro container of events; or a `settle export` file) no broker is needed; "
                    "undecodable lines become dead letters with their line number and the replay goes on. "
                    "With --topic branch-events it re-folds the topic into fresh projections (the live one is "
                    "never touched), compares every derived result, release, audit record and dead letter with "
                    "what the processors committed, and the final ledgers with the live projections "
                    "(--state-dir); it reports each divergence with its topic, partition and offset and exits "
                    "0 when everything agrees, 1 when anything diverges.")
    p.add_argument("file", nargs="?", help="events: .jsonl, an Avro container file, or a `settle export` file; - "
                                          "for standard input")
    p.add_argument("--topic", metavar="NAME", help="replay the topic instead of a file (logical name: branch-events)")
    p.add_argument("--json", action="store_true",
                   help="print the ledger and every output as one JSON document (stable bytes)")
    p.add_argument("--store", metavar="DIR",
                   help="fold a file into a RocksDB projection at DIR (must not exist yet) instead of memory")
    p.add_argument("--checkpoint-events", type=int, default=10_000, metavar="N",
                   help="write the projection every N events (default: %(default)s)")
    _add_topic_arguments(p)
    p.add_argument("--from-offset", type=int, default=0, metavar="N",
                   help="compare only outputs of input offsets >= N (the fold always starts at the beginning)")
    p.add_argument("--to-offset", type=int, default=sys.maxsize, metavar="N",
                   help="compare only outputs of input offsets <= N")
    p.add_argument("--from-time", metavar="TIME", help="like --from-offset, as a time (ISO 8601 or epoch ms)")
    p.add_argument("--to-time", metavar="TIME", help="like --to-offset, as a time (ISO 8601 or epoch ms)")
    # not the deployment's state_dir setting: comparing the live ledgers is asked for, never implied by a file
    p.add_argument("--state-dir", dest="live_state_dir", metavar="DIR",
                   help="the processor's state directory: compare the final ledgers with its "
                        "projections (stop or drain the processor first)")
    arguments.add_group(p, "the processors' consumer group: an output expected for an input at or beyond its "
                           "committed offsets is reported as not yet processed (their lag, exit code unchanged), "
                           "not as missing")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="processes replaying side by side (default: one per core; 1: all in this process): the "
                        "partitions of --topic and of export files (at most one process per partition), the "
                        "parents of a JSON Lines file of 1 MB or more (in shards, merged into one fold's output)")
    arguments.add_progress(p)
    p.set_defaults(run=run_replay)

    e = commands.add_parser(
        "export", help="write the committed input topic to an Avro container file, for an audit away from Kafka",
        description="Write every committed record of branch-events (selected partitions) with its partition and "
                    "offset, and the processor's ticks of ledger-ticks merged in where they were folded, to an "
                    "Avro object container file (undecodable records keep their bytes and the reason). `settle "
                    "replay FILE` then folds it exactly as `settle replay --topic` would.")
    e.add_argument("-o", "--output", required=True, metavar="FILE.avro")
    e.add_argument("--topic", default="branch-events", metavar="NAME", help="logical topic name (default %(default)s)")
    _add_topic_arguments(e)
    arguments.add_progress(e)
    e.add_argument("--json", action="store_true", help="print what was exported as JSON")
    e.set_defaults(run=run_export)


def _add_topic_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--partitions", metavar="P[,P...]", help="only these partitions (default: all)")
    arguments.add_kafka_command(p)
    arguments.add_wire_format(p)


def _partitions(value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return sorted({int(x) for x in value.split(",")})
    except ValueError:
        raise SettlementError(f"--partitions {value!r}: expected numbers separated by commas") from None


def _counting(items, progress, every: int = 1000):
    """`items`, telling `progress` of them by thousands (and of the rest at the end)."""
    n = 0
    for n, item in enumerate(items, start=1):
        yield item
        if n % every == 0:
            progress(every)
    progress(n % every)


def _known_partitions(chosen: list[int] | None, every: list[int], topic: str, flag: str = "--partitions") -> list[int]:
    """`chosen` (default: every partition), each one a partition of the topic."""
    if chosen is None:
        return every
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        raise SettlementError(f"{flag} {','.join(map(str, unknown))}: {topic} has partitions "
                              f"{every[0]}-{every[-1]}" if every else f"{flag}: {topic} has no partitions")
    return chosen


def _time_ms(value: str) -> int:
    if value.isdigit():
        return int(value)
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise SettlementError(f"{value!r} is neither epoch milliseconds nor an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def run_replay(args: argparse.Namespace) -> int:
    if bool(args.file) == bool(args.topic):
        raise SettlementError("give either FILE or --topic NAME")
    if args.checkpoint_events < 1:
        raise SettlementError("--checkpoint-events must be >= 1")
    if args.jobs is not None and args.jobs < 1:
        raise SettlementError("--jobs must be >= 1")
    return _replay_topic(args) if args.topic else _replay_file(args)


def _replay_file(args: argparse.Namespace) -> int:
    from branch_settlement.processors.cli.inputs import input_file

    with input_file(args.file) as path:
        return _replay_path(args, path)


def _replay_path(args: argparse.Namespace, path: str) -> int:
    from branch_settlement.processors.replay import export_format, partitioned
    from branch_settlement.processors.replay import replayer as rp
    from branch_settlement.processors.replay import sharded
    from branch_settlement.processors.replay.report import print_summary
    from branch_settlement.projections.store import RocksStore
    from branch_settlement.processors.kafka import wire

    from branch_settlement.processors.crosscheck.progress import Progress, count_lines

    codec = wire.codec_for(args, writes=False)
    if export_format.is_export(path):
        # partitions folded side by side (one process per core); each sends back its part of the output
        with Progress(None, unit="records", verb="replayed", mode=args.progress) as progress:
            if args.json:
                parts = partitioned.replay_export(path, codec, lambda p, result, store:
                                                  partitioned.partition_document(p, result, store, codec), args.jobs,
                                                  progress)
            else:
                parts = partitioned.replay_export(path, codec, lambda p, result, store:
                                                  _summary(p, result, store, codec), args.jobs, progress)
        if args.json:
            sys.stdout.write(json.dumps(partitioned.merge_documents(parts), indent=2, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write("".join(parts.values()))
        return EXIT_AGREES
    with open(path, "rb") as probe:
        lines = None if probe.read(4) == b"Obj\x01" else count_lines(path)  # an Avro container: not known
    progress = Progress(lines, unit="lines" if lines is not None else "records", verb="replayed", mode=args.progress)
    if args.store and os.path.exists(args.store):
        raise SettlementError(f"--store {args.store} already exists: replay folds into a fresh projection")
    if args.store:
        store = RocksStore(args.store)
        try:
            # a large file is decoded by a second process while this one folds
            result, store = rp.replay(_counting(rp.read_events_aside(path, codec), progress), store,
                                      codec=codec, checkpoint_events=args.checkpoint_events)
            ledger = rp.ledger_snapshot(store, codec)
        finally:
            store.close()
            progress.finish()
    else:
        # one ledger, folded in parent shards side by side (one process per core): the same bytes out
        with progress:
            result, ledger = sharded.replay_file(path, codec, args.jobs, args.checkpoint_events, progress)
            progress.complete()  # counted by thousands of lines
    if args.json:
        sys.stdout.write(json.dumps(rp.document(result, ledger), indent=2, ensure_ascii=False) + "\n")
    else:
        print_summary(result, ledger, sys.stdout)
    return EXIT_AGREES


def _print_partitioned(folded: dict, codec, as_json: bool, crosscheck: dict | None = None) -> None:
    from branch_settlement.processors.replay import partitioned

    if as_json:
        doc = partitioned.merged_document(folded, codec)
        if crosscheck is not None:
            doc["crosscheck"] = crosscheck
        sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        return
    for partition, (result, store) in folded.items():
        sys.stdout.write(_summary(partition, result, store, codec))


def _summary(partition: int, result, store, codec) -> str:
    import io

    from branch_settlement.processors.replay.replayer import ledger_snapshot
    from branch_settlement.processors.replay.report import print_summary

    out = io.StringIO()
    out.write(f"=== partition {partition}\n")
    print_summary(result, ledger_snapshot(store, codec), out)
    return out.getvalue()


def _names(args: argparse.Namespace) -> dict[str, str]:
    from branch_settlement.processors.cli.kafka_commands import topic_names

    names = topic_names(args.topic_prefix, args.topic_spec)
    if args.topic not in names:
        raise SettlementError(f"--topic {args.topic!r}: expected one of the spec's topics ({', '.join(names)})")
    if args.topic != "branch-events":
        raise SettlementError("only the input topic, branch-events, can be replayed")
    return names


def _replay_topic(args: argparse.Namespace) -> int:
    from branch_settlement.processors.kafka import connection
    from branch_settlement.processors.crosscheck import readers, topic_replay
    from branch_settlement.processors.crosscheck.live_ledgers import live_projections
    from branch_settlement.processors.kafka import wire

    names = _names(args)
    client = connection.config_from_args(args)
    codec = wire.codec_for(args, writes=False)
    partitions = _known_partitions(_partitions(args.partitions),
                                   readers.partitions_of(client, names["branch-events"]), names["branch-events"])
    low, high = args.from_offset, args.to_offset
    if args.from_time or args.to_time:
        if len(partitions) != 1:
            raise SettlementError("--from-time/--to-time select offsets of one partition: give --partitions P")
        if args.from_time:
            low = readers.offsets_for_time(client, names["branch-events"], partitions, _time_ms(args.from_time))[partitions[0]]
        if args.to_time:
            high = readers.offsets_for_time(client, names["branch-events"], partitions, _time_ms(args.to_time))[partitions[0]] - 1
    live = live_projections(args.live_state_dir, args.group_id) if args.live_state_dir else None
    report = topic_replay.audit_replay(client, names, codec, partitions=partitions, offset_range=(low, high),
                                       live_ledgers=live, jobs=args.jobs, keep_folded=args.json,
                                       group_id=args.group_id, progress_mode=args.progress)
    if args.json:
        _print_partitioned(report.folded, codec, True, crosscheck=report.as_json())
    rate = report.events / report.seconds if report.seconds else 0
    out = sys.stderr if args.json else sys.stdout
    out.write(f"replayed {report.events:,} input records of {names['branch-events']} partitions "
              f"{','.join(map(str, report.partitions))} in {report.seconds:.2f} s ({rate:,.0f}/s); compared "
              f"{report.compared:,} outputs" + (" and the live ledgers" if live else "") +
              f"; implementation {native.describe(codec.implementation)}\n")
    lagging = report.inputs_not_yet_processed or report.not_yet_processed
    if lagging:
        _print_lag(report, out)
    if report.agrees:
        out.write("AGREES: every output the processors committed matches the replay\n" if lagging else
                  "AGREES: every output and ledger matches the replay\n")
        return EXIT_AGREES
    out.write(f"DIVERGES: {len(report.divergences)} divergences\n")
    for divergence in report.divergences[:MAX_DIVERGENCES_SHOWN]:
        out.write(divergence.describe() + "\n")
    if len(report.divergences) > MAX_DIVERGENCES_SHOWN:
        out.write(f"... and {len(report.divergences) - MAX_DIVERGENCES_SHOWN} more\n")
    return EXIT_DIVERGES


def _print_lag(report, out) -> None:
    """The processors' lag: inputs beyond their group's committed offsets, whose outputs are not yet due."""
    from branch_settlement.processors.cli.tables import table

    out.write(f"NOT YET PROCESSED: {report.inputs_not_yet_processed:,} input records beyond the committed offsets "
              f"of group {report.group_id}; {len(report.not_yet_processed):,} outputs the replay expects for them "
              "not published yet (the processors' lag, not a divergence)\n")
    rows = [(str(p), f"{lag.committed:,}", f"{lag.input_end:,}", f"{lag.inputs:,}")
            for p, lag in sorted(report.lag.items()) if lag.inputs]
    out.write("\n".join(table(("partition", "committed", "input end", "not yet processed"), rows)) + "\n")


def run_export(args: argparse.Namespace) -> int:
    from branch_settlement.processors.crosscheck import readers
    from branch_settlement.processors.kafka import connection
    from branch_settlement.processors.crosscheck.progress import Progress
    from branch_settlement.processors.replay import export_format
    from branch_settlement.processors.kafka import wire

    names = _names(args)
    client = connection.config_from_args(args)
    codec = wire.codec_for(args, writes=False)
    topic = names["branch-events"]
    every_partition = readers.partitions_of(client, topic)
    partitions = _known_partitions(_partitions(args.partitions), every_partition, topic)
    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        raise SettlementError(f"-o {args.output}: no such directory {directory}")
    total = sum(high - low for high, low in readers.input_bounds(client, topic, partitions).values())
    with Progress(total, unit="records", verb="read", mode=args.progress) as progress:
        folded = readers.read_folded_records(client, names, partitions, codec, progress)
    records = [(p, item, raw) for p in partitions for item, raw in folded[p]]
    with Progress(len(records), unit="records", verb="written", mode=args.progress) as progress:
        try:
            count = export_format.write_export(args.output, _counting(records, progress), codec, len(every_partition))
        except OSError as err:
            raise SettlementError(f"cannot write {args.output}: {err.strerror or err}") from None
    if args.json:
        print(json.dumps({"output": args.output, "topic": topic, "partitions": partitions, "records": count},
                         indent=2))
        return 0
    print(f"exported {count:,} records of {topic} partitions {','.join(map(str, partitions))} to {args.output}")
    return 0
