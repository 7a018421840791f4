"""docker-compose.yml cannot run here (no Docker engine), so check what can go wrong without one: it parses,
it runs the Kafka version deploy/kafka.sh runs, its provisioning command is one `settle topics` accepts and
yields exactly deploy/topics.json, and the processor is pointed at the same cluster and topic names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from branch_settlement.processors.cli.main import build_parser
from branch_settlement.processors.kafka import config as processor_config
from branch_settlement.processors.kafka import topics
from branch_settlement.processors.kafka.config import ProcessorConfig

pytestmark = pytest.mark.unit

REPO_DIR = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO_DIR / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DOCKERFILE = (REPO_DIR / "deploy" / "Dockerfile").read_text()


def compose_default(value: str) -> str:
    """What Compose substitutes for `${NAME:-default}` when NAME is unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def environment(service: str) -> dict[str, str]:
    return {key: compose_default(value) for key, value in SERVICES[service]["environment"].items()}


def test_compose_runs_the_kafka_version_of_deploy_kafka_sh():
    pinned = re.search(r"^readonly KAFKA_VERSION=(\S+)$", (REPO_DIR / "deploy" / "kafka.sh").read_text(), re.M)
    assert SERVICES["kafka"]["image"] == f"apache/kafka:{pinned.group(1)}"


def test_kafka_is_a_single_kraft_node_configured_like_the_local_broker():
    env = SERVICES["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert str(env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"]) == "false"
    for key in ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
                "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "KAFKA_DEFAULT_REPLICATION_FACTOR"):
        assert int(env[key]) == 1, key


def test_provisioning_command_is_valid_and_yields_exactly_the_spec():
    command = [compose_default(part) for part in SERVICES["topics"]["command"]]
    args = build_parser().parse_args(command)
    assert (args.command, args.topics_command) == ("topics", "apply")

    env = environment("topics")
    provisioned = topics.load_spec(REPO_DIR / "deploy" / "topics.json", prefix=env["SETTLE_TOPIC_PREFIX"],
                                   partitions=args.partitions)
    assert provisioned == topics.load_spec(REPO_DIR / "deploy" / "topics.json")


def test_the_image_installs_the_spec_with_the_package():
    """The topic spec and the ACL set are package data (the installed commands' defaults): the image needs no
    copy of its own, nor a SETTLE_TOPIC_SPEC pointing at one."""
    assert "COPY deploy ./deploy" in DOCKERFILE and "SETTLE_TOPIC_SPEC" not in DOCKERFILE
    ignore = (REPO_DIR / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert {"!deploy/topics.json", "!deploy/acls.json"} <= set(ignore)
    assert "SETTLE_TOPIC_SPEC" not in environment("topics") and "SETTLE_TOPIC_SPEC" not in environment("processor")
    assert 'ENTRYPOINT ["settle"]' in DOCKERFILE


def test_processor_uses_the_cluster_and_topic_names_that_were_provisioned():
    provisioning, processor = environment("topics"), environment("processor")
    for key in ("SETTLE_BOOTSTRAP_SERVERS", "SETTLE_TOPIC_PREFIX"):
        assert processor[key] == provisioning[key], key
    advertised = SERVICES["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"INTERNAL://{processor['SETTLE_BOOTSTRAP_SERVERS']}" in advertised.split(",")


def test_processor_command_and_environment_are_ones_settle_run_knows():
    args = build_parser().parse_args(SERVICES["processor"]["command"])
    assert args.command == "run"
    # A misspelt variable would be ignored silently and the processor would run on its defaults.
    known = {processor_config.env_name(setting.name) for setting in dataclasses.fields(ProcessorConfig)}
    assert set(environment("processor")) <= known
    config = processor_config.load(None, environ=environment("processor"))
    assert config.state_dir in {volume.split(":")[1] for volume in SERVICES["processor"]["volumes"]}


def test_services_start_in_order_broker_topics_processor():
    assert SERVICES["topics"]["depends_on"] == {"kafka": {"condition": "service_healthy"}}
    assert SERVICES["processor"]["depends_on"] == {"topics": {"condition": "service_completed_successfully"}}
    assert SERVICES["topics"]["restart"] == "no"


def test_the_image_copies_every_folder_the_package_is_built_from() -> None:
    """The Dockerfile builds the wheel from the source folders: each one pyproject.toml maps must be copied and
    let through the build context's ignore file, or `pip install .` fails inside the image."""
    import tomllib

    package_dirs = tomllib.loads((REPO_DIR / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    ignore = (REPO_DIR / "deploy" / "Dockerfile.dockerignore").read_text().split()
    for folder in package_dirs.values():
        assert f"COPY {folder} ./{folder}" in DOCKERFILE, folder
        assert f"!{folder}/" in ignore, folder


# -- the processor's slot, metrics and health check ------------------------------------------------------------


def test_processor_has_a_stable_worker_slot():
    """The slot makes the transactional.id: the container's host name changes with every re-creation, and a
    new id cannot fence the old one's producer (its open transaction then blocks the partitions until it
    times out)."""
    env = environment("processor")
    assert env.get("SETTLE_WORKER_SLOT"), "the processor needs a fixed SETTLE_WORKER_SLOT"
    assert "$" not in str(SERVICES["processor"]["environment"]["SETTLE_WORKER_SLOT"])
    assert "hostname" not in SERVICES["processor"] and "SETTLE_WORKER_SLOT" not in environment("topics")
    config = processor_config.load(None, environ=env)
    assert config.worker_slot == env["SETTLE_WORKER_SLOT"]
    assert config.transactional_id == f"branch-settlement-{env['SETTLE_WORKER_SLOT']}"


def test_processor_serves_its_metrics_on_the_published_port():
    config = processor_config.load(None, environ=environment("processor"))
    assert config.metrics_port > 0
    # Published on the host's loopback only, as the broker is.
    assert f"127.0.0.1:{config.metrics_port}:{config.metrics_port}" in SERVICES["processor"]["ports"]


def _healthcheck(monkeypatch, metrics_text: str | None) -> int:
    """The exit code of the processor's health check run against a metrics endpoint serving `metrics_text`
    (None: nothing answers). Run in this process, with the endpoint's fetch replaced, so no socket is needed."""
    import urllib.error
    import urllib.request

    test = SERVICES["processor"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    fetched = []

    class Response:
        def read(self) -> bytes:
            return metrics_text.encode()

    def urlopen(url, timeout):
        fetched.append(url)
        if metrics_text is None:
            raise urllib.error.URLError("connection refused")
        return Response()

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setenv("SETTLE_METRICS_PORT", environment("processor")["SETTLE_METRICS_PORT"])
    try:
        exec(compile(test[3], "healthcheck", "exec"), {})
    except SystemExit as done:
        code = done.code
    except Exception:  # what `python -c` exits 1 for
        code = 1
    else:
        code = 0
    if metrics_text is not None:
        assert fetched == [f"http://127.0.0.1:{environment('processor')['SETTLE_METRICS_PORT']}/metrics"]
    return code


def test_the_health_check_reads_the_processors_own_metrics(monkeypatch):
    import time

    from prometheus_client import generate_latest

    from branch_settlement.processors.kafka.metrics import Metrics

    def served(owned: int, last_commit: float) -> str:
        metrics = Metrics()
        metrics.owned_partitions.set(owned)
        metrics.last_commit.set(last_commit)
        return generate_latest(metrics.registry).decode()

    assert _healthcheck(monkeypatch, served(0, 0)) == 0  # starting, restoring, or a member without partitions
    assert _healthcheck(monkeypatch, served(4, time.time() - 2)) == 0
    assert _healthcheck(monkeypatch, served(4, time.time() - 600)) == 1  # owns partitions, commits nothing
    assert _healthcheck(monkeypatch, None) != 0  # the endpoint does not answer
    hc = SERVICES["processor"]["healthcheck"]
    assert "$" not in hc["test"][3]  # Compose would interpolate it
    assert hc["start_period"] and hc["interval"] and hc["retries"] >= 1
