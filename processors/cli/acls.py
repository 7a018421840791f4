"""`settle acls apply|check|show`: the least-privilege ACLs of deploy/acls.json, for the principal of each role.

Exit codes: 0 every ACL present and none extra; 1 drift (an ACL missing for `check`, an extra one for both);
2 the cluster could not be asked (unreachable, refused, bad settings or spec). Register with `add_parser(subparsers)`.
"""

from __future__ import annotations

import argparse
import json
import sys

from confluent_kafka.admin import AdminClient

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka import acls, preflight, topics
from branch_settlement.processors.cli import arguments
from branch_settlement.processors.kafka import config as cfg
from branch_settlement.processors.kafka.connection import config_from_args
from branch_settlement.processors.kafka.errors import AclSpecError, KafkaFailure

EXIT_OK = 0
EXIT_DRIFT = 1
EXIT_UNAVAILABLE = 2

_ABOUT = """\
ACLs as code: deploy/acls.json grants each role (producer: the orchestrators; processor: settle run;
auditor: settle replay --topic and settle export, read-only; consumer: downstream services reading releases
and results with SettlementConsumer, in groups prefixed --consumer-group-prefix; waiter: an orchestrator
waiting for its events' results, publish_and_wait / ResultWaiter) only what its commands do, on the topics of
deploy/topics.json (with --topic-prefix), the processor's consumer groups (--group-id, and the restore
consumer's <group>-restore) and its transactional ids (prefixed: TOPIC_PREFIX + TRANSACTIONAL_ID_PREFIX-).
Run as a principal allowed to manage ACLs (a super user)."""

_APPLY_HELP = _ABOUT + """

apply creates every ACL the cluster lacks; an ALLOW a role's principal has beyond the spec, on what the spec
covers, is reported as extra (exit 1) and left, unless --remove-extra. Safe to repeat."""
_CHECK_HELP = _ABOUT + """

check compares, changing nothing. Exit 0: every ACL present and none extra; 1: something missing or extra."""
_SHOW_HELP = _ABOUT + """

show prints the ACLs the spec resolves to for these principals and names; it asks no broker."""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "acls", help="create the least-privilege ACLs of each role, or compare the cluster with them",
        description=_ABOUT + " See `settle acls apply --help`.")
    commands = parser.add_subparsers(dest="acls_command", metavar="SUBCOMMAND", required=True)
    for name, run, help_text, description, cluster in (
            ("apply", run_apply, "create missing ACLs, report extra ones", _APPLY_HELP, True),
            ("check", run_check, "compare the cluster's ACLs with the spec, change nothing", _CHECK_HELP, True),
            ("show", run_show, "print the ACLs the spec resolves to, ask no broker", _SHOW_HELP, False)):
        sub = commands.add_parser(name, help=help_text, description=description,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_arguments(sub, cluster)
        if name == "apply":
            sub.add_argument("--remove-extra", action="store_true",
                             help="also delete the extra ALLOW ACLs of the roles' principals on what the spec covers")
        sub.set_defaults(run=run)


def _add_arguments(parser: argparse.ArgumentParser, cluster: bool) -> None:
    if cluster:
        arguments.add_kafka(parser)
        parser.add_argument("--timeout-ms", type=int, default=15_000, metavar="MS",
                            help="how long to wait for each request to the cluster (default: %(default)s)")
    else:
        arguments.add_config(parser)
    try:
        defaults = acls.default_principals()
    except AclSpecError:  # the commands say so when run; every other command (and --help) must not depend on it
        defaults = {role: "as the ACL spec says" for role in acls.ROLES}
    for role in acls.ROLES:
        parser.add_argument(f"--{role}", metavar="PRINCIPAL", action="append",
                            help=f"the principal of the {role} role, e.g. User:{role}; repeatable "
                                 f"(default: {defaults[role]})")
    arguments.add_group(parser, "the processor's consumer group; its restore consumer uses "
                                f"GROUP{acls.RESTORE_GROUP_SUFFIX}")
    parser.add_argument("--transactional-id-prefix", metavar="PREFIX", help=cfg.setting_help("transactional_id_prefix"))
    arguments.add_topic_names(parser)
    parser.add_argument("--consumer-group-prefix", metavar="PREFIX", default=acls.DEFAULT_CONSUMER_GROUP_PREFIX,
                        help="the consumer role's consumer groups: every group.id starting with PREFIX, e.g. "
                             f"{acls.DEFAULT_CONSUMER_GROUP_PREFIX}quota-service (default %(default)s)")
    parser.add_argument("--acl-spec", metavar="FILE",
                        help=f"ACL spec (env {acls.SPEC_ENV}; default: deploy/acls.json, installed with the package)")
    parser.add_argument("--spec", dest="acl_spec", help=argparse.SUPPRESS)  # its old name
    parser.add_argument("--json", action="store_true", help="print the ACLs as JSON")


def _resolve(args: argparse.Namespace) -> acls.AclSet:
    spec = topics.load_spec(args.topic_spec or None, prefix=args.topic_prefix)
    principals = {role: getattr(args, role) for role in acls.ROLES if getattr(args, role)}
    return acls.load(args.acl_spec, spec, principals, group_id=args.group_id,
                     transactional_id_prefix=args.transactional_id_prefix, topic_prefix=args.topic_prefix,
                     consumer_group_prefix=args.consumer_group_prefix)


def run_show(args: argparse.Namespace) -> int:
    wanted = _resolve(args)
    if args.json:
        print(json.dumps([_as_json(acl) for acl in wanted.acls], indent=2))
        return EXIT_OK
    for role in acls.ROLES:
        print(f"{role} ({', '.join(wanted.principals[role])})")
        for acl in wanted.of_role(role):
            pattern = "" if acl.pattern == "literal" else f" ({acl.pattern})"
            print(f"  ALLOW {acl.operation:<9} {acl.kind:<16} {acl.name}{pattern}" +
                  (f"  [{acl.principal}]" if len(wanted.principals[role]) > 1 else ""))
    print(f"{len(wanted.acls)} ACLs")
    return EXIT_OK


def run_apply(args: argparse.Namespace) -> int:
    return _run(args, lambda admin, wanted, timeout_s: acls.apply(admin, wanted, timeout_s, args.remove_extra))


def run_check(args: argparse.Namespace) -> int:
    return _run(args, acls.check)


def _run(args: argparse.Namespace, action) -> int:
    where = f"settle acls {args.acls_command}"
    try:
        wanted = _resolve(args)
        config = config_from_args(args)
        timeout_s = args.timeout_ms / 1000
        # describe_acls answers an unauthorized principal with no ACLs at all, not an error: ask first.
        operations = {"DESCRIBE", "ALTER"} if args.acls_command == "apply" else {"DESCRIBE"}
        preflight.check(config, preflight.Needs(
            cluster=frozenset(operations), hint="run `settle acls` as a principal that manages ACLs, a super user "
                                                "(User:admin on the secured local broker)"), timeout=timeout_s)
        reports = action(AdminClient(config), wanted, timeout_s)
    except (ConfigError, KafkaFailure) as err:
        print(f"{where}: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.json:
        print(json.dumps([{**_as_json(r.acl), "status": r.status} for r in reports], indent=2))
    else:
        for report in reports:
            if report.status != acls.STATUS_OK:
                role = report.acl.role or "?"
                print(f"{report.status:8} {role:<10} {report.acl.describe()}")
        counts: dict[str, int] = {}
        for report in reports:
            counts[report.status] = counts.get(report.status, 0) + 1
        print(f"{len(wanted.acls)} ACLs: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    drift = {acls.STATUS_EXTRA} | ({acls.STATUS_MISSING} if args.acls_command == "check" else set())
    return EXIT_DRIFT if any(report.status in drift for report in reports) else EXIT_OK


def _as_json(acl: acls.Acl) -> dict:
    return {"role": acl.role, "principal": acl.principal, "resource": acl.kind, "name": acl.name,
            "pattern": acl.pattern, "operation": acl.operation, "host": acl.host, "permission": "ALLOW"}
