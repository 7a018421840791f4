"""The fault suite's replicated cluster: a quorum of three KRaft controllers and three brokers, six processes
on 127.0.0.1 on ports of their own (deploy/kafka.sh with KAFKA_ROLE, KAFKA_NODE_ID, KAFKA_QUORUM_VOTERS and
KAFKA_EXTRA_CONFIG, each node in a private run directory), replication factor 3 and min.insync.replicas 2
for every topic, the internal ones included. A scenario may kill, stop and restart any node of it.

Why controllers apart from the brokers (six JVMs rather than three combined nodes): a broker fault then
leaves the quorum whole and a controller fault leaves every broker up, so "the partition leader died", "the
transaction coordinator died" and "the active controller died" are three different faults, as in a
production cluster in KRaft's isolated mode (finding 2 in docs/faults.md is what a node that is both did
here). It fits this machine: the controllers run with 256 MiB heaps, the brokers with 384 MiB (about 2.5 GiB
resident in all), and idle JVMs cost little CPU; the cluster starts in 15-40 s on 2 cores.

Which node is what is asked of the cluster itself, never assumed: the partition leaders from the metadata,
the transaction coordinator of a transactional id from Kafka's own TransactionsCommand (the Java tool of
kafka-transactions.sh; confluent-kafka 2.16 has no DescribeTransactions) checked against the partition of
__transaction_state its hash names, the active controller from the controllers' quorum-state files (the
leader of the newest epoch). A broker counts as fenced once the metadata no longer lists it (KRaft lists
unfenced brokers only), as back once it is listed again and every partition's ISR is whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from faults.kafka_io import KAFKA_SH, REPO, _cluster_id, _wait_gone, free_port

CONTROLLER_IDS = (1, 2, 3)
BROKER_IDS = (4, 5, 6)
REPLICATION_FACTOR = 3
MIN_INSYNC = 2
TXN_STATE_PARTITIONS = 8  # transaction.state.log.num.partitions in deploy/server.properties
# Ports the CI broker and other writers on this machine use: never ours.
RESERVED_PORTS = frozenset({9092, 9093, 9192, 9193, 9592, 9593, 9692, 9693, 9792, 9793, 9892, 9893})
EXTRA_CONFIG = f"""\
# The fault suite's replicated cluster (faults/cluster.py): written by the suite, not a deployment file.
default.replication.factor={REPLICATION_FACTOR}
min.insync.replicas={MIN_INSYNC}
offsets.topic.replication.factor={REPLICATION_FACTOR}
transaction.state.log.replication.factor={REPLICATION_FACTOR}
transaction.state.log.min.isr={MIN_INSYNC}
unclean.leader.election.enable=false
"""
# What every topic, the internal ones included, must have (R1).
WANTED_CONFIG = {"min.insync.replicas": str(MIN_INSYNC), "unclean.leader.election.enable": "false"}
INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state")


def _ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in RESERVED_PORTS and port not in ports:
            ports.append(port)
    return ports


def java_hash(text: str) -> int:
    """Java's String.hashCode (UTF-16 code units), as a signed 32-bit int."""
    h = 0
    for unit in text.encode("utf-16-be").hex(" ", 2).split():
        h = (31 * h + int(unit, 16)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def txn_state_partition(transactional_id: str, partitions: int = TXN_STATE_PARTITIONS) -> int:
    """The partition of __transaction_state whose leader coordinates this transactional id
    (TransactionStateManager.partitionFor: Utils.abs(hashCode) % partitions; abs(MIN_VALUE) is 0)."""
    h = java_hash(transactional_id)
    return (0 if h == -(1 << 31) else abs(h)) % partitions


class ReplicatedCluster:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.cluster_id = _cluster_id(run_dir)
        ports = _ports(6)
        self.controller_ports = dict(zip(CONTROLLER_IDS, ports[:3]))
        self.broker_ports = dict(zip(BROKER_IDS, ports[3:]))
        self.voters = ",".join(f"{n}@127.0.0.1:{p}" for n, p in self.controller_ports.items())
        self.bootstrap = ",".join(f"127.0.0.1:{p}" for p in self.broker_ports.values())
        self.extra_config = run_dir / "replicated.properties"
        self.events: list[dict] = []  # what was done to which node, with wall-clock times
        self._reaper: subprocess.Popen | None = None

    # -- the nodes ------------------------------------------------------------------------------------

    def node_dir(self, node: int) -> Path:
        return self.run_dir / (f"controller-{node}" if node in CONTROLLER_IDS else f"broker-{node}")

    def _sh(self, node: int, command: str, timeout_s: float = 300) -> str:
        controller = node in CONTROLLER_IDS
        env = {**os.environ, "KAFKA_ROLE": "controller" if controller else "broker", "KAFKA_NODE_ID": str(node),
               # A controller listens on its controller port only; a broker finds the quorum by the voters.
               "KAFKA_PORT": str(self.broker_ports.get(node) or self.controller_ports[node]),
               "KAFKA_CONTROLLER_PORT": str(self.controller_ports.get(node, self.controller_ports[CONTROLLER_IDS[0]])),
               "KAFKA_QUORUM_VOTERS": self.voters, "KAFKA_EXTRA_CONFIG": str(self.extra_config),
               "KAFKA_RUN_DIR": str(self.node_dir(node)), "KAFKA_CLUSTER_ID": self.cluster_id,
               "KAFKA_HEAP_MB": "256" if controller else "384", "KAFKA_STOP_TIMEOUT_S": "60",
               "KAFKA_UP_TIMEOUT_S": "150"}
        done = subprocess.run(["bash", str(KAFKA_SH), command], env=env, capture_output=True, text=True,
                              timeout=timeout_s, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"kafka.sh {command} (node {node}) failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def _parallel(self, nodes, command: str) -> None:
        errors: list[BaseException] = []

        def one(node: int) -> None:
            try:
                self._sh(node, command)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def up(self, timeout_s: float = 180) -> None:
        """Start every node that is not running (the quorum first), then wait until every broker is listed and
        every partition's ISR is whole."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.extra_config.write_text(EXTRA_CONFIG)
        self._start_reaper()
        self._parallel([n for n in CONTROLLER_IDS if self.pid(n) is None], "up")
        self._parallel([n for n in BROKER_IDS if self.pid(n) is None], "up")
        self.wait_healthy(timeout_s)

    def _start_reaper(self) -> None:
        """faults/reaper.py: kills this cluster's nodes if this process dies without stopping them (SIGKILL,
        a CI timeout: no `finally` runs then). Started once per process and run directory; it exits by itself
        when this process does."""
        if self._reaper is not None and self._reaper.poll() is None:
            return
        self._reaper = subprocess.Popen([sys.executable, "-m", "faults.reaper", str(os.getpid()), str(self.run_dir)],
                                        cwd=REPO, start_new_session=True, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def pid(self, node: int) -> int | None:
        try:
            pid = int((self.node_dir(node) / "pid").read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError):
            return None
        return pid if str(self.node_dir(node)).encode() in cmdline else None

    def _note(self, action: str, node: int, **extra) -> None:
        self.events.append({"at": round(time.time(), 3), "action": action, "node": node, **extra})

    def kill9(self, node: int) -> None:
        pid = self.pid(node)
        if pid is None:
            raise RuntimeError(f"node {node} is not running")
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        self._note("kill -9", node)

    def stop(self, node: int) -> None:
        """A clean stop (SIGTERM: a broker's controlled shutdown moves its leaders away first)."""
        self._sh(node, "down")
        self._note("clean stop", node)

    def start(self, node: int) -> None:
        self._sh(node, "up")
        self._note("start", node)

    def ensure_stopped(self) -> None:
        """Every node down, whatever its state (SIGCONT first, in case one was paused): the brokers together,
        then the controllers together; SIGKILL for any that does not stop."""
        for nodes in (BROKER_IDS, CONTROLLER_IDS):
            threads = [threading.Thread(target=self._stop_quietly, args=(n,)) for n in nodes if self.pid(n) is not None]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.kill()
            self._reaper.wait(10)

    def _stop_quietly(self, node: int) -> None:
        pid = self.pid(node)
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGCONT)
            self._sh(node, "down", timeout_s=90)
        except Exception:  # noqa: BLE001 - killed below
            pass
        pid = self.pid(node)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)

    def logs(self) -> dict[str, Path]:
        return {self.node_dir(n).name: self.node_dir(n) / "server.log" for n in (*CONTROLLER_IDS, *BROKER_IDS)}

    # -- what the cluster says ---------------------------------------------------------------------------

    def admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})

    def metadata(self, timeout_s: float = 10):
        return self.admin().list_topics(timeout=timeout_s)

    def listed_brokers(self) -> set[int]:
        try:
            return set(self.metadata().brokers)
        except KafkaException:
            return set()

    def under_replicated(self, topics=None) -> list[str]:
        """Partitions (of every topic, or those named) whose ISR is not all of their replicas, or that have no
        leader."""
        md = self.metadata()
        bad = []
        for name, topic in md.topics.items():
            if topics is not None and name not in topics:
                continue
            for p, part in topic.partitions.items():
                if part.leader < 0 or set(part.isrs) != set(part.replicas):
                    bad.append(f"{name}[{p}] leader {part.leader} isr {sorted(part.isrs)} replicas {sorted(part.replicas)}")
        return bad

    def wait_fenced(self, node: int, timeout_s: float = 60, poll=lambda: None) -> float:
        """Until the metadata no longer lists the broker (its session expired, or its controlled shutdown
        ended): a broker restarted before that is refused registration (finding 2)."""
        started = time.monotonic()
        deadline = started + timeout_s
        while node in self.listed_brokers():
            if time.monotonic() > deadline:
                raise TimeoutError(f"broker {node} still listed {timeout_s:.0f} s after it stopped")
            poll()
            time.sleep(0.2)
        return time.monotonic() - started

    def wait_healthy(self, timeout_s: float = 180, poll=lambda: None) -> float:
        """Until every broker is listed and every partition has a leader and its whole ISR."""
        started = time.monotonic()
        deadline = started + timeout_s
        last = "no metadata"
        while True:
            try:
                listed = self.listed_brokers()
                missing = set(BROKER_IDS) - listed
                bad = self.under_replicated() if not missing else []
                if not missing and not bad:
                    return time.monotonic() - started
                last = f"brokers not listed {sorted(missing)}" if missing else f"{len(bad)} partitions, e.g. {bad[:3]}"
            except KafkaException as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster is not healthy after {timeout_s:.0f} s: {last}")
            poll()
            time.sleep(0.5)

    def leader(self, topic: str, partition: int) -> int:
        return self.metadata().topics[topic].partitions[partition].leader

    def leaders(self, topics) -> dict[str, int]:
        md = self.metadata()
        return {f"{t}[{p}]": part.leader for t in topics for p, part in md.topics[t].partitions.items()}

    def active_controller(self) -> int:
        """The leader of the newest epoch among the running controllers' quorum-state files."""
        best = (-1, -1)
        for node in CONTROLLER_IDS:
            if self.pid(node) is None:
                continue
            try:
                state = json.loads((self.node_dir(node) / "data" / "__cluster_metadata-0" / "quorum-state").read_text())
            except (OSError, ValueError):
                continue
            if state.get("leaderId", -1) >= 0:
                best = max(best, (state.get("leaderEpoch", -1), state["leaderId"]))
        return best[1]

    def wait_new_controller(self, old: int, timeout_s: float = 60, poll=lambda: None) -> tuple[int, float]:
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            now = self.active_controller()
            if now not in (-1, old):
                return now, time.monotonic() - started
            if time.monotonic() > deadline:
                raise TimeoutError(f"no controller took over from {old} within {timeout_s:.0f} s")
            poll()
            time.sleep(0.2)

    def coordinator(self, transactional_id: str, timeout_s: float = 60) -> dict:
        """The broker that coordinates this transactional id: Kafka's TransactionsCommand (describe), and the
        leader of the __transaction_state partition its hash names; the two must agree."""
        partition = txn_state_partition(transactional_id)
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            by_hash = self.leader("__transaction_state", partition)
            described = self._describe_transaction(transactional_id)
            if described is not None and described["coordinator"] == by_hash:
                return {**described, "txn_state_partition": partition}
            last = f"tool said {described}, leader of __transaction_state[{partition}] is {by_hash}"
            time.sleep(1)
        raise TimeoutError(f"the coordinator of {transactional_id} could not be told: {last}")

    def _describe_transaction(self, transactional_id: str) -> dict | None:
        libs = sorted((REPO / ".cache" / "kafka").glob("4.3.1-*/libs"))
        if not libs:
            raise RuntimeError("Kafka's jars are not in .cache/kafka (bash deploy/kafka.sh install)")
        command = ["java", "-Xmx128m", "-XX:TieredStopAtLevel=1", "-cp", f"{libs[-1]}/*",
                   f"-Dlog4j2.configurationFile={REPO / 'deploy' / 'log4j2.properties'}", "-Dkafka.root.log.level=OFF",
                   "org.apache.kafka.tools.TransactionsCommand", "--bootstrap-server", self.bootstrap,
                   "describe", "--transactional-id", transactional_id]
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
        except subprocess.TimeoutExpired:
            return None
        lines = [line.split() for line in out.splitlines() if line.strip()]
        if len(lines) < 2 or lines[0][0] != "CoordinatorId":
            return None
        row = dict(zip(lines[0], lines[1]))
        try:
            return {"coordinator": int(row["CoordinatorId"]), "state": row.get("TransactionState"),
                    "producer_id": row.get("ProducerId"), "producer_epoch": row.get("ProducerEpoch")}
        except (KeyError, ValueError):
            return None

    def check_layout(self, topic_names) -> dict:
        """R1: replication factor 3 and min.insync.replicas 2 (and no unclean election) for the scenario's
        topics and Kafka's internal ones, read back from the cluster."""
        md = self.metadata()
        names = [*topic_names, *(t for t in INTERNAL_TOPICS if t in md.topics)]
        problems = []
        for name in names:
            topic = md.topics.get(name)
            if topic is None:
                problems.append(f"{name}: missing")
                continue
            factors = {len(p.replicas) for p in topic.partitions.values()}
            if factors != {REPLICATION_FACTOR}:
                problems.append(f"{name}: replication factors {sorted(factors)}")
        resources = [ConfigResource(ResourceType.TOPIC, n) for n in names if n in md.topics]
        admin = self.admin()  # referenced until its futures are done: a destroyed client fails them
        for resource, future in admin.describe_configs(resources, request_timeout=30).items():
            config = future.result(timeout=60)
            for key, want in WANTED_CONFIG.items():
                got = config[key].value if key in config else None
                if got != want:
                    problems.append(f"{resource.name}: {key}={got}, {want} wanted")
        return {"ok": not problems and all(t in md.topics for t in INTERNAL_TOPICS), "topics_checked": len(names),
                "internal_topics": [t for t in INTERNAL_TOPICS if t in md.topics], "problems": problems[:10]}

