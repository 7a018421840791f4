"""Broker-facing helpers of the suite: topics under a private prefix, reading topics back read_committed,
a continuous read_committed reader (I4, progress), and an own cluster (a controller and a broker,
deploy/kafka.sh in private run directories) whose broker the scenarios may bounce. The shared broker is only ever used, never touched."""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from branch_settlement.processors.kafka import topics as topics_mod
from branch_settlement.schemas.codec import CodecError, default_codec
from branch_settlement.processors.kafka import ticks

REPO = Path(__file__).resolve().parents[1]
KAFKA_SH = REPO / "deploy" / "kafka.sh"
ADMIN_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 180.0
# The verifier's own list of the processor's output topics, written out on purpose instead of derived from the
# processor's routing table (processors/ledger/outputs.py): an independent check must not share what it checks.
OUTPUT_TOPICS = ("settlement-results", "capacity-releases", "settlement-audit", "branch-events-dlq")
# The processor's own ticks: Tick events keyed by the input offset each was folded before, written in the
# transaction of the checkpoint that folded them (processors/kafka/ticks.py).
TICKS_TOPIC = ticks.TICKS_TOPIC


def is_processor_tick(result: dict) -> bool:
    """A result of one of the processor's own ticks. A Tick on the input topic is only ever answered
    `tick_not_accepted`: that result belongs to an input record like any other."""
    return result["event_type"] == "Tick" and result["result"] != "tick_not_accepted"


def broker_answers(bootstrap: str, timeout_s: float = 5.0) -> bool:
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
        return True
    except KafkaException:
        return False


@dataclass
class Topics:
    """Every topic of deploy/topics.json under a prefix of its own, on one broker."""

    bootstrap: str
    prefix: str
    partitions: int
    names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, bootstrap: str, label: str, partitions: int,
               replication_factor: int = topics_mod.BROKER_DEFAULT_REPLICATION_FACTOR) -> "Topics":
        """`replication_factor` as `settle topics apply --replication-factor` takes it (the broker's default
        unless given); a replicated cluster passes 3, and the drift check then verifies it."""
        prefix = f"faults.{label}.{uuid.uuid4().hex[:8]}."
        spec = topics_mod.load_spec(topics_mod.DEFAULT_SPEC_PATH, prefix=prefix, partitions=partitions,
                                    replication_factor=replication_factor)
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
        reports = topics_mod.apply(admin, spec, timeout_s=ADMIN_TIMEOUT_S)
        if topics_mod.has_drift(reports):
            raise RuntimeError(f"topic drift under a fresh prefix {prefix}: {reports}")
        return cls(bootstrap, prefix, partitions, spec.names())

    def name(self, logical: str) -> str:
        return self.names[logical]

    def delete(self) -> None:
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        existing = [n for n in admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics if n.startswith(self.prefix)]
        topics_mod.delete_topics(admin, existing, timeout_s=ADMIN_TIMEOUT_S)


def read_partitions(bootstrap: str, topic: str, decode: bool = True, isolation: str = "read_committed",
                    timeout_s: float = READ_TIMEOUT_S) -> dict[int, list]:
    """Every record of a topic, per partition in offset order: (offset, key, value or decoded value).
    An undecodable value (e.g. the I5 marker) is kept as raw bytes."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"faults-reader-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "isolation.level": isolation,
                         "enable.partition.eof": True, "log_level": 0})
    codec = default_codec()
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, -2) for p in partitions])
        records: dict[int, list] = defaultdict(list)
        pending = set(partitions)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(pending)} never reached their end")
            for message in consumer.consume(num_messages=10_000, timeout=1.0):
                if message.error():
                    if message.error().code() == KafkaError._PARTITION_EOF:
                        pending.discard(message.partition())
                        continue
                    raise RuntimeError(f"reading {topic}: {message.error().str()}")
                value = message.value()
                if decode:
                    try:
                        value = codec.decode(value)[1]
                    except CodecError:
                        pass
                records[message.partition()].append((message.offset(), message.key(), value))
        return {p: records.get(p, []) for p in partitions}
    finally:
        consumer.close()


class ContinuousReader(threading.Thread):
    """Reads settlement-results and capacity-releases with read_committed while the faults happen (I4):
    counts every result and release, every duplicate release_key and every input offset that got a second
    result, and keeps (time, input results seen) so the scenarios can measure progress and recovery.

    The results of the processor's own ticks are counted apart (`tick_results`; a second one for the same
    tick idempotency key is a duplicate): a tick's result carries the input offset it was folded before,
    which is also the offset of the next input's result, and ticks go on while the input is idle, so they
    are never progress. `tick_time` keeps each partition's latest committed ledger time.

    It assigns the partitions itself (no consumer group: a broker outage cannot make it rejoin and start
    over) and tracks the next offset of each partition, so a record fetched again after a reconnect is the
    same record, not a duplicate. A duplicate is the same release_key, or the same input offset, committed
    at two offsets."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        super().__init__(daemon=True, name="faults-reader")
        self.bootstrap = bootstrap
        self.results_topic = topics.name("settlement-results")
        self.releases_topic = topics.name("capacity-releases")
        self.partitions = topics.partitions
        self.release_keys: set[str] = set()
        self.result_positions: set[tuple[int, int]] = set()
        self.duplicate_releases: list[str] = []
        self.duplicate_results: list[tuple[int, int]] = []
        self.refetched = 0
        self.results = 0
        self.releases = 0
        self.tick_keys: set[str] = set()
        self.duplicate_ticks: list[str] = []
        self.tick_results = 0
        self.tick_time: dict[int, int] = {}  # partition -> ledger time of its last committed tick
        self.progress: list[tuple[float, int]] = [(time.monotonic(), 0)]
        self.errors: list[str] = []
        # (topic, partition) -> [(offset, digest of key and value)] of every record seen committed: on a
        # replicated cluster each must still be there, the same, at the end (R2).
        self.seen: dict[tuple[str, int], list[tuple[int, bytes]]] = defaultdict(list)
        self._next: dict[tuple[str, int], int] = {}
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"faults-i4-{uuid.uuid4().hex[:6]}",
                             "enable.auto.commit": False, "isolation.level": "read_committed", "log_level": 0})
        codec = default_codec()
        try:
            consumer.assign([TopicPartition(t, p, -2) for t in (self.results_topic, self.releases_topic)
                             for p in range(self.partitions)])
            while not self._halt.is_set():
                messages = consumer.consume(num_messages=5_000, timeout=0.2)
                for message in messages:
                    if message.error():
                        if message.error().code() != KafkaError._PARTITION_EOF:
                            self.errors.append(message.error().str())
                        continue
                    where = (message.topic(), message.partition())
                    if message.offset() < self._next.get(where, 0):
                        self.refetched += 1
                        continue
                    self._next[where] = message.offset() + 1
                    self.seen[where].append((message.offset(), record_digest(message.key(), message.value())))
                    try:
                        record = codec.decode(message.value())[1]
                    except CodecError:  # the I5 marker, written at the very end
                        continue
                    self._take(message.topic(), record)
                if self.results != self.progress[-1][1]:
                    with self._lock:
                        self.progress.append((time.monotonic(), self.results))
        finally:
            consumer.close()

    def _take(self, topic: str, record: dict) -> None:
        if topic == self.results_topic and is_processor_tick(record):
            if record["idempotency_key"] in self.tick_keys:
                self.duplicate_ticks.append(record["idempotency_key"])
            else:
                self.tick_results += 1
            self.tick_keys.add(record["idempotency_key"])
            p = record["input_partition"]
            self.tick_time[p] = max(self.tick_time.get(p, 0), record["ledger_time_ms"])
        elif topic == self.results_topic:
            position = (record["input_partition"], record["input_offset"])
            if position in self.result_positions:
                self.duplicate_results.append(position)
            else:
                self.results += 1
            self.result_positions.add(position)
        elif "release_key" in record:  # ParentSettled shares the topic
            if record["release_key"] in self.release_keys:
                self.duplicate_releases.append(record["release_key"])
            else:
                self.releases += 1
            self.release_keys.add(record["release_key"])

    def ticked_past(self, ledger_time_ms: int) -> bool:
        """Whether every partition has committed a tick at `ledger_time_ms` or later."""
        return all(self.tick_time.get(p, 0) >= ledger_time_ms for p in range(self.partitions))

    def wait_for(self, results: int, timeout_s: float, alive=lambda: None) -> None:
        """Until `results` results were read; `alive()` may raise when a processor died unexpectedly."""
        deadline = time.monotonic() + timeout_s
        while self.results < results:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.results} of {results} results committed in {timeout_s:.0f} s")
            alive()
            time.sleep(0.1)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def record_digest(key: bytes | None, value: bytes | None) -> bytes:
    digest = hashlib.blake2b(digest_size=12)
    digest.update(b"%d:" % len(key or b""))
    digest.update(key or b"")
    digest.update(value or b"")
    return digest.digest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnBroker:
    """A cluster of this suite's own, the only one a scenario may bounce, pause or cut off: a KRaft controller
    and a broker as two processes (deploy/kafka.sh KAFKA_ROLE=controller and broker, each in a private run
    directory), the way a production cluster runs them. A broker fault touches the broker only; the controller
    stays up, fences the dead broker when its session expires and hands its partitions back when it returns.

    With one combined node a kill -9 takes the controller down too, and the restarted node then lets Kafka skip
    transaction markers (docs/faults.md, finding 2): that is a broker defect, not what the scenarios test."""

    BROKER_NODE_ID = 2

    def __init__(self, run_dir: Path, port: int | None = None, controller_port: int | None = None) -> None:
        self.run_dir = run_dir
        self.port = port or free_port()
        self.controller_port = controller_port or free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.cluster_id = _cluster_id(run_dir)

    def role_dir(self, role: str) -> Path:
        return self.run_dir / role

    def _sh(self, role: str, command: str, timeout_s: float = 300) -> str:
        env = {**os.environ, "KAFKA_PORT": str(self.port), "KAFKA_CONTROLLER_PORT": str(self.controller_port),
               "KAFKA_RUN_DIR": str(self.role_dir(role)), "KAFKA_ROLE": role, "KAFKA_CLUSTER_ID": self.cluster_id,
               "KAFKA_STOP_TIMEOUT_S": "60", "KAFKA_HEAP_MB": "384"}
        done = subprocess.run(["bash", str(KAFKA_SH), command], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"kafka.sh {command} ({role}, port {self.port}) failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def up(self) -> None:
        """Start whatever is not running (the controller first), and wait until the broker answers."""
        self._sh("controller", "up")
        self._sh("broker", "up")

    def down(self, fence_timeout_s: float = 60, stopped=None) -> None:
        """A clean stop of the broker (a controlled shutdown through the controller), then, as after kill9,
        wait until the controller has fenced it: until its session expires the controller refuses the
        restarted broker's registration (DUPLICATE_BROKER_REGISTRATION) just the same. `stopped()` is called
        once the broker's process is gone, before that wait."""
        fences = self._fences()
        try:
            self._sh("broker", "down")
        finally:
            if stopped is not None:
                stopped()
        self._wait_fenced(fences, fence_timeout_s)

    def pid(self, role: str = "broker") -> int | None:
        run_dir = self.role_dir(role)
        try:
            pid = int((run_dir / "pid").read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return None
        return pid if str(run_dir).encode() in cmdline else None

    def kill9(self, fence_timeout_s: float = 60) -> None:
        """kill -9 the broker, then wait until the controller has fenced it (its session expired: 9 s,
        broker.session.timeout.ms). A broker restarted before that is refused registration (its old
        incarnation still holds it) and meanwhile acts on the stale metadata that names it leader; the fence
        then takes those leaders away while its transaction coordinator is writing markers (finding 2)."""
        pid = self.pid()
        if pid is None:
            raise RuntimeError(f"own broker on {self.port} is not running")
        fences = self._fences()
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        self._wait_fenced(fences, fence_timeout_s)

    def _wait_fenced(self, fences_before: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._fences() <= fences_before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the controller did not fence the stopped broker within {timeout_s:.0f} s")
            time.sleep(0.2)

    def _fences(self) -> int:
        log = self.role_dir("controller") / "server.log"
        try:
            text = log.read_text(errors="replace")
        except OSError:
            return 0
        return text.count(f"Fencing broker {self.BROKER_NODE_ID} at epoch")

    def signal(self, signum: int) -> None:
        pid = self.pid()
        if pid is None:
            raise RuntimeError(f"own broker on {self.port} is not running")
        os.kill(pid, signum)

    def logs(self) -> dict[str, Path]:
        return {role: self.role_dir(role) / "server.log" for role in ("controller", "broker")}

    def ensure_stopped(self) -> None:
        """Stop both processes whatever state they are in (SIGCONT first, in case a scenario paused one)."""
        for role in ("broker", "controller"):
            pid = self.pid(role)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGCONT)
                self._sh(role, "down")
            except Exception:
                pass
            pid = self.pid(role)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid)


def _cluster_id(run_dir: Path) -> str:
    """A Kafka cluster id (16 bytes, URL-safe base64, unpadded) that is the same for both nodes and for every
    OwnBroker on the same run directory."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).digest()[:16]
    text = base64.urlsafe_b64encode(digest).decode().rstrip("=")
    return "A" + text[1:] if text.startswith("-") else text


def _wait_gone(pid: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return
        time.sleep(0.05)
