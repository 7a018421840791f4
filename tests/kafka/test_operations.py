"""Watching a running processor as an operator would: Debian's Prometheus, started from the project's scrape
config (deploy/prometheus/prometheus.yml: its target, port and intervals replaced) with the project's alert
rules, scrapes `settle run --metrics-port`; queries of the ledger gauges return what the published events
make of the ledger, the stranded-capacity alert fires when a child's reconciliation times out and resolves
when an operator settles it, every dashboard expression is a query Prometheus accepts, and the compose file's
health check passes against the running processor. librdkafka's statistics reach the metrics endpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from branch_settlement.processors.kafka.clients import BranchEventProducer
from tests.kafka.pipeline import ProcessorProcess
from tests.kafka.test_metrics_unit import ALERTS, SCRAPE_CONFIG, dashboard_targets, debian_prometheus
from tests.kafka.test_processor_ops import free_port, now_ms

pytestmark = pytest.mark.kafka

PROMETHEUS = Path("/usr/bin/prometheus")
REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SHORT_RECONCILIATION = {"max_live_children": 8, "reconciliation_timeout_ms": 1_500, "lending_limit": {}}


@pytest.fixture(scope="session")
def prometheus_binary() -> Path:
    return debian_prometheus(PROMETHEUS)


class Prometheus:
    """Debian's prometheus on a free port, from deploy/prometheus/prometheus.yml with the processor's metrics
    port as its only target, scraping and evaluating the project's rules every second."""

    def __init__(self, binary: Path, directory: Path, target_port: int) -> None:
        config = yaml.safe_load(SCRAPE_CONFIG.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(ALERTS)]
        [job] = config["scrape_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
        self.job = job["job_name"]
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log_path = directory / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(binary), f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).read()
                break
            except OSError:
                assert self.proc.poll() is None, self.output()
                assert time.monotonic() < deadline, "prometheus never became ready:\n" + self.output()
                time.sleep(0.5)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as err:  # a bad query: 400 with its error in the body
            body = json.loads(err.read())
        return body

    def query(self, expr: str) -> dict[tuple, float]:
        """An instant query: {labels without job and instance: value}."""
        body = self.api("query", query=expr)
        assert body["status"] == "success", f"{expr}: {body}"
        result = {}
        for series in body["data"]["result"]:
            labels = tuple(sorted((k, v) for k, v in series["metric"].items() if k not in ("job", "instance")))
            result[labels] = float(series["value"][1])
        return result

    def value(self, expr: str) -> float | None:
        found = self.query(expr)
        assert len(found) <= 1, f"{expr}: {found}"
        return next(iter(found.values()), None)

    def alerts(self) -> dict[str, list[dict]]:
        body = self.api("alerts")
        assert body["status"] == "success", body
        alerts: dict[str, list[dict]] = {}
        for alert in body["data"]["alerts"]:
            alerts.setdefault(alert["labels"]["alertname"], []).append(alert)
        return alerts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def wait_for(description: str, check, timeout_s: float, *processes) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        for process in processes:
            assert process.proc.poll() is None, f"{description}: {process} exited:\n{process.output()}"
        assert time.monotonic() < deadline, f"{description}: not within {timeout_s:.0f} s"
        time.sleep(0.5)


def test_prometheus_scrapes_the_ledger_gauges_and_the_stranded_capacity_alert_fires_and_resolves(
        kafka_topics, tmp_path: Path, prometheus_binary: Path) -> None:
    metrics_port = free_port()
    group = f"ops-{uuid.uuid4().hex}"
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="ops", group=group,
                            extra_args=("--tick-interval-ms", "200", "--metrics-port", str(metrics_port)))
    prometheus = None
    try:
        prometheus = Prometheus(prometheus_binary, tmp_path / "prometheus", metrics_port)
        producer = BranchEventProducer({"bootstrap.servers": kafka_topics.bootstrap_servers},
                                       kafka_topics.name("branch-events"))
        gpu = {"gpu_s": {"quantity": 50, "kind": "logical"}}
        producer.parent_reserved("ops-1", capacity=gpu, lease_ttl_ms=3_600_000, policy=SHORT_RECONCILIATION,
                                 idempotency_key="ops-1/p", occurred_at_ms=now_ms())
        # x: activated with a 1.5 s lease nobody renews: it expires, reconciles for 1.5 s, and is stranded.
        producer.child_reserved("ops-1", child_id="x", branch_id="x", attempt_id="x1", quantities={"gpu_s": 30},
                                idempotency_key="ops-1/x/r", occurred_at_ms=now_ms())
        producer.child_activated("ops-1", child_id="x", attempt_id="x1", lease_generation=1, lease_ttl_ms=1_500,
                                 idempotency_key="ops-1/x/a", occurred_at_ms=now_ms())
        # y: reserved, never activated (no lease). z: activated, reports 4 of 10 and settles (released).
        producer.child_reserved("ops-1", child_id="y", branch_id="y", attempt_id="y1", quantities={"gpu_s": 5},
                                idempotency_key="ops-1/y/r", occurred_at_ms=now_ms())
        producer.child_reserved("ops-1", child_id="z", branch_id="z", attempt_id="z1", quantities={"gpu_s": 10},
                                idempotency_key="ops-1/z/r", occurred_at_ms=now_ms())
        producer.child_activated("ops-1", child_id="z", attempt_id="z1", lease_generation=1,
                                 lease_ttl_ms=3_600_000, idempotency_key="ops-1/z/a", occurred_at_ms=now_ms())
        producer.usage_reported("ops-1", child_id="z", attempt_id="z1", lease_generation=1, usage_report_id="z-1",
                                usage={"gpu_s": 4}, final=True, idempotency_key="ops-1/z/u", occurred_at_ms=now_ms())
        # A second parent, closed at once: all of it back to the pool; it is no longer in settle_capacity.
        producer.parent_reserved("ops-2", capacity={"gpu_s": {"quantity": 20, "kind": "logical"}},
                                 lease_ttl_ms=3_600_000, policy=SHORT_RECONCILIATION, idempotency_key="ops-2/p",
                                 occurred_at_ms=now_ms())
        producer.parent_closed("ops-2", outcome="succeeded", idempotency_key="ops-2/c", occurred_at_ms=now_ms())
        producer.flush()

        wait_for("x stranded, as Prometheus sees it",
                 lambda: prometheus.value('settle_children{state="stranded"}') == 1, 120, proc, prometheus)
        children = {dict(labels)["state"]: value for labels, value in prometheus.query("settle_children").items()}
        assert children == {"reserved": 1, "activated": 0, "partially_consumed": 0, "cancel_requested": 0,
                            "reconciling": 0, "stranded": 1, "committed": 0, "released": 1}, children
        parents = {dict(labels)["status"]: value for labels, value in prometheus.query("settle_parents").items()}
        assert parents == {"open": 1, "closing": 0, "expired": 0, "closed": 1}, parents
        assert prometheus.value('settle_stranded_capacity{dimension="gpu_s"}') == 30
        assert prometheus.value('settle_lease_expiries_total{kind="child"}') == 1
        assert prometheus.value('settle_lease_expiries_total{kind="parent"}') in (None, 0)
        open_terms = {dict(labels)["term"]: value
                      for labels, value in prometheus.query('settle_capacity{dimension="gpu_s"}').items()}
        # 50, of which 30 pending (x), 5 outstanding (y), 4 committed (z; its 6 back to available).
        assert open_terms == {"capacity": 50, "available": 11, "outstanding": 5, "pending": 30,
                              "awaiting_confirmation": 0, "lent": 0, "returned_to_pool": 0, "committed": 4,
                              "overdrawn": 0}, open_terms
        assert prometheus.value('settle_capacity_all_parents{term="capacity",dimension="gpu_s"}') == 70
        assert prometheus.value('settle_capacity_all_parents{term="returned_to_pool",dimension="gpu_s"}') == 20
        assert prometheus.value("settle_owned_partitions") == 8
        ledger_times = prometheus.query("time() - settle_ledger_time_seconds")
        assert len(ledger_times) == 8 and all(-5 < behind < 30 for behind in ledger_times.values()), ledger_times

        # The alert: no `for`, so it fires at the first evaluation that sees the stranded capacity.
        wait_for("SettleStrandedCapacity firing",
                 lambda: any(a["state"] == "firing" for a in prometheus.alerts().get("SettleStrandedCapacity", [])),
                 30, proc, prometheus)
        alerts = prometheus.alerts()
        [stranded] = alerts["SettleStrandedCapacity"]
        assert stranded["labels"]["dimension"] == "gpu_s" and stranded["labels"]["severity"] == "warning"
        assert stranded["annotations"]["summary"] == f"30 of gpu_s is stranded on 127.0.0.1:{metrics_port}"
        assert set(alerts) == {"SettleStrandedCapacity"}, alerts  # a healthy processor alerts nothing else

        # Every dashboard expression is a query Prometheus accepts (Grafana's variables as it substitutes them).
        for title, expr in dashboard_targets():
            query = expr.replace("$instance", ".*").replace("$__rate_interval", "1m")
            body = prometheus.api("query", query=query)
            assert body["status"] == "success", f"panel {title!r}: {query}: {body}"
        # docker-compose.yml's health check, as the container runs it, against this processor.
        check = COMPOSE["services"]["processor"]["healthcheck"]["test"]
        health = subprocess.run([sys.executable, *check[2:]], capture_output=True, text=True, timeout=30,
                                env={**os.environ, "SETTLE_METRICS_PORT": str(metrics_port)})
        assert health.returncode == 0, health.stderr

        # An operator resolves x: the stranded capacity is freed, and the alert resolves.
        producer.reconciliation_resolved("ops-1", child_id="x", attempt_id="x1", usage={"gpu_s": 12},
                                         resolution="operator", idempotency_key="ops-1/x/resolved",
                                         occurred_at_ms=now_ms())
        producer.flush()
        wait_for("stranded capacity freed",
                 lambda: prometheus.value('settle_stranded_capacity{dimension="gpu_s"}') == 0, 60, proc, prometheus)
        wait_for("SettleStrandedCapacity resolved", lambda: "SettleStrandedCapacity" not in prometheus.alerts(),
                 30, proc, prometheus)
        assert prometheus.value('settle_children{state="released"}') == 2
        assert prometheus.value('settle_capacity{term="committed",dimension="gpu_s"}') == 16
        assert prometheus.value('settle_capacity{term="available",dimension="gpu_s"}') == 50 - 5 - 16
        assert prometheus.value('sum(settle_released_quantity_total{dimension="gpu_s",destination="parent"})') == 6 + 18
    finally:
        if prometheus is not None:
            prometheus.stop()
        assert proc.stop() == 0, proc.output()[-3000:]


def test_librdkafka_statistics_reach_the_metrics_endpoint(kafka_topics, tmp_path: Path) -> None:
    metrics_port = free_port()
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="stats",
                            group=f"stats-{uuid.uuid4().hex}",
                            extra_args=("--metrics-port", str(metrics_port), "--tick-interval-ms", "200",
                                        "--kafka-config", "statistics.interval.ms=100"))
    try:
        producer = BranchEventProducer({"bootstrap.servers": kafka_topics.bootstrap_servers},
                                       kafka_topics.name("branch-events"))
        for n in range(20):
            producer.parent_reserved(f"stats-{n}", capacity={"gpu_s": {"quantity": 5, "kind": "logical"}},
                                     lease_ttl_ms=3_600_000, policy=SHORT_RECONCILIATION,
                                     idempotency_key=f"stats-{n}/p", occurred_at_ms=now_ms())
        producer.flush()

        def scrape() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            return dict((line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                        if line and not line.startswith("#"))

        def ready() -> bool:
            try:
                values = scrape()
            except OSError:
                return False
            lags = [v for k, v in values.items() if k.startswith("settle_kafka_consumer_lag{")]
            return values.get("settle_kafka_assigned_partitions") == 8 and len(lags) >= 1

        wait_for("librdkafka statistics on the endpoint", ready, 60, proc)
        values = scrape()
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    lags = {k: v for k, v in values.items() if k.startswith("settle_kafka_consumer_lag{")}
    assert all(v == 0 for v in lags.values()), lags  # every record published was handed to the processor
    assert values["settle_kafka_producer_queue_messages"] >= 0
    assert abs(values['settle_kafka_statistics_timestamp_seconds{client="consumer"}'] - time.time()) < 60
