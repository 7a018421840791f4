"""ACLs as code: load the declarative ACL set (deploy/acls.json), compare it with a cluster, create what is
missing.

Each role (producer, processor, auditor, consumer, waiter) grants operations on topics (logical names of the topic spec, so
the topic prefix applies), consumer groups and transactional ids. `resolve` turns the spec, the topic spec
and the principals given to each role into concrete ACLs; `check` compares them with the cluster's, and
`apply` creates the missing ones. An ALLOW a role's principal has on a resource the spec covers, beyond what
the spec grants, is *extra*: reported, and removed only when asked (`remove_extra`), since least privilege
is the point and an ACL someone added by hand is an operator's to judge.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import (AclBinding, AclBindingFilter, AclOperation, AclPermissionType, AdminClient,
                                   ConfigResource, ResourcePatternType, ResourceType)

from branch_settlement.processors.kafka.errors import AclSpecError, KafkaFailure
from branch_settlement.processors.kafka.preflight import kafka_error
from branch_settlement.processors.kafka.topics import Spec

SPEC_ENV = "SETTLE_ACL_SPEC"
DEFAULT_SPEC_PATH = Path(__file__).resolve().parents[2] / "deploy" / "acls.json"
ROLES = ("producer", "processor", "auditor", "consumer", "waiter")
# The consumer role's consumer groups: every group.id with this prefix (`--consumer-group-prefix`), e.g.
# SettlementConsumer(group_id="settle-consumer-quota-service").
DEFAULT_CONSUMER_GROUP_PREFIX = "settle-consumer-"
# The restore consumer's group.id is the processor's group id with this suffix (processors/kafka/restore.py).
RESTORE_GROUP_SUFFIX = "-restore"
ALL_TOPICS = "*"
ANY_HOST = "*"

RESOURCES = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP, "transactional_id": ResourceType.TRANSACTIONAL_ID}
PATTERNS = {"literal": ResourcePatternType.LITERAL, "prefixed": ResourcePatternType.PREFIXED}
# The operations a grant may name on each kind of resource (Kafka's own table, docs "Operations and Resources").
OPERATIONS = {
    "topic": {"READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS", "ALTER", "ALTER_CONFIGS", "CREATE", "DELETE"},
    "group": {"READ", "DESCRIBE", "DELETE"},
    "transactional_id": {"WRITE", "DESCRIBE"},
}
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
_PRINCIPAL = re.compile(r"[A-Za-z]+:.+")

STATUS_OK = "ok"
STATUS_CREATED = "created"
STATUS_MISSING = "missing"
STATUS_EXTRA = "extra"
STATUS_REMOVED = "removed"


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW ACL: `principal` may perform `operation` on the resource (`kind`, `name`, `pattern`) from any host.
    `role` and `why` say where it comes from (not part of its identity)."""

    principal: str
    kind: str  # topic, group, transactional_id
    name: str
    pattern: str  # literal, prefixed
    operation: str  # an AclOperation name: READ, WRITE, DESCRIBE, ...
    host: str = ANY_HOST
    role: str = field(default="", compare=False)
    why: str = field(default="", compare=False)

    def binding(self) -> AclBinding:
        return AclBinding(RESOURCES[self.kind], self.name, PATTERNS[self.pattern], self.principal, self.host,
                          AclOperation[self.operation], AclPermissionType.ALLOW)

    def describe(self) -> str:
        pattern = "" if self.pattern == "literal" else f" ({self.pattern})"
        host = "" if self.host == ANY_HOST else f" from host {self.host}"
        return f"{self.principal} ALLOW {self.operation} on {self.kind} {self.name}{pattern}{host}"


@dataclass(frozen=True)
class AclSet:
    """The resolved ACLs, and for each role the principals it was given."""

    acls: tuple[Acl, ...]
    principals: Mapping[str, tuple[str, ...]]

    def of_role(self, role: str) -> list[Acl]:
        return [acl for acl in self.acls if acl.role == role]


@dataclass(frozen=True)
class AclReport:
    acl: Acl
    status: str


def default_principals() -> dict[str, str]:
    """Each role's default principal, as the spec names it."""
    document = _read(DEFAULT_SPEC_PATH)
    return {role: document["roles"][role]["principal"] for role in ROLES}


def load(path: str | os.PathLike | None, topic_spec: Spec, principals: Mapping[str, Sequence[str]] | None = None,
         group_id: str = "branch-settlement", transactional_id_prefix: str = "branch-settlement",
         topic_prefix: str = "", consumer_group_prefix: str = DEFAULT_CONSUMER_GROUP_PREFIX) -> AclSet:
    """Read the ACL spec (default deploy/acls.json, or SETTLE_ACL_SPEC) and resolve it: see `resolve`."""
    path = Path(path or os.environ.get(SPEC_ENV) or DEFAULT_SPEC_PATH)
    return resolve(_read(path), topic_spec, principals, group_id=group_id,
                   transactional_id_prefix=transactional_id_prefix, topic_prefix=topic_prefix,
                   consumer_group_prefix=consumer_group_prefix, source=str(path))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AclSpecError(f"no ACL spec at {path}: pass --acl-spec or set {SPEC_ENV}") from None
    except (OSError, ValueError) as err:
        raise AclSpecError(f"cannot read the ACL spec {path}: {err}") from None


def resolve(document: object, topic_spec: Spec, principals: Mapping[str, Sequence[str]] | None = None, *,
            group_id: str = "branch-settlement", transactional_id_prefix: str = "branch-settlement",
            topic_prefix: str = "", consumer_group_prefix: str = DEFAULT_CONSUMER_GROUP_PREFIX,
            source: str = "ACL spec") -> AclSet:
    """Concrete ACLs: each grant of each role, for each principal of the role (`principals`, else the
    spec's `principal`), topics named by their physical names in `topic_spec`."""

    def bad(message: str) -> AclSpecError:
        return AclSpecError(f"{source}: {message}")

    if not isinstance(document, dict) or not isinstance(document.get("roles"), dict):
        raise bad("expected an object with an object `roles`")
    unknown = sorted(set(document["roles"]) - set(ROLES))
    if unknown:
        raise bad(f"unknown roles {', '.join(unknown)} (the roles are {', '.join(ROLES)})")
    values = {"group_id": group_id, "transactional_id_prefix": transactional_id_prefix, "topic_prefix": topic_prefix,
              "consumer_group_prefix": consumer_group_prefix}
    physical = topic_spec.names()
    principals = principals or {}
    acls: list[Acl] = []
    chosen: dict[str, tuple[str, ...]] = {}
    for role in ROLES:
        entry = document["roles"].get(role)
        if not isinstance(entry, dict) or not isinstance(entry.get("grants"), list):
            raise bad(f"role {role}: expected an object with a list `grants`")
        who = tuple(principals.get(role) or [entry.get("principal", "")])
        for principal in who:
            if not isinstance(principal, str) or not _PRINCIPAL.fullmatch(principal):
                raise bad(f"role {role}: principal {principal!r} is not TYPE:NAME, e.g. User:{role}")
        chosen[role] = who
        for grant in entry["grants"]:
            for kind, name, pattern, operations, why in _grant(grant, role, physical, values, bad):
                acls.extend(Acl(principal, kind, name, pattern, operation, role=role, why=why)
                            for principal in who for operation in operations)
    unique: dict[Acl, Acl] = {}
    for acl in acls:  # in the spec's order, each once
        unique.setdefault(acl, acl)
    return AclSet(acls=tuple(unique.values()), principals=chosen)


def _grant(grant: object, role: str, physical: Mapping[str, str], values: Mapping[str, str], bad):
    if not isinstance(grant, dict):
        raise bad(f"role {role}: each grant must be an object: {grant!r}")
    kinds = [kind for kind in RESOURCES if kind in grant]
    if len(kinds) != 1:
        raise bad(f"role {role}: a grant names exactly one of {', '.join(RESOURCES)}: {grant!r}")
    kind = kinds[0]
    name = grant[kind]
    pattern = grant.get("pattern", "literal")
    operations = grant.get("operations")
    if not isinstance(name, str) or not name:
        raise bad(f"role {role}: {kind} must be a non-empty string")
    if pattern not in PATTERNS:
        raise bad(f"role {role}, {kind} {name}: pattern must be literal or prefixed, not {pattern!r}")
    if (not isinstance(operations, list) or not operations
            or not all(isinstance(op, str) and op in OPERATIONS[kind] for op in operations)):
        raise bad(f"role {role}, {kind} {name}: operations must be a list of {', '.join(sorted(OPERATIONS[kind]))}")
    why = str(grant.get("why", ""))
    if kind == "topic":
        if pattern != "literal":
            raise bad(f"role {role}, topic {name}: topics are granted by name (literal); `*` means every topic")
        if name == ALL_TOPICS:
            return [(kind, topic, pattern, operations, why) for topic in physical.values()]
        if name not in physical:
            raise bad(f"role {role}: topic {name!r} is not in the topic spec ({', '.join(physical)})")
        return [(kind, physical[name], pattern, operations, why)]

    def fill(match: re.Match) -> str:
        if match.group(1) not in values:
            raise bad(f"role {role}, {kind} {name}: unknown placeholder {{{match.group(1)}}} "
                      f"(known: {', '.join('{' + v + '}' for v in values)})")
        return values[match.group(1)]

    resolved = _PLACEHOLDER.sub(fill, name)
    if not resolved:
        raise bad(f"role {role}, {kind} {name}: empty once its placeholders are filled in")
    return [(kind, resolved, pattern, operations, why)]


# -- the cluster -----------------------------------------------------------------------------------------


def _existing(admin: AdminClient, principals: Iterable[str], timeout_s: float) -> set[Acl]:
    """Every ALLOW ACL of these principals (topics, groups, transactional ids, and any other kind)."""
    found = set()
    for principal in sorted(set(principals)):
        flt = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, principal, None,
                               AclOperation.ANY, AclPermissionType.ALLOW)
        try:
            bindings = admin.describe_acls(flt, request_timeout=timeout_s).result()
        except KafkaException as exc:
            raise kafka_error(exc, "cannot list the cluster's ACLs", {}) from None
        for b in bindings:
            found.add(Acl(b.principal, b.restype.name.lower(), b.name, b.resource_pattern_type.name.lower(),
                          b.operation.name, host=b.host))
    return found


def _matches(pattern: str, name: str, resource: str) -> bool:
    return name in (resource, "*") if pattern == "literal" else resource.startswith(name)


def _covered(acl: Acl, wanted: AclSet) -> bool:
    """Whether an existing ACL of a role's principal touches what the spec covers: any ACL of a kind the spec
    does not grant (the cluster), any whose pattern matches a resource the spec names (a `*` or a prefix
    included), any within a prefix the spec grants."""
    if acl.kind not in RESOURCES:
        return True
    return any(mine.kind == acl.kind and (_matches(acl.pattern, acl.name, mine.name)
                                          or (mine.pattern == "prefixed" and acl.name.startswith(mine.name)))
               for mine in wanted.acls)


def require_authorizer(admin: AdminClient, timeout_s: float = 15.0) -> None:
    """Raise unless the brokers enforce ACLs: without an authorizer, Kafka lists no ACLs and allows everything,
    and describe_acls answers with an empty list rather than an error (librdkafka 2.16)."""
    try:
        brokers = admin.list_topics(timeout=timeout_s).brokers
        resources = [ConfigResource(ResourceType.BROKER, str(broker_id)) for broker_id in sorted(brokers)[:1]]
        if not resources:
            return
        configs = next(iter(admin.describe_configs(resources, request_timeout=timeout_s).values())).result()
    except KafkaException as exc:
        raise kafka_error(exc, "cannot read the brokers' authorizer setting", {}) from None
    entry = configs.get("authorizer.class.name")
    if entry is not None and not entry.value:
        raise KafkaFailure("the brokers have no authorizer (authorizer.class.name is empty): ACLs would not be "
                           "enforced, every principal may do everything. Configure one (e.g. "
                           "org.apache.kafka.metadata.authorizer.StandardAuthorizer, docs/kafka.md)",
                           code="SECURITY_DISABLED")


def check(admin: AdminClient, wanted: AclSet, timeout_s: float = 15.0) -> list[AclReport]:
    """Compare the cluster's ACLs with the spec's, changing nothing: each wanted ACL ok or missing, then each
    extra ALLOW of the roles' principals on what the spec covers."""
    require_authorizer(admin, timeout_s)
    existing = _existing(admin, [p for who in wanted.principals.values() for p in who], timeout_s)
    reports = [AclReport(acl, STATUS_OK if acl in existing else STATUS_MISSING) for acl in wanted.acls]
    wanted_set = set(wanted.acls)
    roles = {p: role for role, who in wanted.principals.items() for p in who}
    extras = sorted(acl for acl in existing if acl not in wanted_set and _covered(acl, wanted))
    reports += [AclReport(Acl(a.principal, a.kind, a.name, a.pattern, a.operation, a.host,
                              role=roles.get(a.principal, "")), STATUS_EXTRA) for a in extras]
    return reports


def apply(admin: AdminClient, wanted: AclSet, timeout_s: float = 15.0, remove_extra: bool = False
          ) -> list[AclReport]:
    """Create the missing ACLs (creating one that exists changes nothing, so a race is harmless); with
    `remove_extra`, delete the extra ones. Returns the reports of `check`, with what was done."""
    reports = check(admin, wanted, timeout_s)
    missing = [r.acl for r in reports if r.status == STATUS_MISSING]
    if missing:
        futures = admin.create_acls([acl.binding() for acl in missing], request_timeout=timeout_s)
        for binding, future in futures.items():
            try:
                future.result()
            except KafkaException as exc:
                raise kafka_error(exc, f"cannot create the ACL {binding}", {}) from None
    removed = set()
    if remove_extra:
        extra = [r.acl for r in reports if r.status == STATUS_EXTRA]
        for acl in extra:
            flt = AclBindingFilter(ResourceType[acl.kind.upper()], acl.name, ResourcePatternType[acl.pattern.upper()],
                                   acl.principal, acl.host, AclOperation[acl.operation], AclPermissionType.ALLOW)
            try:
                admin.delete_acls([flt], request_timeout=timeout_s)[flt].result()
            except KafkaException as exc:
                raise kafka_error(exc, f"cannot delete the ACL {acl.describe()}", {}) from None
            removed.add(acl)
    done = []
    for report in reports:
        if report.status == STATUS_MISSING:
            done.append(AclReport(report.acl, STATUS_CREATED))
        elif report.status == STATUS_EXTRA and report.acl in removed:
            done.append(AclReport(report.acl, STATUS_REMOVED))
        else:
            done.append(report)
    return done
