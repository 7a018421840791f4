"""`settle`: the one command-line entry point. Every command has --help; expected failures print one
clear line on stderr and exit non-zero, never a traceback.

A Kafka command first runs its preflight (processors/cli/preflight.py): connection, credentials and ACLs
proven with one bounded round of requests. A librdkafka failure that still escapes a command (a
KafkaException) is mapped to the same one-line errors (processors/kafka/preflight.py, kafka_error)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from importlib.metadata import PackageNotFoundError, version

from confluent_kafka import KafkaException

from branch_settlement.processors.cli import audit
from branch_settlement.processors.cli import replay as replay_cli
from branch_settlement.errors import SettlementError
from branch_settlement.schemas import native
from branch_settlement.processors.kafka import config as cfg

# One meaning per exit code, for every command: 0 done (a replay agrees, topics and ACLs as specified);
# 1 done, and the answer is no (a replay diverges, drift, lines refused); 2 could not be done (an error).
EXIT_OK = 0
EXIT_FAILED = 2


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
        epilog="Exit codes, for every command: 0 done (a replay agrees; topics and ACLs as specified); 1 done, "
               "and the answer is no (a replay diverges, drift, input lines refused); 2 an error (one line on "
               "stderr says what).",
    )
    parser.add_argument("--version", action="version", version=f"settle {_version()}")
    parser.add_argument("--implementation", choices=native.CHOICES, default=None,
                        help="the hot path that runs: compiled (native/, built by `make install` where Rust is; "
                             "the default where installed), python (the pure-Python reference), or auto. Sets "
                             f"{native.ENV} for the command and its workers, so that `settle replay --topic` can "
                             "re-derive a live run with the other implementation")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    replay_cli.add_parsers(commands)
    audit.add_parser(commands)
    _add_contract(commands)
    _add_kafka_commands(commands)
    return parser


# docs/contract.md: in a source tree beside the code, installed as package data (branch_settlement/docs/).
CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "contract.md"


def _add_contract(commands) -> None:
    p = commands.add_parser("contract", help="print the contract: the events and their JSON form, results, outputs",
                            description="Print the contract (docs/contract.md, installed with the package): the "
                                        "model, every event and its JSON form, idempotency, the lifecycle, the "
                                        "result codes, the outputs and their topics, the ledger JSON document.")
    p.set_defaults(run=_print_contract)


def _print_contract(args: argparse.Namespace) -> int:
    try:
        sys.stdout.write(CONTRACT.read_text(encoding="utf-8"))
    except OSError as err:
        raise SettlementError(f"cannot read the contract at {CONTRACT}: {err.strerror or err}") from None
    return EXIT_OK


def _add_kafka_commands(commands) -> None:
    from branch_settlement.processors.cli import acls as acls_cli
    from branch_settlement.processors.cli import kafka_commands, preflight
    from branch_settlement.processors.cli import topics as topics_cli

    kafka_commands.add_run(commands)
    kafka_commands.add_produce(commands)
    kafka_commands.add_inspect(commands)
    topics_cli.add_parser(commands)
    acls_cli.add_parser(commands)
    # settle topics and settle acls run their preflight themselves (their exit code 2: cluster unavailable).
    for name, check in preflight.BY_COMMAND.items():
        commands.choices[name].set_defaults(preflight=check)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.implementation is not None:
            os.environ[native.ENV] = args.implementation
        native.select()  # an unknown choice, or compiled where it is not installed: one line now
        if getattr(args, "before_preflight", None) is not None:
            args.before_preflight(args)
        # every setting of the deployment's config file a command has a flag for: flag < env < file < default
        cfg.resolve_arguments(args)
        if getattr(args, "preflight", None) is not None:
            args.preflight(args)
        return args.run(args)
    except SettlementError as err:
        print(f"settle {args.command}: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KafkaException as exc:
        from branch_settlement.processors.kafka.preflight import kafka_error

        print(f"settle {args.command}: {kafka_error(exc, 'Kafka refused a request')}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
