"""The benchmark's environment: the broker, its own topic sets (one prefix each, all deleted at the end),
the git commit and the machine."""

from __future__ import annotations

import os
import platform
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from branch_settlement.processors.kafka import topics
from branch_settlement.processors.kafka.ticks import TICKS_TOPIC
from branch_settlement.processors.ledger import outputs

REPO = Path(__file__).resolve().parents[2]
ADMIN_TIMEOUT_S = 30.0
INPUT = "branch-events"
CHANGELOG = "ledger-changelog"
RESULTS = "settlement-results"
# What the processor writes: its outputs, its changelog and its ticks (ledger-ticks).
OUTPUT_TOPICS = (*outputs.OUTPUT_TOPICS, CHANGELOG, TICKS_TOPIC)


@dataclass(frozen=True)
class TopicSet:
    """Every topic of deploy/topics.json under one prefix."""

    prefix: str
    names: dict[str, str]  # logical -> physical
    partitions: int

    def name(self, logical: str) -> str:
        return self.names[logical]


@dataclass
class Env:
    bootstrap_servers: str
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    created: list[TopicSet] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})

    def client_config(self) -> dict[str, str]:
        return {"bootstrap.servers": self.bootstrap_servers}

    def group(self, label: str) -> str:
        """A consumer group of this run only (two runs at once must not share a group); deleted at the end."""
        name = f"bench-{self.run_id}-{label}"
        if name not in self.groups:
            self.groups.append(name)
        return name

    def topic_set(self, label: str) -> TopicSet:
        """Fresh topics `bench.<run id>.<label>.*`, with the spec's partitions and configs."""
        prefix = f"bench.{self.run_id}.{label}."
        spec = topics.load_spec(topics.DEFAULT_SPEC_PATH, prefix=prefix)
        reports = topics.apply(self.admin, spec, timeout_s=ADMIN_TIMEOUT_S)
        if topics.has_drift(reports):
            raise RuntimeError(f"topics under {label} drift from the spec: {reports}")
        topic_set = TopicSet(prefix=prefix, names=spec.names(), partitions=spec.topic(INPUT).partitions)
        self.created.append(topic_set)
        return topic_set

    def delete(self, topic_set: TopicSet) -> None:
        topics.delete_topics(self.admin, list(topic_set.names.values()), timeout_s=ADMIN_TIMEOUT_S)
        if topic_set in self.created:
            self.created.remove(topic_set)

    def delete_all(self) -> None:
        """Delete every topic of this run (also any a crashed step left under the run's prefix)."""
        prefix = f"bench.{self.run_id}."
        names = [name for name in self.admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics if name.startswith(prefix)]
        topics.delete_topics(self.admin, names, timeout_s=ADMIN_TIMEOUT_S)
        self.created.clear()
        if self.groups:
            for future in self.admin.delete_consumer_groups(self.groups, request_timeout=ADMIN_TIMEOUT_S).values():
                try:
                    future.result()
                except KafkaException:
                    pass  # a group that never committed does not exist: nothing to delete
            self.groups.clear()


def git_commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout

    # Other engineers edit this working tree: what was measured is HEAD plus these uncommitted files.
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "dirty_files": dirty}


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_mb = 0
    try:
        mem_mb = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    import confluent_kafka
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_mb": mem_mb, "os": platform.platform(),
            "python": platform.python_version(), "confluent_kafka": confluent_kafka.version()[0],
            "librdkafka": confluent_kafka.libversion()[0], "load_avg_at_start": os.getloadavg()}


def kafka_version() -> str:
    out = subprocess.run(["bash", str(REPO / "deploy" / "kafka.sh"), "status"], capture_output=True, text=True,
                         cwd=REPO).stdout
    first = out.splitlines()[0] if out else ""
    return first.split(" running")[0] if " running" in first else first
