"""`settle`: the one command-line entry point. Every command has --help; expected failures print one
clear line on stderr and exit non-zero, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import PackageNotFoundError, version

from processors.errors import SettlementError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def _version() -> str:
    try:
        return version("branch-settlement")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="settle",
        description="Settle parent/child capacity reservations of parallel AI workflows, exactly once. "
                    "See `settle COMMAND --help`.",
    )
    parser.add_argument("--version", action="version", version=f"settle {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_replay(commands)
    _add_kafka_commands(commands)
    return parser


def _add_kafka_commands(commands) -> None:
    from processors.kafka import commands as kafka_commands
    from processors.kafka import topics_cli

    kafka_commands.add_run(commands)
    kafka_commands.add_produce(commands)
    kafka_commands.add_inspect(commands)
    topics_cli.add_parser(commands)


def _add_replay(commands) -> None:
    p = commands.add_parser(
        "replay",
        help="fold events from a file through the ledger, no broker needed",
        description="Fold a JSON Lines file (one event per line, SPEC §12 JSON form) or an Avro object "
                    "container file of events through the same fold as the processor, and print the "
                    "resulting ledger and outputs. Lines that cannot be decoded become dead letters with "
                    "their line number and reason; the replay never stops on them.",
    )
    p.add_argument("file", help="events: .jsonl (JSON Lines) or an Avro object container file")
    p.add_argument("--json", action="store_true",
                   help="print the ledger and every output as one JSON document (stable bytes)")
    p.add_argument("--store", metavar="DIR",
                   help="fold into a RocksDB projection at DIR (must not exist yet) instead of memory")
    p.add_argument("--checkpoint-events", type=int, default=10_000, metavar="N",
                   help="write the projection every N events (default: %(default)s)")
    p.set_defaults(run=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    import os

    from processors import replay as rp
    from processors.report import print_summary
    from projections.store import MemoryStore, RocksStore
    from schemas.codec import default_codec

    if not os.path.isfile(args.file):
        raise SettlementError(f"no such file: {args.file}")
    if args.checkpoint_events < 1:
        raise SettlementError("--checkpoint-events must be >= 1")
    if args.store and os.path.exists(args.store):
        raise SettlementError(f"--store {args.store} already exists: replay folds into a fresh projection")
    codec = default_codec()
    store = RocksStore(args.store) if args.store else MemoryStore()
    try:
        result, store = rp.replay(rp.read_events(args.file, codec), store, codec=codec,
                                  checkpoint_events=args.checkpoint_events)
        if args.json:
            doc = rp.replay_document(result, store, codec)
            sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        else:
            print_summary(result, rp.ledger_snapshot(store, codec), sys.stdout)
    finally:
        store.close()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except SettlementError as err:
        print(f"settle {args.command}: {err}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
